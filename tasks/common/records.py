"""Run records: one JSON file per finished run (metrics plus provenance) and one CSV line in an index.

``scripts/make_tables.py`` reads these records; nothing in results/ is typed by hand.
"""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
INDEX_FIELDS = ["experiment", "date", "metric", "value", "best", "steps", "wall_time_s", "commit", "hardware", "record"]


# A copy of the tree without .git (a GPU machine) gets its commit from this variable, set by whoever sent it there.
COMMIT_ENV = "MITA_COMMIT"
# Training processes that shared the accelerator with this run, and the name of their batch (scripts/gpu/lra_rows.py).
CONCURRENCY_ENV = "MITA_CONCURRENT_RUNS"
GROUP_ENV = "MITA_RUN_GROUP"


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    """Commit hash, whether the working tree has uncommitted changes, and where the commit came from.

    Without a git checkout the commit is read from ``$MITA_COMMIT`` (``source: "stamped"``; the sender stamps a
    clean commit, so ``dirty`` is False), else it is None (``source: None``).
    """

    def run(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    # A stamped commit wins: the copy on a GPU machine may sit in a git checkout of an older base commit.
    if os.environ.get(COMMIT_ENV):
        return {"commit": os.environ[COMMIT_ENV], "dirty": False, "source": "stamped"}
    commit = run("rev-parse", "HEAD")
    status = run("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": commit,
        "dirty": bool(status) if status is not None else None,
        "source": "git" if commit is not None else None,
    }


def concurrency() -> dict[str, Any] | None:
    """``{"processes": N, "group": name}`` when the run shared its accelerator with other runs, else None."""
    processes = os.environ.get(CONCURRENCY_ENV)
    if not processes:
        return None
    return {"processes": int(processes), "group": os.environ.get(GROUP_ENV, "")}


def machine_load() -> dict[str, str]:
    """Whether this machine was shared while something was timed: ``load_1m``, the host's one-minute load average,
    and ``gpu_other_procs``, how many compute processes other than this one nvidia-smi lists ("unknown" without
    it). Timings taken beside other work are not comparable."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True
        )
        pids = {line.strip() for line in out.stdout.splitlines() if line.strip()} if out.returncode == 0 else None
    except OSError:
        pids = None
    others = "unknown" if pids is None else str(len(pids - {str(os.getpid())}))
    return {"load_1m": f"{os.getloadavg()[0]:.2f}", "gpu_other_procs": others}


def hardware() -> dict[str, Any]:
    """CPU, core count and GPUs of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "gpus": gpus, "host": platform.node()}


def hardware_summary(hw: Mapping[str, Any], world_size: int = 1) -> str:
    """One short line, e.g. ``8x NVIDIA H200`` or ``CPU (2 cores)``."""
    gpus = list(hw.get("gpus") or [])
    if gpus and world_size > 0:
        return f"{world_size}x {gpus[0]}"
    return f"CPU ({hw.get('cpu_count')} cores)"


