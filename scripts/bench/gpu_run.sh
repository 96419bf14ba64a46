#!/usr/bin/env bash
# One device call: GPU tests of the Triton kernels, the op-level benchmark, then Figure F. Logs and CSVs go to
# $OUT (or results/bench when OUT is unset).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-results/bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
timeout "${TEST_S:-200}" python3 -m pytest tests/test_triton_mita.py -m gpu -q -x -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -15
timeout "${OP_S:-220}" python3 scripts/bench/bench_op.py --out "$OUT" --max-n "${OP_MAX_N:-1048576}" 2>&1 \
  | tee "$OUT/op_bench.log" | tail -40
timeout "${FIGF_S:-200}" python3 scripts/bench/bench_figf.py --out "$OUT" --max-n "${FIGF_MAX_N:-1048576}" \
  --time-budget-s "${FIGF_BUDGET_S:-150}" 2>&1 | tee "$OUT/figf.log" | tail -15
