#!/usr/bin/env bash
# The short real ListOps run recorded in results/lra/: generate ListOps (96K/2K/2K, seed 0), then train the LRA
# encoder with full attention and with MiTA (configs/experiment/lra/listops-{full,mita}.yaml, the ListOps recipe)
# under a wall-clock cap per model (trainer.max_time), then evaluate on val and test.
# Usage: bash results/lra/run_listops_gpu.sh OUT_DIR MAX_TIME   (MAX_TIME as DD:HH:MM:SS, e.g. 00:00:02:00)
set -uo pipefail
OUT=${1:-results/lra/run}
MAX_TIME=${2:-00:00:02:00}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  echo "commit: $(git rev-parse HEAD 2>/dev/null) (working tree may hold uncommitted framework files)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton, lightning, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'lightning', lightning.__version__)"
  echo "cpu cores: $(nproc)"
} > "$OUT/env.txt" 2>&1
t0=$(date +%s)
$PY scripts/prepare_data/listops.py --out /tmp/listops-1000 --train 96000 --val 2000 --test 2000 --seed 0 --no-progress
echo "listops generation: $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
for row in full mita; do
  $PY -m tasks.run experiment=lra/listops-$row data.root=/tmp/listops-1000 paths.log_dir=/tmp/lra_logs \
    paths.results_dir=/tmp/lra_records logger=csv +trainer.max_time=$MAX_TIME trainer.enable_progress_bar=false \
    > "$OUT/$row.log" 2>&1
  echo "$row exit: $?" >> "$OUT/env.txt"
  m=$(find /tmp/lra_logs/lra/listops-$row -name metrics.csv | head -1); [ -n "$m" ] && cp "$m" "$OUT/$row-metrics.csv"
  r=$(find /tmp/lra_records/lra/listops-$row -name '*.json' | head -1); [ -n "$r" ] && cp "$r" "$OUT/$row-record.json"
done
