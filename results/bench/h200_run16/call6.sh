#!/usr/bin/env bash
# Run 16, call 6: Figure F at 64K with the fused MLP and bench_figf.py's new gate for it (fused_mlp_correct, bf16 on
# the GPU). Only the log archive comes back.
C=call6
source results/bench/call_lib.sh
step 110 figf64k_fused $py scripts/bench/bench_figf.py --out "$O" --compile --fused-mlp --min-n 65536 --max-n 65536 --dense cudnn --time-budget-s 60 --compile-start-tokens 1048576
finish
