#!/usr/bin/env bash
# Run 14, call 4: the fallback passes' layouts, both now gated by the overflow flag: one program per item (0) against
# 4 programs per SM taking items from a counter (None), on i.i.d. tokens (no row overflows) and correlated tokens.
set -u
export PYTHONPATH=$PWD
O=$OUT/call4; mkdir -p "$O"
py=python
step() { local t=$1 name=$2; shift 2; echo "== $name ($(date -u +%T))"; timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? $name"; tail -3 "$O/$name.log"; }
step 60 ab_fb $py scripts/bench/ab_scan.py --sweep fb_programs=0,None --points 65536:128,262144:256 --rho 0 --timing cuda_graph
step 30 ab_fb_b16 $py scripts/bench/ab_scan.py --sweep fb_programs=0,None --points 65536:128 --batch 16 --rho 0 --timing cuda_graph
step 40 ab_fb_corr $py scripts/bench/ab_scan.py --sweep fb_programs=0,None --points 65536:128 --rho 0.9 --timing cuda_graph
echo "== done $(date -u +%T)"
