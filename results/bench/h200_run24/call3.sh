#!/usr/bin/env bash
# Run 24, call 3 (run-22 kernels): repeats of the 64K op point, queued replays (GPU execution time) and idle-GPU
# replays alternating, one process each on one machine; then the routing kernel's pipelining depth A/B at 64K.
C=call3
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
for i in 1 2 3; do
    step 120 op_queued_$i $py scripts/bench/bench_op.py --out "$O/queued_$i" --points N65536 --backends triton --graph --queued
    step 80 op_idle_$i $py scripts/bench/bench_op.py --out "$O/idle_$i" --points N65536 --backends triton --graph
done
step 90 ab_route $py scripts/bench/ab_scan.py --points 65536:128 --rho 0 --timing cuda_graph --reps 20 --variants "|route.stages=3|route.stages=1|"
finish
