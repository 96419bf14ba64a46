#!/usr/bin/env bash
# Run 16, call 2: launch settings of the fused MLP kernel (erf from an erfc fit, x1 parked in the output buffer,
# register caps, tiles) against PyTorch's modules; Figure F with the fused MLP at 1M, and at 64K with a second
# setting; the count + emit pass's key blocks per step (SCAN_CONFIG emit_bb). Only the log archive comes back.
C=call2
source results/bench/call_lib.sh
step 150 mlp_bench $py scripts/bench/mlp_bench.py --rows 1048576,65536
mkdir -p "$O/m1" "$O/poly"
step 110 figf1m $py scripts/bench/bench_figf.py --out "$O/m1" --compile --fused-mlp --min-n 1048576 --max-n 1048576 --dense cudnn --time-budget-s 80
step 90 figf64k_poly $py scripts/bench/bench_figf.py --out "$O/poly" --compile --fused-mlp --mlp-config erf_poly=1,reload=1 --min-n 65536 --max-n 65536 --dense cudnn --time-budget-s 60 --compile-start-tokens 1048576
step 90 ab_emit $py scripts/bench/ab_scan.py --points 1048576:512,65536:128 --rho 0 --timing cuda_graph --sweep emit_bb=None,16,8
step 70 ab_emit_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --sweep emit_bb=None,16,8
step 40 t_mlp $py -m pytest -q tests/test_fused_mlp.py -p no:cacheprovider
finish
