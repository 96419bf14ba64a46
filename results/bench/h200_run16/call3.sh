#!/usr/bin/env bash
# Run 16, call 3: the fused MLP kernel's settings around call 2's best (hidden steps of 32 columns, x1 parked in the
# output buffer; compile_check.py: 168 registers, 3 programs per SM), then Figure F with that setting in both models
# at 64K..256K and 1M (compiled). Only the log archive comes back.
C=call3
source results/bench/call_lib.sh
step 170 mlp_bench $py scripts/bench/mlp_bench.py --rows 1048576,65536
mkdir -p "$O/m1"
step 150 figf_fused $py scripts/bench/bench_figf.py --out "$O" --compile --fused-mlp --mlp-config bh=32,reload=1,erf_poly=1 --min-n 65536 --max-n 262144 --dense cudnn --time-budget-s 120 --compile-start-tokens 1048576
step 160 figf1m $py scripts/bench/bench_figf.py --out "$O/m1" --compile --fused-mlp --mlp-config bh=32,reload=1,erf_poly=1 --min-n 1048576 --max-n 1048576 --dense cudnn --time-budget-s 120
finish
