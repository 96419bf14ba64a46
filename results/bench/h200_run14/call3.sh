#!/usr/bin/env bash
# Run 14, call 3: fallback passes with a work counter (programs take items from a per-launch atomic counter, so
# late or early programs balance): GPU tests of the fallback paths, the A/B against one program per item on i.i.d.
# and correlated tokens, then the op benchmark (eager and CUDA-graph replays) against cuDNN.
set -u
export PYTHONPATH=$PWD
O=$OUT/call3; mkdir -p "$O"
py=python
step() { local t=$1 name=$2; shift 2; echo "== $name ($(date -u +%T))"; timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? $name"; tail -3 "$O/$name.log"; }
step 120 t_fallback $py -m pytest -q tests/test_triton_routing.py -k "gpu and (correlated or fallback)" -p no:cacheprovider
step 70 ab_fb $py scripts/bench/ab_scan.py --sweep fb_programs=0,None,1056 --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph
step 80 ab_fb_corr $py scripts/bench/ab_scan.py --sweep fb_programs=0,None,1056 --points 65536:128,1048576:512 --rho 0.9 --timing cuda_graph
step 110 op_bench $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2
step 110 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
echo "== done $(date -u +%T)"
