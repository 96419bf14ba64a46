#!/usr/bin/env bash
# Reproduce the paper's tables, or run the embedded default main job.
#
#   ./reproduce.sh                 default main job: CPU, no downloads, a few minutes. FLOPs/params of Table A,
#                                  the operator self-check, and MiTA against full attention on generated shape
#                                  images, ending in a printed table and results/main_job/shapes.png
#   ./reproduce.sh A               every experiment of Table A (ImageNet-1K; needs data.root, GPUs), then tables
#   ./reproduce.sh all             every table
#   ./reproduce.sh A --dry-run     print the commands only
#   ./reproduce.sh A --smoke       run each experiment for one step on tiny generated data (CPU); needs a table
#
# Tables: A (ImageNet), B (fine-tuning / inference budgets), C (ADE20K), D (LRA), E (arXiv), F (throughput),
# G (routed-key maps). Extra arguments after the options are passed to every `python -m tasks.run` command
# (e.g. data.root=/data/imagenet trainer.devices=8).
set -euo pipefail
cd "$(dirname "$0")"

usage() {
    # The comment block at the top of this file, without its leading "# ".
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

# The project's environment: $PYTHON if set, else .venv (scripts/install.sh), else a python that has the project.
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then
        PYTHON=.venv/bin/python
    elif command -v python >/dev/null && python -c "import torch, hydra, lightning, timm, mita" 2>/dev/null; then
        PYTHON=python
    else
        echo "reproduce.sh: no Python environment with the project found; set it up with: source scripts/install.sh" >&2
        exit 2
    fi
fi

TABLE=""
DRY_RUN=0
SMOKE=0
EXTRA=()
for arg in "$@"; do
    case "$arg" in
        A|B|C|D|E|F|G|all) TABLE="$arg" ;;
        --dry-run) DRY_RUN=1 ;;
        --smoke) SMOKE=1 ;;
        -h|--help) usage; exit 0 ;;
        *=*) EXTRA+=("$arg") ;;
        *) echo "reproduce.sh: unknown argument '$arg' (tables: A B C D E F G all; --dry-run, --smoke)" >&2; exit 2 ;;
    esac
done

if [ "$SMOKE" = 1 ] && [ -z "$TABLE" ]; then
    echo "reproduce.sh: --smoke needs a table (A B C D E F G all); the main job (no table) is already CPU-sized" >&2
    exit 2
fi

run() {
    echo "+ $*"
    if [ "$DRY_RUN" = 0 ]; then
        "$@"
    fi
}

SMOKE_DIR=""
if [ "$SMOKE" = 1 ]; then
    SMOKE_DIR=$(mktemp -d)
    trap 'rm -rf "$SMOKE_DIR"' EXIT
fi

