#!/usr/bin/env bash
# Run 20, call 5 (the shipped kernels: persistent fallback with .cg loads and the early stop of its refinement,
# merge in the final kernel): GPU tests of the fallback paths, the forward side by side with the ten launches
# (i.i.d. and AR(1) tokens), and the op benchmark (CUDA graphs).
C=call5
source results/bench/call_lib.sh
step 150 t_fb $py -m pytest -q tests/test_triton_routing.py -m gpu -k "persistent_fallback or correlated or atomic_and_fallback"
step 50 ab_ar $py scripts/bench/ab_scan.py --points 65536:128,262144:256 --rho 0.9 --timing cuda_graph --reps 20 --variants "|fallback=0|"
step 70 ab $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "|fallback=0|"
step 130 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
finish
