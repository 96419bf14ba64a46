#!/usr/bin/env bash
# Run 24, call 1: the select kernel and the persistent fallback in one launch (SCAN_CONFIG select_fb): its GPU tests
# (bitwise against the two launches, CUDA-graph replays, overflowing rows), the forward A/B at 64K and 256K, and the
# op benchmark at 64K with it and without (two processes).
C=call1
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 170 gputests $py -m pytest -q -m gpu tests/test_triton_routing.py -k "select_and_fallback_in_one_launch or persistent_fallback_graph_replays"
step 170 ab_sfb $py scripts/bench/ab_scan.py --points 65536:128,262144:256 --rho 0 --timing cuda_graph --reps 20 --variants "|select_fb=1||select_fb=1"
step 100 op_sfb $py scripts/bench/bench_op.py --out "$O/sfb" --points N65536 --backends triton --dense-long cudnn --graph --set "select_fb=1"
step 100 op_def $py scripts/bench/bench_op.py --out "$O/def" --points N65536 --backends triton --dense-long cudnn --graph
finish
