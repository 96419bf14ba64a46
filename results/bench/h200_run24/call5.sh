#!/usr/bin/env bash
# Run 24, call 5 (run-22 kernels): Figure F at 1M tokens (both models compiled, the fused MLP kernel in both), not
# re-measured since run 19 (its settings).
C=call5
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 200 figf_1m $py scripts/bench/bench_figf.py --out "$O" --compile --fused-mlp --min-n 1048576 --max-n 1048576 --dense cudnn --time-budget-s 120
finish
