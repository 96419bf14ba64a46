#!/usr/bin/env bash
# Run 13, call 2 (after the radix select was dropped, emit_top's rule set, the forward's warps for 128-row tiles):
# GPU tests of the routing / top-k paths (emit_top 3 is now the default at 64K), the op and CUDA-graph tests, then
# A/B of the fused attention's query tile (fwd.bm_max 64 / 128, forward and forward + backward) of emit_top at 1M, and the
# top-k scan settings at Figure F's 64K x 16 layer.
set -u
export PYTHONPATH=$PWD
O=$OUT/call2; mkdir -p "$O"
py=python
step() { local t=$1 name=$2; shift 2; echo "== $name ($(date -u +%T))"; timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? $name"; tail -2 "$O/$name.log"; }
step 120 t_routing $py -m pytest -q tests/test_triton_routing.py -k "gpu or sparse"
step 90 t_mita $py -m pytest -q tests/test_triton_mita.py -k "gpu_matches_naive and 65536"
step 70 t_op_graph $py -m pytest -q -m gpu tests/test_triton_op.py tests/test_cuda_graph.py tests/test_topk_overflow.py
step 100 ab_bm $py scripts/bench/ab_scan.py --sweep fwd.bm_max=64,128 --points 262144:256,1048576:512 --rho 0 --timing cuda_graph --backward
step 60 ab_bm_b16 $py scripts/bench/ab_scan.py --sweep fwd.bm_max=64,128 --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --backward
step 50 ab_emit_1m $py scripts/bench/ab_scan.py --sweep emit_top=2,3 --points 1048576:512 --rho 0 --timing cuda_graph
step 90 tune_topk $py scripts/bench/tune_long.py --points N65536xB16 --parts topk
echo "== done $(date -u +%T)"
