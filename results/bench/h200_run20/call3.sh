#!/usr/bin/env bash
# Run 20, call 3: the persistent fallback with as many programs as the SMs hold (2 per SM at 249 registers) against
# one per SM and the ten launches: passes in place on overflowing inputs, then CUDA-graph forwards (i.i.d., AR(1)).
C=call3
source results/bench/call_lib.sh
step 100 fb $py scripts/bench/fallback_bench.py --points 65536:128,262144:256 --reps 10 --variants "fallback=0|fallback=1|fallback=1;fb_programs=132"
step 60 ab_ar $py scripts/bench/ab_scan.py --points 65536:128,262144:256 --rho 0.9 --timing cuda_graph --reps 20 --variants "|fallback=0|fb_programs=132|"
step 90 ab $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "|merge_in_final=0|fb_programs=132|"
finish
