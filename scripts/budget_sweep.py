"""Evaluate one checkpoint of a MiTA model over a grid of inference budgets (Table B, "algorithmic generalization").

The network is built from an experiment file, initialised from ``--init-weights`` (a Lightning ``.ckpt`` of this
project, or a timm / torch state dict: full-attention weights give the "mutual compatibility" setting), and
evaluated once per (m, k) with ``train=false``, by calling the framework in-process (``tasks.run.run``). MiTA has no
parameters of its own, so the same weights serve every budget.

    python scripts/budget_sweep.py --experiment imagenet/ft_vit_s-mita \\
        --init-weights outputs/imagenet/ft_vit_s-mita/checkpoints/last.ckpt --m 16 25 36 49 --k 25 50 \\
        data.root=/data/imagenet

Writes ``<out>/<name>.csv`` (one row per (m, k): the metric and the provenance: date, commit, hardware, versions,
command, weights) and ``<out>/<name>.md`` (the grid as a table). Evaluation runs on one device
(``trainer.devices=1 trainer.strategy=auto`` unless overridden). A configuration error stops the sweep with one
line, as ``tasks.run`` does.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import gc
import hashlib
import shlex
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FIELDS = [
    "experiment",
    "m",
    "k",
    "experts_per_query",
    "entries_per_query",
    "metric",
    "value",
    "val_loss",
    "trained_m",
    "trained_k",
    "smoke",
    "init_weights",
    "init_weights_sha256",
    "date",
    "commit",
    "dirty",
    "hardware",
    "torch",
    "timm",
    "command",
]


def file_sha256(path: str | Path, chunk: int = 1 << 24) -> str:
    """Hex SHA-256 of a file (names the exact weights in the provenance)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def entries_per_query(m: int, k: int, experts_per_query: int, routing_only: bool) -> int:
    """Keys each query reads: m landmarks of the shared expert (none when routing only) plus its routed experts."""
    return (0 if routing_only else m) + experts_per_query * k


def sweep(
    experiment: str,
    init_weights: str,
    ms: list[int],
    ks: list[int],
    overrides: list[str],
    work_dir: Path,
) -> list[dict[str, Any]]:
    """Evaluate ``experiment`` with weights ``init_weights`` at every (m, k).

    Args:
        experiment: an experiment file whose attention is MiTA (``imagenet/ft_vit_s-mita``).
        init_weights: checkpoint path.
        ms, ks: the budgets.
        overrides: extra config overrides (``data.root=...``).
        work_dir: folder for the runs' logs (one subfolder per budget).

    Returns:
        One dict per (m, k), with the keys of ``FIELDS`` except the provenance ones.
    """
    from tasks.common.config import compose
    from tasks.common.testing import run_in_process

    base = [f"experiment={experiment}", "trainer.devices=1", "trainer.strategy=auto", *overrides]
    # Quoted: a path may hold characters of Hydra's override grammar ("=", ",", spaces).
    quoted = "'" + str(Path(init_weights).resolve()).replace("\\", "\\\\").replace("'", "\\'") + "'"
    fixed = ["train=false", "record=false", f"init_weights={quoted}"]
    cfg = compose([*base, *fixed])
    attention = cfg.model.attention
    if attention.name not in ("mita", "mita_routing"):
        raise SystemExit(f"budget_sweep: {experiment} uses attention '{attention.name}'; m and k need MiTA")
    key, scale = cfg.report.key, float(cfg.report.scale)
    experts = int(attention.get("experts_per_query", 1))
    routing_only = attention.name == "mita_routing" or bool(attention.get("routing_only", False))
    rows = []
    for m in ms:
        for k in ks:
            print(f"budget_sweep: {experiment} m={m} k={k}", file=sys.stderr)
            budget = [f"model.attention.m={m}", f"model.attention.k={k}"]
            result = run_in_process([*base, *budget, *fixed], work_dir / f"m{m}-k{k}")
            metrics = result["metrics"]
            if key not in metrics:
                raise SystemExit(f"budget_sweep: the evaluation logged no {key} (logged: {sorted(metrics)})")
            rows.append(
                {
                    "experiment": experiment,
                    "m": m,
                    "k": k,
                    "experts_per_query": experts,
                    "entries_per_query": entries_per_query(m, k, experts, routing_only),
                    "metric": key,
                    "value": round(float(metrics[key]) * scale, 4),
                    "val_loss": round(float(metrics["val/loss"]), 5) if "val/loss" in metrics else "",
                    "trained_m": attention.m,
                    "trained_k": attention.k,
                    "smoke": bool(cfg.get("smoke", False)),
                }
            )
            del result
            gc.collect()
    return rows


