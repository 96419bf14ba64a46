#!/usr/bin/env bash
# Run 20, call 5: the routing plan's chunking (more, shorter chunks; warps of the scatter) at the op points; the op
# benchmark (CUDA graphs) and Figure F at 64K-256K at this commit's defaults.
C=call5
source results/bench/call_lib.sh
for s in "" "_PLAN_PROGRAMS=4096" "_PLAN_PROGRAMS=8192" "_PLAN_WARPS=2" "_PLAN_STEP=32"; do
    step 40 "plan${s:+_$s}" $py scripts/bench/plan_bench.py --points 2:65536:128,2:262144:256,2:1048576:512 --dists uniform ${s:+--set $s}
done
step 130 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
step 170 figf $py scripts/bench/bench_figf.py --out "$O" --compile --fused-mlp --min-n 65536 --max-n 262144 --dense cudnn --time-budget-s 120 --compile-start-tokens 1048576
finish
