#!/usr/bin/env bash
# Where MiTA stands against dense attention at the lengths where the paper trains, on one H200, in parts (PARTS, a
# comma-separated list; default short,op,lra, more than one 10-minute device call: run them as two calls):
#   short  the short path (N <= 256) at DeiT-S: its GPU tests, its launch settings side by side (sweep.py), with
#          BEFORE=DIR the op benchmark's short and medium training points on an earlier tree and this one in turn
#          (before, after, before, after; each process alone on the GPU). About 7 min.
#   tiles  (not in the default) the short kernels' tiles, warps and register caps side by side at DeiT-S: the
#          attention, the route kernel (one program per head) and the backward. About 6 min.
#   op     the op benchmark's training points in eager calls and CUDA-graph replays side by side, the per-kernel GPU
#          time and launch sequence of each point, the DeiT-S layer both ways. About 7 min.
#   host   (not in the default) the host time of each forward and backward (launches, PyTorch ops, cProfile; the
#          routing's second stream on and off) and of each forward stage, whole ListOps / Pathfinder steps'
#          launches and wall time; the second stream on and off side by side as timings (eager, graph replays);
#          with BEFORE_HOST=DIR eager op calls at 16K, 64K and the ListOps shape plus whole ListOps steps (MiTA,
#          full; full length and padded) on that tree and this one in turn, twice. About 9 min.
#   lra    whole LRA training steps: full attention, MiTA, per-query top-k and MoBA of ListOps and
#          Pathfinder, eager and as CUDA-graph replays of whole steps, then top-k and MoBA of ListOps with their
#          SDPA kernel pinned (efficient, cudnn); every Table D and E row with FULL_TABLE=1. About 5 min.
#   long   (not in the default) the long-row points 16K-1M as CUDA-graph replays on BEFORE_LONG=DIR (a tree from
#          before the kernel package's restructuring, 3b24a53, whose bench_op takes --graph --queued) and on this
#          tree, each alone, twice in turn. About 8 min.
# Every before / after comparison first runs both trees at once, untimed (WARM_S, default 150 s), so that the timed
# runs find their kernels compiled.
# Each step's output goes to OUT as it finishes, so a call cut at its limit still returns what ran. OUT/environment.txt
# holds the host's state at the start and the end (load, other GPU processes, a Python speed index): timings taken
# beside other work are not comparable.
#
#   MITA_COMMIT=$(git rev-parse --short HEAD) PARTS=short BEFORE=.before-fab28ce bash scripts/gpu/speed_survey.sh OUT
#
# BEFORE=DIR is a copy of an earlier tree (`git archive <commit> mita scripts pyproject.toml configs tasks | tar -x -C
# DIR`, carried to the machine). Needs hydra-core and omegaconf importable (the LRA shapes are read from the
# experiment files).
set -o pipefail
out=${1:?usage: speed_survey.sh OUT}
mkdir -p "$out"
out=$(cd "$out" && pwd)
commit=${MITA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache-survey}
parts=",${PARTS:-short,op,lra},"
points=${POINTS:-deit_s,seg_1025,B8_N4096,N16384,N65536,lra_listops,lra_text,lra_retrieval,lra_image,lra_pathfinder}
step() {  # step NAME LIMIT_S COMMAND...: run one part, its log in OUT/NAME.log, never longer than LIMIT_S
  local name=$1 limit=$2
  shift 2
  local t0
  t0=$(date +%s)
  echo "== $name (limit $limit s, commit $commit)"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "   exit $?, $(($(date +%s) - t0)) s"
}
host_state() {  # whether the machine is shared and how fast its host runs Python, beside every part's timings
  echo "== host state, $(date -u +%FT%TZ)"
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg), cpus: $(nproc)"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | sed 's/^/gpu process: /'
  python3 -c "import timeit; n = 200000; t = min(timeit.repeat('d[k] = k + 1', 'd = {}; k = 7', number=n, repeat=5)); \
print(f'python dict store: {t / n * 1e9:.1f} ns (this CPU-speed index compares hosts)')"
}
{
  echo "commit $commit, $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  host_state
} >"$out/environment.txt" 2>&1
want() { [[ $parts == *",$1,"* ]]; }
warm() {  # warm NAME TREE LIMIT_S CMD [CMD_HERE]: CMD in TREE and CMD_HERE (default CMD) here, at once and untimed
  local name=$1 tree=$2 limit=$3 cmd=$4 here=${5:-$4} t0  # (output folder $dir, dropped), so that the timed runs
  t0=$(date +%s)  # after it find every kernel compiled: a cold tree spent most of a 120 s limit compiling
  (cd "$tree" && dir=$(mktemp -d) timeout "$limit" bash -c "$cmd" >/dev/null 2>&1) &
  local pid=$!
  dir=$(mktemp -d) timeout "$limit" bash -c "$here" >/dev/null 2>&1
  wait $pid
  echo "== warm-up $name (both trees at once, limit $limit s): $(($(date +%s) - t0)) s"
}
before_after() {  # before_after PREFIX TREE LIMIT_S COMMAND: COMMAND (its output folder in $dir) in TREE, then here,
  local prefix=$1 tree=$2 limit=$3 cmd=$4 i side dir  # twice in turn; steps PREFIX_before_1, PREFIX_after_1, ...
  warm "$prefix" "$tree" "${WARM_S:-150}" "$cmd"
  for i in 1 2; do
    for side in before after; do
      dir="$out/${prefix}_${side}_$i"
      mkdir -p "$dir"
      step "${prefix}_${side}_$i" "$limit" bash -c "cd '$([ "$side" = before ] && echo "$tree" || echo .)' && \
        dir='$dir' && $cmd"
    done
  done
}
if want short; then
# The short kernels against naive_mita on this GPU first (every setting the next step times).
step short_tests "${SHORT_TESTS_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_triton_mita.py \
  -k "short or gpu_matches_naive"
