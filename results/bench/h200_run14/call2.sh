#!/usr/bin/env bash
# Run 14, call 2: the persistent fallback passes of the long-row top-k (SCAN_CONFIG fb_programs, gated by the
# overflow flag): GPU tests of the top-k (both layouts) and of shared_in_route (test fixed), then the A/B on i.i.d.
# tokens (no row overflows: the passes return at once) and on correlated tokens (rows overflow: the passes work).
set -u
export PYTHONPATH=$PWD
O=$OUT/call2; mkdir -p "$O"
py=python
step() { local t=$1 name=$2; shift 2; echo "== $name ($(date -u +%T))"; timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? $name"; tail -3 "$O/$name.log"; }
step 150 t_routing $py -m pytest -q tests/test_triton_routing.py -k "gpu" -p no:cacheprovider
step 100 t_fold $py -m pytest -q tests/test_triton_mita.py -k "gpu_shared_in_route" -p no:cacheprovider
step 80 ab_fb $py scripts/bench/ab_scan.py --sweep fb_programs=0,None --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph
step 40 ab_fb_b16 $py scripts/bench/ab_scan.py --sweep fb_programs=0,None --points 65536:128 --batch 16 --rho 0 --timing cuda_graph
step 90 ab_fb_corr $py scripts/bench/ab_scan.py --sweep fb_programs=0,None,1056 --points 65536:128,1048576:512 --rho 0.9 --timing cuda_graph
step 60 kprof $py scripts/bench/kernel_profile.py --points N65536,N65536xB16
echo "== done $(date -u +%T)"