prepare_smoke_data() {
    # Tiny data for tasks whose real data cannot be generated here (written once per call of this script).
    case "$1" in
        imagenet/*)
            if [ ! -d "$SMOKE_DIR/imagenet" ] && [ "$DRY_RUN" = 0 ]; then
                "$PYTHON" -m tasks.imagenet.fake "$SMOKE_DIR/imagenet" --classes 3 --per-class 2 >/dev/null
            fi
            # Rows that start from pretrained weights (Table B) get a smoke-sized full-attention checkpoint.
            case "$1" in
                imagenet/ft_*|imagenet/swap_*)
                    if [ "$DRY_RUN" = 0 ]; then
                        "$PYTHON" -m tasks.imagenet.fake "$SMOKE_DIR/weights/${1#imagenet/}.pth" --weights-for "$1" \
                            --classes 3 >/dev/null
                    fi
                    ;;
            esac
            ;;
        ade20k/*)
            # A tiny ADEChallengeData2016 release and smoke-sized encoder weights (tasks/ade20k/fake.py).
            if [ ! -d "$SMOKE_DIR/ade20k" ] && [ "$DRY_RUN" = 0 ]; then
                "$PYTHON" -m tasks.ade20k.fake "$SMOKE_DIR/ade20k" >/dev/null
            fi
            if [ "$DRY_RUN" = 0 ]; then
                "$PYTHON" -m tasks.ade20k.fake "$SMOKE_DIR/weights/${1#ade20k/}.pth" --weights-for "$1" >/dev/null
            fi
            ;;
        lra/*|arxiv/*)
            # Tiny files in each LRA / arXiv release format (tasks/lra/fake.py).
            if [ ! -d "$SMOKE_DIR/seq" ] && [ "$DRY_RUN" = 0 ]; then
                "$PYTHON" -m tasks.lra.fake "$SMOKE_DIR/seq" >/dev/null
            fi
            ;;
    esac
}

smoke_args() {
    case "$1" in
        imagenet/ft_*|imagenet/swap_*)
            echo "debug=smoke data.root=$SMOKE_DIR/imagenet data.num_classes=3 paths.log_dir=$SMOKE_DIR/outputs" \
                "init_weights=$SMOKE_DIR/weights/${1#imagenet/}.pth"
            ;;
        imagenet/*)
            echo "debug=smoke data.root=$SMOKE_DIR/imagenet data.num_classes=3 paths.log_dir=$SMOKE_DIR/outputs"
            ;;
        ade20k/*)
            echo "debug=smoke paths.log_dir=$SMOKE_DIR/outputs init_weights=$SMOKE_DIR/weights/${1#ade20k/}.pth" \
                "$("$PYTHON" -m tasks.ade20k.fake "$SMOKE_DIR/ade20k" --overrides)"
            ;;
        lra/*|arxiv/*)
            local task
            task=$(basename "$1" | cut -d- -f1)
            case "$1" in arxiv/*) task=arxiv ;; esac
            echo "debug=smoke paths.log_dir=$SMOKE_DIR/outputs" \
                "$("$PYTHON" -m tasks.lra.fake "$SMOKE_DIR/seq" --overrides-for "$task")"
            ;;
        *) echo "debug=smoke paths.log_dir=$SMOKE_DIR/outputs" ;;
    esac
}

run_table() {
    local table="$1"
    local experiments
    experiments=$("$PYTHON" scripts/make_tables.py --list "$table")
    for experiment in $experiments; do
        if [ "$SMOKE" = 1 ]; then
            prepare_smoke_data "$experiment"
            # shellcheck disable=SC2046
            run "$PYTHON" -m tasks.run "experiment=$experiment" $(smoke_args "$experiment") "${EXTRA[@]}"
        else
            run "$PYTHON" -m tasks.run "experiment=$experiment" "${EXTRA[@]}"
        fi
    done
    case "$table" in
        A) [ "$SMOKE" = 1 ] || run "$PYTHON" scripts/flops.py --only imagenet/ --out outputs/flops-A.csv ;;
        C) [ "$SMOKE" = 1 ] || run "$PYTHON" scripts/flops.py --only ade20k/ --out outputs/flops-C.csv ;;
        # Figure F: eager models, both models through torch.compile, and compiled with the fused MLP kernel in both.
        F) [ "$SMOKE" = 1 ] || { run "$PYTHON" scripts/bench/bench_figf.py --out results/bench &&
            run "$PYTHON" scripts/bench/bench_figf.py --out results/bench --compile --min-n 65536 &&
            run "$PYTHON" scripts/bench/bench_figf.py --out results/bench --compile --fused-mlp --min-n 65536; } ;;
        G) figure_g ;;
    esac
    if [ -z "$experiments" ] && [ "$table" != F ] && [ "$table" != G ]; then
        echo "table $table: no experiment files yet (see results/tables/$table.md)"
    fi
}

figure_g() {
    # Figure G has no training run of its own: it maps the routed-expert selections of a trained model.
    # With init_weights=... (an ImageNet-trained MiTA DeiT-S) and data.root=..., the paper's setting; otherwise
    # the no-download demo on generated shapes (a 2-layer model trained for a few seconds).
    local arg
    for arg in "${EXTRA[@]}"; do
        if [[ "$arg" == init_weights=* ]]; then
            run "$PYTHON" scripts/figure_g.py --experiment imagenet/deit_s-mita "${EXTRA[@]}"
            return
        fi
    done
    if [ "$SMOKE" = 1 ]; then
        run "$PYTHON" scripts/figure_g.py --synthetic --steps 8 --num-images 2 --eval-images 64 \
            --out "$SMOKE_DIR/figure_g" data.num_train=512 data.batch_size=16
    else
        run "$PYTHON" scripts/figure_g.py --synthetic
    fi
}

main_job() {
    # Everything goes to outputs/main_job (ignored by git): a checkout's tracked files never change.
    local out=outputs/main_job
    mkdir -p "$out"
    run "$PYTHON" scripts/flops.py --only imagenet/ synthetic/ --out "$out/flops.csv"
    run "$PYTHON" -m mita.selfcheck
    run "$PYTHON" -m tasks.run experiment=synthetic/shapes-full "paths.results_dir=$out/runs" "${EXTRA[@]}"
    run "$PYTHON" -m tasks.run experiment=synthetic/shapes-mita "paths.results_dir=$out/runs" "${EXTRA[@]}"
    run "$PYTHON" -m tasks.synthetic.report --records "$out/runs" --flops "$out/flops.csv" --out "$out"
    if [ "$DRY_RUN" = 0 ]; then
        echo "done: main job in $((SECONDS / 60)) min $((SECONDS % 60)) s; written to $out (shapes.md, shapes.png," \
            "runs/, flops.csv)"
    fi
}

own_tables() {
    # Tables of this checkout's own runs (outputs/runs) in outputs/tables; the committed results/ stay as they are.
    run "$PYTHON" scripts/make_tables.py --records outputs/runs --out outputs/tables --readme ""
}

if [ -z "$TABLE" ]; then
    main_job
elif [ "$TABLE" = all ]; then
    for t in A B C D E F G; do
        run_table "$t"
    done
    [ "$SMOKE" = 1 ] || own_tables
else
    run_table "$TABLE"
    [ "$SMOKE" = 1 ] || own_tables
fi
