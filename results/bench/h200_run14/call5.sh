#!/usr/bin/env bash
# Run 14, call 5 (fallback passes one program per item, gated by the overflow flag: the default from this call on, see
# CALLS.md): op benchmark against cuDNN (eager and CUDA-graph replays) and Figure F with both models compiled.
set -u
export PYTHONPATH=$PWD
O=$OUT/call5; mkdir -p "$O"
py=python
step() { local t=$1 name=$2; shift 2; echo "== $name ($(date -u +%T))"; timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? $name"; tail -4 "$O/$name.log"; }
step 110 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
step 170 figf $py scripts/bench/bench_figf.py --out "$O" --compile --min-n 65536 --max-n 262144 --dense cudnn --time-budget-s 140 --compile-start-tokens 1048576
mkdir -p "$O/m1"
step 90 figf1m $py scripts/bench/bench_figf.py --out "$O/m1" --compile --min-n 1048576 --max-n 1048576 --dense cudnn --time-budget-s 70
step 100 op_bench $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2
echo "== done $(date -u +%T)"
