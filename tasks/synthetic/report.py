"""Report of the default main job: MiTA against full attention on the generated shapes task.

Reads the newest run records of ``synthetic/shapes-full`` and ``synthetic/shapes-mita`` (results/runs), their
CSV training logs and results/flops.csv; prints a table and saves ``<out>/shapes.png`` (validation accuracy
against optimiser steps) and ``<out>/shapes.md``.

    python -m tasks.synthetic.report [--records results/runs] [--out results/main_job]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Any

from tasks.common.config import REPO_ROOT
from tasks.common.records import read_records

EXPERIMENTS = ("synthetic/shapes-full", "synthetic/shapes-mita")


def _curve(output_dir: str) -> tuple[list[int], list[float]]:
    path = Path(output_dir) / "csv" / "metrics.csv"
    steps, accs = [], []
    if not path.exists():
        return steps, accs
    with path.open() as f:
        for row in csv.DictReader(f):
            if row.get("val/acc1"):
                steps.append(int(float(row["step"])))
                accs.append(100 * float(row["val/acc1"]))
    return steps, accs


def _gmacs(flops_csv: Path) -> dict[str, str]:
    if not flops_csv.exists():
        return {}
    with flops_csv.open() as f:
        return {r["experiment"]: r["gmacs"] for r in csv.DictReader(f)}


def build_report(records_dir: Path, flops_csv: Path, out: Path) -> str:
    """Write the plot and the markdown table; return the table."""
    records: dict[str, dict[str, Any]] = {}
    for rec in read_records(records_dir):
        if rec["experiment"] in EXPERIMENTS and not rec.get("smoke"):
            records[rec["experiment"]] = rec
    gmacs = _gmacs(flops_csv)
    header = "| attention | val top-1 | test top-1 | MMACs / image | steps | wall time | train samples/s |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name in EXPERIMENTS:
        rec = records.get(name)
        label = name.split("-")[-1]
        if rec is None:
            lines.append(f"| {label} | not run | | | | | |")
            continue
        m = rec["metrics"]
        macs = gmacs.get(name)
        lines.append(
            f"| {label} | {100 * m.get('val/acc1', float('nan')):.1f} | {100 * m.get('test/acc1', float('nan')):.1f} "
            f"| {float(macs) * 1e3:.2f} | {rec['steps']} | {rec['wall_time_s']:.0f} s "
            f"| {m.get('perf/mean_samples_per_s', float('nan')):.0f} |"
            if macs
            else f"| {label} | {100 * m.get('val/acc1', float('nan')):.1f} | "
            f"{100 * m.get('test/acc1', float('nan')):.1f} | — | {rec['steps']} | {rec['wall_time_s']:.0f} s "
            f"| {m.get('perf/mean_samples_per_s', float('nan')):.0f} |"
        )
        steps, accs = _curve(rec["output_dir"])
        ax.plot(steps, accs, marker="o", label=f"{label} attention")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("validation top-1 (%)")
    ax.set_title("Generated shapes, 2-layer ViT (CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "shapes.png", dpi=120)
    any_rec = next(iter(records.values()), None)
    note = ""
    if any_rec:
        hw = any_rec["hardware"].get("summary")
        note = f"\n\nHardware: {hw}; commit {(any_rec['git'].get('commit') or '?')[:8]}; date {any_rec['date']}.\n"
    table = "\n".join(lines) + note
    (out / "shapes.md").write_text("# Default main job: MiTA vs full attention on generated shapes\n\n" + table)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", default=str(REPO_ROOT / "results" / "runs"))
    parser.add_argument("--flops", default=str(REPO_ROOT / "results" / "flops.csv"))
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "main_job"))
    args = parser.parse_args()
    print(build_report(Path(args.records), Path(args.flops), Path(args.out)))
    print(f"plot: {Path(args.out) / 'shapes.png'}")


if __name__ == "__main__":
    main()
