#!/usr/bin/env bash
# Run 23, call 2: the start / final bisections two steps per reduction (bisect_pair, new default) against one step;
# the 1D pooling in one step for segments of <= 512 rows (whole, new default) against 128-row steps; then the op
# benchmark at the new defaults (CUDA graphs, 64K, 256K, 1M in one process).
C=call2
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 45 pool $py scripts/bench/pool_bench.py --points 65536:128,262144:256,1048576:512 --variants "|whole=0||whole=0"
step 200 ab_pair $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "|bisect_pair=0|"
step 300 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
finish
