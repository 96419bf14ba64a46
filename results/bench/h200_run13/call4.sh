#!/usr/bin/env bash
# Run 13, call 4: Figure F with both models compiled by inductor's max-autotune-no-cudagraphs mode (GEMM autotuning),
# 64K to 256K; the kernels are call 3's.
set -u
export PYTHONPATH=$PWD
O=$OUT/call4; mkdir -p "$O"
echo "== figf max-autotune ($(date -u +%T))"
timeout 500 python scripts/bench/bench_figf.py --out "$O" --compile --compile-mode max-autotune-no-cudagraphs \
  --min-n 65536 --max-n 262144 --dense cudnn --time-budget-s 260 --compile-start-tokens 2097152 > "$O/figf_ma.log" 2>&1
echo "rc $?"; grep -v "^{" "$O/figf_ma.log" | grep -i "speedup\|gate\|error" | tail -8
echo "== done $(date -u +%T)"
