#!/usr/bin/env bash
# Run 14, call 1: the shared-entry attention folded into the routing kernel (FWD_CONFIG shared_in_route): its GPU
# tests, its A/B (CUDA-graph replays, forward and forward + backward) at 64K, 256K, 1M and Figure F's 64K x 16
# layer, the routing kernel's tile with it, and the per-pass profile at B 1. Logs go to $OUT/call1.
set -u
export PYTHONPATH=$PWD
O=$OUT/call1; mkdir -p "$O"
py=python
step() { local t=$1 name=$2; shift 2; echo "== $name ($(date -u +%T))"; timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? $name"; tail -3 "$O/$name.log"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > "$O/env.txt" 2>&1
$py -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$O/env.txt"
step 130 test_fold $py -m pytest -q -x tests/test_triton_mita.py -k "gpu_shared_in_route" -p no:cacheprovider
step 60 test_route_out $py -m pytest -q -x tests/test_triton_routing.py -k "route_shared_out" -p no:cacheprovider
step 100 ab_fold $py scripts/bench/ab_scan.py --sweep fwd.shared_in_route=0,1 --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --backward
step 60 ab_fold_b16 $py scripts/bench/ab_scan.py --sweep fwd.shared_in_route=0,1 --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --backward
step 60 ab_route_tile $py scripts/bench/ab_scan.py --set "fwd.shared_in_route=1" --sweep route.bm=128,64 --points 65536:128,1048576:512 --rho 0 --timing cuda_graph
step 60 profile $py scripts/bench/profile_stages.py --points N65536,N262144
echo "== done $(date -u +%T)"