def write_outputs(rows: list[dict[str, Any]], provenance: dict[str, Any], out: Path, name: str) -> tuple[Path, Path]:
    """Write ``<out>/<name>.csv`` (rows + provenance columns) and ``<out>/<name>.md`` (the m x k grid).

    Returns:
        The two paths.
    """
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / f"{name}.csv", out / f"{name}.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **provenance})
    ms = sorted({r["m"] for r in rows})
    ks = sorted({r["k"] for r in rows})
    value = {(r["m"], r["k"]): r for r in rows}
    first = rows[0]
    smoke = " (SMOKE RUN: tiny data, not a result)" if first["smoke"] else ""
    lines = [
        f"# Inference budgets of `{first['experiment']}`{smoke}",
        "",
        f"Generated by `scripts/budget_sweep.py`; {first['metric']} (x100) of one checkpoint evaluated with other",
        f"MiTA budgets, no training. The experiment's own budget, m = {first['trained_m']}, k = {first['trained_k']},",
        "is marked *.",
        "Entries per query in brackets (shared landmarks + routed keys).",
        "",
        "| m \\ k | " + " | ".join(str(k) for k in ks) + " |",
        "|---|" + "---|" * len(ks),
    ]
    for m in ms:
        cells = []
        for k in ks:
            r = value.get((m, k))
            star = "*" if (m, k) == (first["trained_m"], first["trained_k"]) else ""
            cells.append(f"{r['value']:.2f}{star} ({r['entries_per_query']})" if r else "—")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Weights: `{provenance['init_weights']}` (sha256 {provenance['init_weights_sha256'][:12]}).",
        f"Command: `{provenance['command']}`",
        f"Date {provenance['date']}, commit {provenance['commit'][:8]}{'+dirty' if provenance['dirty'] else ''}, "
        f"{provenance['hardware']}, torch {provenance['torch']}, timm {provenance['timm']}.",
    ]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", required=True, help="experiment file with MiTA, e.g. imagenet/ft_vit_s-mita")
    parser.add_argument("--init-weights", required=True, help="checkpoint (.ckpt of this project, .pth, .safetensors)")
    parser.add_argument("--m", type=int, nargs="+", default=[16, 25, 36, 49], help="landmark counts (p x p grids)")
    parser.add_argument("--k", type=int, nargs="+", default=[25, 50], help="keys per routed expert")
    parser.add_argument("--name", default=None, help="output file stem (default: the experiment, / -> _)")
    parser.add_argument("--out", default=str(REPO / "results" / "budget"))
    parser.add_argument("--work-dir", default=None, help="logs of the runs (default: outputs/budget_sweep/<name>)")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value), anywhere on the line")
    argv_used = sys.argv[1:] if argv is None else list(argv)
    # key=value tokens are overrides wherever they stand (after --k 25 50 too, which argparse would take as k's),
    # except the value of an option (a path may hold "=").
    single = {"--experiment", "--init-weights", "--name", "--out", "--work-dir"}
    overrides, options = [], []
    for i, token in enumerate(argv_used):
        is_value = i > 0 and argv_used[i - 1] in single
        (overrides if "=" in token and not token.startswith("-") and not is_value else options).append(token)
    args = parser.parse_args(options)
    args.overrides = overrides
    if not Path(args.init_weights).is_file():
        raise SystemExit(f"budget_sweep: --init-weights {args.init_weights} is not a file")

    from tasks.common.records import git_state, hardware, hardware_summary, versions

    name = args.name or args.experiment.replace("/", "_")
    work_dir = Path(args.work_dir) if args.work_dir else REPO / "outputs" / "budget_sweep" / name
    rows = sweep(args.experiment, args.init_weights, args.m, args.k, args.overrides, work_dir)
    git, libs = git_state(), versions()
    provenance = {
        "init_weights": str(args.init_weights),
        "init_weights_sha256": file_sha256(args.init_weights),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git.get("commit") or "?",
        "dirty": git.get("dirty"),
        "hardware": hardware_summary(hardware()),
        "torch": libs.get("torch"),
        "timm": libs.get("timm"),
        "command": shlex.join(["python", "scripts/budget_sweep.py", *argv_used]),
    }
    csv_path, md_path = write_outputs(rows, provenance, Path(args.out), name)
    print(f"wrote {csv_path} and {md_path}")
    return csv_path, md_path


if __name__ == "__main__":
    main()
