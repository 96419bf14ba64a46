#!/usr/bin/env bash
# Run 17, call 4 (final_sort default 1: the final top-k kernel orders the chosen indices by one tl.sort): A/B of
# final_sort 1 / 0, the GPU tests of the routing kernels and of the whole op against naive_mita on this tree, and the
# op benchmark (CUDA graph) at the shipped defaults.
C=call4
source results/bench/call_lib.sh
step 70 ab_sort $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --sweep final_sort=1,0
step 90 t_routing $py -m pytest -q tests/test_triton_routing.py -m gpu
step 190 t_mita $py -m pytest -q tests/test_triton_mita.py -m gpu -k "gpu_matches_naive"
step 120 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
finish
