#!/usr/bin/env bash
# One device call: the repository's whole GPU test suite (three pytest processes side by side, since Triton
# compilation is CPU-bound), the forward stage profile (top-k passes one by one), then the op-level benchmark.
# Logs and CSVs go to $OUT (or results/bench when OUT is unset). Time limits per step are variables.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-results/bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
# Test modules that cannot be imported here (the device lacks hydra/omegaconf/wandb/datasets) are listed and left
# out; every other module's gpu-marked tests run.
IGN=$(python3 - tests 2>>"$OUT/env.txt" <<'EOF'
import importlib.util, os, sys
folder = sys.argv[1]
sys.path[:0] = [os.path.abspath(folder), os.path.abspath(os.path.join(folder, ".."))]
out = []
for name in sorted(os.listdir(folder)):
    if name.startswith("test_") and name.endswith(".py"):
        path = os.path.join(folder, name)
        try:
            spec = importlib.util.spec_from_file_location(name[:-3], path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except Exception as e:  # any import failure leaves the module out, with its reason
            print(f"{path}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            out.append(f"--ignore={path}")
print(" ".join(out))
EOF
)
echo "left out (not importable here): $IGN" | tee -a "$OUT/env.txt"
T=${TEST_S:-110}
PT="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
timeout "$T" $PT tests/test_triton_mita.py -k "gpu_matches_naive" >"$OUT/gpu_tests_1.log" 2>&1 &
timeout "$T" $PT tests/test_triton_mita.py -k "not gpu_matches_naive" >"$OUT/gpu_tests_2.log" 2>&1 &
# shellcheck disable=SC2086
timeout "$T" $PT tests --ignore=tests/test_triton_mita.py $IGN >"$OUT/gpu_tests_3.log" 2>&1 &
wait
cat "$OUT"/gpu_tests_?.log > "$OUT/gpu_tests.log"
grep -h -E "passed|failed|error" "$OUT"/gpu_tests_?.log | tail -6
# A step whose time limit is 0 is skipped (timeout 0 would mean no limit).
step() { local t=$1; shift; [ "$t" = 0 ] && return 0; timeout "$t" "$@"; }
step "${PROF_S:-45}" python3 scripts/bench/profiler.py stages 2>&1 | tee "$OUT/profile.log" | tail -30
step "${OP_S:-90}" python3 scripts/bench/bench_op.py --out "$OUT" --points "${OP_POINTS:-deit_s,N65536,N262144,N1048576}" \
  --backends triton --dense-long "${DENSE_LONG:-cudnn}" --dense-reps-long 2 2>&1 | tee "$OUT/op_bench.log" | tail -14
step "${RHO_S:-0}" python3 scripts/bench/bench_op.py --out "$OUT" --rho "${RHO:-0.9}" ${BLOCK_TOP:+--block-top "$BLOCK_TOP"} --points "${OP_POINTS:-deit_s,N65536,N262144,N1048576}" \
  --backends triton --dense-long "${DENSE_LONG:-cudnn}" --dense-reps-long 2 2>&1 | tee "$OUT/op_bench_rho.log" | tail -14
step "${OPG_S:-0}" python3 scripts/bench/bench_op.py --out "$OUT" --graph --points "${OPG_POINTS:-deit_s,N4096,N65536}" \
  --backends triton 2>&1 | tee "$OUT/op_bench_graph.log" | tail -14
step "${LAYER_S:-0}" python3 scripts/bench/bench_layers.py --out "$OUT" --points "${LAYER_POINTS:-deit_s,N4096,N65536}" \
  2>&1 | tee "$OUT/layer_bench.log" | tail -30
step "${FIGF_S:-0}" python3 scripts/bench/bench_figf.py --out "$OUT" --max-n "${FIGF_MAX_N:-262144}" \
  --time-budget-s "${FIGF_BUDGET_S:-100}" ${FIGF_GRAPH:+--graph} 2>&1 | tee "$OUT/figf.log" | tail -14
