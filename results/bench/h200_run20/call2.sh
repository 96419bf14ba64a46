#!/usr/bin/env bash
# Run 20, call 2: why the persistent fallback is slower where rows overflow (call 1: AR(1) 0.9 at 64K, top-k 0.372
# against 0.210 ms): each pass timed in place for the ten launches, the persistent kernel, its volatile-poll barrier
# and fewer programs; then the op's GPU tests against naive_mita at the new defaults (merge in the final kernel).
C=call2
source results/bench/call_lib.sh
step 120 fb $py scripts/bench/fallback_bench.py --points 65536:128,262144:256 --reps 10 --variants "fallback=0|fallback=1|fallback=1;fb_spin=1|fallback=1;fb_programs=64"
step 200 t_mita $py -m pytest -q tests/test_triton_mita.py -m gpu -k "gpu_matches_naive and (65536 or 4097)"
finish
