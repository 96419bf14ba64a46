#!/usr/bin/env bash
# Run 13, call 1: the three-plane sparse emit, the radix select and the one-loop forward: their
# A/B (CUDA-graph replays, one process per sweep), the forward settings at Figure F's 64K x 16 layer and at 1M, and
# the per-pass profile. Every step has its own time limit; logs go to $OUT/call1.
set -u
export PYTHONPATH=$PWD
O=$OUT/call1; mkdir -p "$O"
py=python
step() { local t=$1 name=$2; shift 2; echo "== $name ($(date -u +%T))"; timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? $name"; tail -2 "$O/$name.log"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > "$O/env.txt" 2>&1
$py -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$O/env.txt"
step 80 ab_emit $py scripts/bench/ab_scan.py --sweep emit_top=2,3 --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph
step 50 ab_emit_b16 $py scripts/bench/ab_scan.py --sweep emit_top=2,3 --points 65536:128 --batch 16 --rho 0 --timing cuda_graph
step 70 ab_select $py scripts/bench/ab_scan.py --sweep select=bisect,radix --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph
step 40 ab_select_b16 $py scripts/bench/ab_scan.py --sweep select=bisect,radix --points 65536:128 --batch 16 --rho 0 --timing cuda_graph
step 110 tune_fwd $py scripts/bench/tune_long.py --points N65536xB16,N1048576 --parts fwd
step 60 profile $py scripts/bench/profile_stages.py --points N65536xB16,N1048576
echo "== done $(date -u +%T)"
