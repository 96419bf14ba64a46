#!/usr/bin/env bash
# One device call: GPU tests of the Triton kernels, the forward stage profile, the op-level benchmark, then
# Figure F. Logs and CSVs go to $OUT (or results/bench when OUT is unset). Time limits per step are variables.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-results/bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
timeout "${TEST_S:-200}" python3 -m pytest tests/test_triton_routing.py tests/test_triton_mita.py -m gpu -q \
  -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
timeout "${PROF_S:-60}" python3 scripts/bench/profile_stages.py 2>&1 | tee "$OUT/profile.log"
timeout "${OP_S:-220}" python3 scripts/bench/bench_op.py --out "$OUT" --max-n "${OP_MAX_N:-1048576}" \
  --backends triton --dense-long "${DENSE_LONG:-cudnn}" 2>&1 | tee "$OUT/op_bench.log" | tail -24
if [ "${FIGF_S:-0}" -gt 0 ]; then
  timeout "$FIGF_S" python3 scripts/bench/bench_figf.py --out "$OUT" --min-n "${FIGF_MIN_N:-65536}" \
    --max-n "${FIGF_MAX_N:-262144}" --time-budget-s "${FIGF_BUDGET_S:-40}" 2>&1 | tee "$OUT/figf.log" | tail -8
fi
