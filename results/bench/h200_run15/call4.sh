#!/usr/bin/env bash
# Run 15, call 4: the shipped defaults after calls 1-3 (fused forward: 2 stages and a 96-register cap for 64-row
# tiles of 64-key blocks at d 64; final top-k kernel capped at 96 registers for lists of up to 512 entries; start
# kernel with contiguous one-plane loads and an int32 bisection): the op benchmark (CUDA graph, then eager) and
# Figure F with both models compiled, as run 13 call 3 ran them. Only the log archive comes back.
C=call4
source results/bench/call_lib.sh
step 110 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
step 170 figf $py scripts/bench/bench_figf.py --out "$O" --compile --min-n 65536 --max-n 262144 --dense cudnn --time-budget-s 140 --compile-start-tokens 1048576
mkdir -p "$O/m1"
step 90 figf1m $py scripts/bench/bench_figf.py --out "$O/m1" --compile --min-n 1048576 --max-n 1048576 --dense cudnn --time-budget-s 70
step 110 op_bench $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2
echo "== done $(date -u +%T)"