# The short path's settings side by side at DeiT-S (one process, same inputs): the last-block form of the attention
# and backward kernels (CONFIG["attn"/"bwd"]["tail"]) and the route kernel's register cap.
step short_tail "${TAIL_S:-240}" python3 scripts/bench/sweep.py --points 197:25 --batch 256 --heads 6 --rho 0 \
  --backward --timing eager,cuda_graph --reps 20 --sweep small.attn.tail=0,1 --sweep small.bwd.tail=0,1 \
  --sweep small.route.maxnreg=168,None,128 --sweep small.attn.maxnreg=168,None,128
if [ -n "${BEFORE:-}" ]; then
  before_after ab "$BEFORE" "${AB_S:-60}" 'python3 scripts/bench/bench_op.py --out "$dir" --point-set training \
    --points deit_s,seg_1025,B8_N4096 --timing eager,cuda_graph_queued --backends triton'
fi
fi
if want tiles; then
# The forms timed next against naive_mita on this GPU (the CPU suite runs them under the interpreter).
step tiles_tests "${TILES_TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider tests/ops/test_triton_mita.py \
  -k "one_program_per_head or short_backward_tiles or 128_query_rows"
# The attention kernel at more warps per SM (Triton 3.6, sm_90: now 168 registers, 3 programs of 4 warps per SM; at a
# 128 cap 4 per SM with 16 B of stack; 8 warps at 128: 2 per SM without stack; 128-query blocks: 2 programs per head).
step short_attn "${ATTN_S:-90}" python3 scripts/bench/sweep.py --points 197:25 --batch 256 --heads 6 --rho 0 \
  --timing eager,cuda_graph --reps 20 --variants \
  "|small.attn.num_warps=8;small.attn.maxnreg=128|small.attn.BM=128;small.attn.num_warps=8;small.attn.maxnreg=128"
# One route program per head (all 32 landmark rows: K and V read once, half the programs; Triton 3.6 for sm_90: 128
# registers with 48 B of stack at 8 warps, 2 programs per SM) against two of 16 rows.
step short_route "${ROUTE_S:-90}" python3 scripts/bench/sweep.py --points 197:25 --batch 256 --heads 6 --rho 0 \
  --timing eager,cuda_graph --reps 20 --variants \
  "|small.route.BS=32;small.route.num_warps=8;small.route.maxnreg=128|small.route.BS=32;small.route.num_warps=8"
# The backward's tiles, warps and register cap (now 4 warps, 255 registers, 2 programs = 8 warps per SM). Triton 3.6,
# sm_90: 168 registers: 3 per SM with some spilling; 8 warps: 255 registers without stack, 1 per SM; 8 warps with
# 32-row query blocks under a 128-register cap: 2 per SM (16 warps) with 56 B of stack (32-key blocks too: 48 B).
step short_bwd "${BWD_S:-200}" python3 scripts/bench/sweep.py --points 197:25 --batch 256 --heads 6 --rho 0 \
  --backward --timing cuda_graph --reps 20 --variants \
  "|small.bwd.maxnreg=168|small.bwd.BM=32;small.bwd.BN=32|small.bwd.BM=32;small.bwd.BN=32;small.bwd.maxnreg=168\
|small.bwd.num_warps=8|small.bwd.BM=32;small.bwd.num_warps=8;small.bwd.maxnreg=128\
|small.bwd.BM=32;small.bwd.BN=32;small.bwd.num_warps=8;small.bwd.maxnreg=128"
fi
if want op; then
step op_bench "${OP_S:-200}" python3 scripts/bench/bench_op.py --out "$out" --point-set training \
  --timing eager,cuda_graph_queued --backends triton
step kernels "${KERNELS_S:-120}" python3 scripts/bench/profiler.py kernels --points "$points" --sequence
# The DeiT-S layer with its projections (issue 29's layer bar): MiTA against the dense layer on each SDPA kernel,
# eager and as graph replays.
step layers "${LAYERS_S:-90}" python3 scripts/bench/bench_layers.py --out "$out" --points deit_s --attentions mita \
  --timing eager,cuda_graph_queued
