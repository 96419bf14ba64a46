#!/usr/bin/env bash
# Run 21, call 4: the per-row select kernel (fused_select 1, the new default) against the start + count + emit +
# final kernels (fused_select 0): forward side by side; AR(1) 0.9 tokens (rows overflow); kernels in launch order;
# GPU tests of the top-k paths.
C=call4
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 240 ab $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "|fused_select=0|"
step 90 ab_ar $py scripts/bench/ab_scan.py --points 65536:128 --rho 0.9 --timing cuda_graph --reps 20 --variants "|fused_select=0"
step 120 kprof $py scripts/bench/kernel_profile.py --points N65536,N262144 --sequence
step 150 t_routing $py -m pytest -x -q tests/test_triton_routing.py -m gpu -k "persistent_fallback or correlated or atomic_and_fallback"
finish
