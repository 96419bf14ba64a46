#!/usr/bin/env bash
# Run 19, call 5 (shipped defaults, as calls 3-4): Figure F at 1M, both models compiled, fused MLP in both.
C=call5
source results/bench/call_lib.sh
step 170 figf1m $py scripts/bench/bench_figf.py --out "$O" --compile --fused-mlp --min-n 1048576 --max-n 1048576 --dense cudnn --time-budget-s 120
finish
