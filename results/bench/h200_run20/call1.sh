#!/usr/bin/env bash
# Run 20, call 1: the persistent fallback kernel (fallback=1) and the landmark-value merge in the final top-k kernel
# (merge_in_final=1), both new defaults: GPU tests (grid barriers, CUDA graph replays, overflow rows), A/B against
# the old launches side by side, AR(1) tokens (rows overflow), and the op benchmark at the new defaults.
C=call1
source results/bench/call_lib.sh
step 170 t_routing $py -m pytest -q -x tests/test_triton_routing.py -m gpu -k "persistent_fallback or atomic_and_fallback or correlated"
step 100 ab $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "|fallback=0|merge_in_final=0|fallback=0;merge_in_final=0|"
step 50 ab_ar $py scripts/bench/ab_scan.py --points 65536:128,262144:256 --rho 0.9 --timing cuda_graph --reps 20 --variants "|fallback=0|"
step 40 ab_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --reps 20 --variants "|fallback=0;merge_in_final=0|"
step 130 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
finish
