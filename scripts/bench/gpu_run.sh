#!/usr/bin/env bash
# One device call: the repository's whole GPU test suite (scripts/gpu/gpu_suite.sh), the forward stage profile
# (top-k passes one by one), then the op-level benchmark.
# Logs and CSVs go to $OUT (or results/bench when OUT is unset). Time limits per step are variables.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-results/bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
# The whole GPU suite (xdist workers, then the timing tests alone); its dated log lands in $OUT.
bash scripts/gpu/gpu_suite.sh "$OUT" "${TEST_WORKERS:-12}" "${TEST_S:-480}" | tail -4
# A step whose time limit is 0 is skipped (timeout 0 would mean no limit).
step() { local t=$1; shift; [ "$t" = 0 ] && return 0; timeout "$t" "$@"; }
step "${PROF_S:-45}" python3 scripts/bench/profiler.py stages 2>&1 | tee "$OUT/profile.log" | tail -30
step "${OP_S:-90}" python3 scripts/bench/bench_op.py --out "$OUT" --points "${OP_POINTS:-deit_s,N65536,N262144,N1048576}" \
  --backends triton --dense-long "${DENSE_LONG:-cudnn}" --dense-reps-long 2 2>&1 | tee "$OUT/op_bench.log" | tail -14
step "${RHO_S:-0}" python3 scripts/bench/bench_op.py --out "$OUT" --rho "${RHO:-0.9}" ${BLOCK_TOP:+--block-top "$BLOCK_TOP"} --points "${OP_POINTS:-deit_s,N65536,N262144,N1048576}" \
  --backends triton --dense-long "${DENSE_LONG:-cudnn}" --dense-reps-long 2 2>&1 | tee "$OUT/op_bench_rho.log" | tail -14
step "${OPG_S:-0}" python3 scripts/bench/bench_op.py --out "$OUT" --timing cuda_graph --points "${OPG_POINTS:-deit_s,N4096,N65536}" \
  --backends triton 2>&1 | tee "$OUT/op_bench_graph.log" | tail -14
step "${LAYER_S:-0}" python3 scripts/bench/bench_layers.py --out "$OUT" --points "${LAYER_POINTS:-deit_s,N4096,N65536}" \
  2>&1 | tee "$OUT/layer_bench.log" | tail -30
step "${FIGF_S:-0}" python3 scripts/bench/bench_figf.py --out "$OUT" --max-n "${FIGF_MAX_N:-262144}" \
  --time-budget-s "${FIGF_BUDGET_S:-100}" ${FIGF_GRAPH:+--graph} 2>&1 | tee "$OUT/figf.log" | tail -14
