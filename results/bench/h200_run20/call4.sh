#!/usr/bin/env bash
# Run 20, call 4: the persistent fallback with L2 loads (.cg) of what its own programs wrote, instead of volatile
# loads: the passes in place and the CUDA-graph forward where rows overflow; its GPU test (grid barriers, graphs).
C=call4
source results/bench/call_lib.sh
step 150 t_fb $py -m pytest -q -x tests/test_triton_routing.py -m gpu -k "persistent_fallback or correlated"
step 60 fb $py scripts/bench/fallback_bench.py --points 65536:128 --reps 10 --variants "fallback=0|fallback=1"
step 60 ab_ar $py scripts/bench/ab_scan.py --points 65536:128 --rho 0.9 --timing cuda_graph --reps 20 --variants "|fallback=0|"
finish
