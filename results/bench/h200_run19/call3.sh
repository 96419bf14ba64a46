#!/usr/bin/env bash
# Run 19, call 3 (defaults: + start_narrow, final_narrow: the start and final kernels' bisections over the row's own
# key range): GPU tests of the top-k, A/B of the two settings, the op benchmark (CUDA graphs) at the defaults, and
# the direct-launch GPU test that call 2's step limit cut.
C=call3
source results/bench/call_lib.sh
step 110 t_routing $py -m pytest -q tests/test_triton_routing.py -m gpu -k "start_steps or atomic_and_fallback or correlated"
step 70 ab $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "|start_narrow=0|final_narrow=0|start_narrow=0;final_narrow=0|"
step 40 ab_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --reps 20 --variants "|start_narrow=0;final_narrow=0|"
step 130 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
step 80 t_launch $py -m pytest -q tests/test_launch.py -m gpu
finish
