#!/usr/bin/env bash
# The whole GPU test suite in one go: `pytest -m gpu` over tests/, spread over pytest-xdist workers (Triton
# compilation is CPU-bound, so workers on the machine's cores share it; they share one Triton cache; tests with
# million-token rows share one worker, tests/conftest.py), then the `exclusive` tests (timing comparisons) alone,
# with the slowest tests listed. The log goes to OUT/<date>-<commit>.log, the form results/gpu_tests/ keeps.
#
#   MITA_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu/gpu_suite.sh OUT [WORKERS] [TIMEOUT_S]
#
# WAIT_PIDS="pid ...": processes of the same call that use the GPU; the timing tests start once they have ended.
set -o pipefail
out=${1:?usage: gpu_suite.sh OUT [WORKERS] [TIMEOUT_S]}
workers=${2:-12}
limit=${3:-480}
commit=${MITA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$out"
log="$out/$(date -u +%F)-${commit:0:7}.log"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache-suite}
{
  echo "# pytest -m gpu tests -n $workers (commit $commit, $(date -u +%FT%TZ))"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  nproc | sed 's/^/cpu cores: /'
} >"$log" 2>&1
start=$(date +%s)
pt="python3 -m pytest tests -q -p no:cacheprovider -rfE"
timeout "$limit" $pt -m "gpu and not exclusive" -n "$workers" --dist loadgroup --durations=15 >>"$log" 2>&1
rc=$?
for p in ${WAIT_PIDS:-}; do while kill -0 "$p" 2>/dev/null; do sleep 1; done; done
echo "# exclusive (alone on the GPU)" >>"$log"
timeout 120 $pt -m "gpu and exclusive" >>"$log" 2>&1
rc2=$?
[ $rc -eq 0 ] && rc=$rc2
echo "# exit $rc, wall $(( $(date +%s) - start )) s" >>"$log"
tail -25 "$log"
exit $rc
