#!/usr/bin/env bash
# Run 19, call 2 (defaults: start_steps 20; programmatic dependent launch dropped after call 1): the op benchmark
# (CUDA graphs), Figure F compiled with the fused MLP at 64K..256K, start_steps 16 / 20 / 32 side by side, and the
# GPU tests of the early-stopped start and of the direct launches.
C=call2
source results/bench/call_lib.sh
step 130 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
step 150 figf_fused $py scripts/bench/bench_figf.py --out "$O" --compile --fused-mlp --min-n 65536 --max-n 262144 --dense cudnn --time-budget-s 120 --compile-start-tokens 1048576
step 60 ab $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "|start_steps=16|start_steps=32|"
step 100 t_routing $py -m pytest -q tests/test_triton_routing.py -m gpu -k "start_steps or correlated or atomic_and_fallback"
step 50 t_launch $py -m pytest -q tests/test_launch.py -m gpu
finish
