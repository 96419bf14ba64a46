#!/usr/bin/env bash
# Run 23, call 3: programmatic dependent launch for chosen kernels only (the fused attention after the fallback
# kernel, and the fallback after the select kernel) at 64K; the 1D pooling kernel's duration under Nsight Compute in
# one 512-row step against 128-row steps; GPU tests of this run's changes and of the op against naive_mita.
C=call3
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 150 ab_pdl $py scripts/bench/ab_scan.py --points 65536:128 --rho 0 --timing cuda_graph --reps 30 --variants "|pdl.enabled=1;pdl.only=fallback+mita_fwd|pdl.enabled=1;pdl.only=select+fallback+mita_fwd|pdl.enabled=1||pdl.enabled=1;pdl.only=fallback+mita_fwd"
step 90 ncu_pool ncu --clock-control none --kernel-name _pool1d_fwd_kernel --section SpeedOfLight --csv $py scripts/bench/pool_bench.py --points 65536:128,262144:256 --variants "|whole=0||whole=0" --reps 3
step 250 t_gpu $py -m pytest -q tests/test_triton_routing.py tests/test_triton_mita.py -m gpu -k "pdl or select_kernel or (gpu_matches_naive and (65536 or 4097))"
finish