fi
if want host; then
step host "${HOST_S:-100}" python3 scripts/bench/profiler.py host --out "$out" --profile 30 --stages \
  --points "${HOST_POINTS:-deit_s,N1024,B8_N4096,N16384,N65536,lra_listops}" --variants "|fwd.route_stream=0" \
  --lra lra/listops-full,lra/listops-mita,lra/pathfinder-full,lra/pathfinder-mita
# The routing's second stream (route_stream 3) was timed only at 64K-1M as graph replays; below, eager calls are
# bound by the host, which the fork's stream switches add to: both forms side by side, eager and as graph replays.
step route_stream "${STREAM_S:-100}" python3 scripts/bench/sweep.py --points 1024:16,4096:32,16384:64,65536:128 \
  --batch 1 --heads 2 --rho 0 --backward --timing eager,cuda_graph --reps 20 --sweep fwd.route_stream=3,0
if [ -n "${BEFORE_HOST:-}" ]; then
  # Eager op calls and whole LRA MiTA steps on an earlier tree and this one in turn (host-bound: each alone).
  # ListOps steps at full length (lra_time's default: no padding) and with 40% of the tokens padding (real ListOps
  # batches are padded: the masked landmark pooling).
  before_after host "$BEFORE_HOST" "${HOST_AB_S:-80}" 'python3 scripts/bench/bench_op.py --out "$dir" \
    --point-set training --points N16384,N65536,lra_listops --timing eager --backends triton \
    && python3 scripts/lra_time.py --out "$dir/lra_time.csv" --experiments lra/listops-mita lra/listops-full \
    && python3 scripts/lra_time.py --out "$dir/lra_time_padded.csv" --valid-fraction 0.6 \
      --experiments lra/listops-mita lra/listops-full'
fi
fi
if want long && [ -n "${BEFORE_LONG:-}" ]; then
  long_points=N16384,N65536,N262144,N1048576
  # Each tree's bench_op, less its --out (the earlier tree's takes --graph --queued for the replays' timing).
  long_before="python3 scripts/bench/bench_op.py --backends triton --points $long_points --dense-long cudnn \
    --graph --queued"
  long_after="python3 scripts/bench/bench_op.py --backends triton --points $long_points --dense-long cudnn \
    --timing cuda_graph_queued"
  warm long "$BEFORE_LONG" "${WARM_S:-150}" "$long_before --out \"\$dir\"" "$long_after --out \"\$dir\""
  for i in 1 2; do
    mkdir -p "$out/long_before_$i" "$out/long_after_$i"
    step "long_before_$i" "${LONG_S:-90}" bash -c "cd '$BEFORE_LONG' && $long_before --out '$out/long_before_$i'"
    step "long_after_$i" "${LONG_S:-90}" bash -c "$long_after --out '$out/long_after_$i'"
  done
fi
if want lra; then
if [ -n "${FULL_TABLE:-}" ]; then
  step lra_time "${LRA_S:-240}" python3 scripts/lra_time.py --table D --table E --out "$out/lra_time.csv"
else
  step lra_time "${LRA_S:-60}" python3 scripts/lra_time.py --out "$out/lra_time.csv" --experiments \
    lra/listops-full lra/listops-mita lra/listops-topk lra/listops-moba
  # Pathfinder batches as training sees them: about 0.34 of the pixels inked, the rest padding, compacted.
  step lra_time_pathfinder "${LRA_PF_S:-60}" python3 scripts/lra_time.py --out "$out/lra_time_pathfinder.csv" \
    --valid-fraction 0.34 --experiments lra/pathfinder-full lra/pathfinder-mita lra/pathfinder-topk lra/pathfinder-moba
  # The same steps captured whole and replayed (the GPU's time alone): whether MiTA's GPU time is below full
  # attention's at these shapes, i.e. whether the eager gap is the host's.
  step lra_time_graph "${LRA_S:-60}" python3 scripts/lra_time.py --mode cuda_graph --out "$out/lra_time_graph.csv" \
    --experiments lra/listops-full lra/listops-mita lra/listops-topk lra/listops-moba
  step lra_time_graph_pathfinder "${LRA_PF_S:-60}" python3 scripts/lra_time.py --mode cuda_graph \
    --out "$out/lra_time_graph_pathfinder.csv" --valid-fraction 0.34 --experiments lra/pathfinder-full \
    lra/pathfinder-mita
  # The masked baselines' SDPA kernel pinned (the default lets PyTorch pick): which one "auto" takes, and whether
  # another is faster. (Hydra overrides before --experiments, which takes every word after it.)
  for backend in efficient cudnn; do
    step "lra_time_sdpa_$backend" "${LRA_S:-60}" python3 scripts/lra_time.py "model.attention.sdpa_backend=$backend" \
      --out "$out/lra_time_sdpa_$backend.csv" --experiments lra/listops-topk lra/listops-moba
  done
fi
fi
host_state >>"$out/environment.txt" 2>&1
tail -n 25 "$out/short_tail.log" "$out/op_bench.log" 2>/dev/null
tail -n 6 "$out/lra_time.log" "$out/lra_time_pathfinder.log" "$out"/lra_time_graph*.log "$out"/lra_time_sdpa_*.log \
  2>/dev/null
exit 0