def versions() -> dict[str, str | None]:
    """Versions of Python and the libraries a result depends on."""
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("lightning", "timm", "triton", "torchmetrics", "hydra", "mita"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", None)
        except ImportError:
            out[name] = None
    out["cuda"] = torch.version.cuda
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def write_record(
    results_dir: str | Path,
    experiment: str,
    metrics: Mapping[str, Any],
    *,
    paper: Mapping[str, Any] | None,
    report: Mapping[str, Any] | None,
    overrides: list[str],
    steps: int,
    epochs: int,
    wall_time_s: float,
    world_size: int,
    config: Mapping[str, Any],
    output_dir: str,
    best: float | None = None,
    smoke: bool = False,
    segments: int = 1,
    segment_commits: list[str | None] | None = None,
    segment_processes: list[int | None] | None = None,
) -> Path:
    """Write ``<results_dir>/<experiment>/<date>-<hash>.json`` and append a line to ``<results_dir>/index.csv``.

    Args:
        results_dir: root of the records (``results/runs`` for real runs).
        experiment: path of the experiment file under configs/experiment, without ``.yaml``.
        metrics: final metrics (``val/acc1`` ...), plain numbers.
        paper: the experiment's ``paper:`` block (table, row, metric, value) or None.
        report: ``{"key": "val/acc1", "scale": 100}``: which metric is the table's number, and its scale.
        overrides: the command-line overrides of the run.
        steps, epochs: optimiser steps and epochs done.
        wall_time_s: seconds of the run over all its segments (a resumed run counts its earlier processes), to
            the end of the final evaluation.
        world_size: processes that trained.
        config: the resolved run configuration.
        output_dir: the run's output folder (logs, checkpoints).
        best: the best value of the reported metric seen during training (already scaled), if tracked.
        smoke: True for runs on tiny data (never shown in tables).
        segments: processes the training ran in (1 + the number of resumes from a checkpoint).
        segment_commits: the commit each of those processes ran, in order (None where unknown); by default the
            earlier ones are unknown and the last is this process's.
        segment_processes: how many training processes shared the accelerator during each of those processes, in
            order (None where unknown); by default the earlier ones are unknown and the last is this process's
            ``concurrency`` (1 when it ran alone).

    Returns:
        Path of the JSON record.
    """
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    metrics = {k: _plain(v) for k, v in metrics.items()}
    value = None
    if report and report.get("key") in metrics and metrics[report["key"]] is not None:
        value = float(metrics[report["key"]]) * float(report.get("scale", 1.0))
    hw = hardware()
    git = git_state()
    if segment_commits is None:
        segment_commits = [None] * (segments - 1) + [git["commit"]]
    sharing = concurrency()
    if segment_processes is None:
        segment_processes = [None] * (segments - 1) + [sharing["processes"] if sharing else 1]
    record = {
        "experiment": experiment,
        "paper": _plain(paper) if paper else None,
        "result": {"metric": (paper or {}).get("metric"), "value": value, "best": best},
        "metrics": metrics,
        "smoke": smoke,
        "command": "python -m tasks.run " + " ".join(overrides),
        "argv": sys.argv,
        "overrides": overrides,
        "git": git,
        "hardware": dict(hw, world_size=world_size, summary=hardware_summary(hw, world_size)),
        "versions": versions(),
        "date": date,
        "steps": steps,
        "epochs": epochs,
        "wall_time_s": round(wall_time_s, 2),
        "segments": segments,
        "segment_commits": list(segment_commits),
        "segment_processes": list(segment_processes),
        "concurrency": sharing,
        "output_dir": output_dir,
        "config": _plain(config),
    }
    digest = hashlib.sha1(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:8]
    path = Path(results_dir) / experiment / f"{date.replace(':', '')}-{digest}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    index = Path(results_dir) / "index.csv"
    new = not index.exists()
    with index.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=INDEX_FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(index_row(record, path.relative_to(results_dir)))
    return path


def index_row(record: Mapping[str, Any], relative_path: str | Path) -> dict[str, Any]:
    """The index.csv line of one record; ``relative_path`` is the record's path under its results folder."""
    result = record.get("result") or {}
    return {
        "experiment": record.get("experiment"),
        "date": record.get("date"),
        "metric": result.get("metric"),
        "value": result.get("value"),
        "best": result.get("best"),
        "steps": record.get("steps"),
        "wall_time_s": record.get("wall_time_s"),
        "commit": (record.get("git") or {}).get("commit"),
        "hardware": (record.get("hardware") or {}).get("summary"),
        "record": Path(relative_path).as_posix(),
    }


def write_index(results_dir: str | Path) -> Path:
    """Rewrite ``<results_dir>/index.csv`` from every record under it (sorted by date, then path; relative paths)."""
    root = Path(results_dir)
    records = sorted(read_records(root), key=lambda r: (r.get("date", ""), r["_path"]))
    index = root / "index.csv"
    with index.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=INDEX_FIELDS)
        writer.writeheader()
        for rec in records:
            writer.writerow(index_row(rec, Path(rec["_path"]).relative_to(root)))
    return index


def read_records(results_dir: str | Path) -> list[dict[str, Any]]:
    """Every JSON record under ``results_dir`` (sorted by date)."""
    records = []
    for path in sorted(Path(results_dir).rglob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict) and "experiment" in rec and "result" in rec:
            rec["_path"] = str(path)
            records.append(rec)
    return sorted(records, key=lambda r: r.get("date", ""))
