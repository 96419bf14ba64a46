"""Run Long Range Arena rows side by side on one GPU, in time slots that a later call continues.

The LRA encoder (2 layers of width 64) leaves an H200 mostly idle, so this runs several rows (experiment x seed)
as concurrent ``python -m tasks.run`` processes. Each process gets ``deadline=<unix time>``: it stops cleanly
before the slot ends, saving ``last.ckpt``, and the next call (``resume=auto``) continues it from there. Finished
rows write their run records (evaluated with the best-validation checkpoint, as the recipe says).

Everything a later call needs lives under ``--state`` (checkpoints, CSV curves, logs, records); ``--out`` gets
what to bring back: ``records.tar.gz`` (records, curves, logs of the rows that finished, rewritten as each one
finishes), ``state.tar.partNN`` (the state of unfinished rows, in parts of at most 15 MiB) and ``summary.json``.
``scripts/gpu/lra_state.py`` merges both into the local state folder (and the records into results/runs) before the
next call, which carries the state folder there.

The data are generated on the machine if missing (ListOps and Pathfinder-32 with their generators, seed 0).

Usage (on the GPU machine; the commit is stamped because the copy there has no .git)::

    MITA_COMMIT=<sha> python scripts/gpu/lra_rows.py --state .gpu_state --out $OUT --budget 540 \\
        --parallel 18 --seeds 0 1 2 --rows lra/listops-full lra/listops-mita ...

A row is ``EXPERIMENT``, ``EXPERIMENT@SEED`` or either with extra overrides after ``|`` (``lra/listops-full@0|
trainer.precision=32-true``): such a run is a diagnostic, its record keeps the overrides and never fills a table
row (scripts/make_tables.py lists it among the other runs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAUSED = 3
PART_BYTES = 15 * 2**20
# Seconds kept free after the training deadline for the final evaluation of rows that finish, and for packing.
EVAL_MARGIN_S = 45
# No row is started with less than this many seconds to its deadline.
MIN_SLOT_S = 60


@dataclass
class Job:
    """One training process: an experiment, a seed, optional extra overrides."""

    experiment: str
    seed: int
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    status: str = "pending"
    started: float = 0.0
    ended: float = 0.0

    @property
    def name(self) -> str:
        base = f"{self.experiment}/seed{self.seed}"
        if not self.extra:
            return base
        return f"{base}-x{hashlib.sha1('|'.join(self.extra).encode()).hexdigest()[:6]}"

    @property
    def task(self) -> str:
        return self.experiment.split("/")[-1].split("-")[0]


def parse_rows(rows: list[str], seeds: list[int]) -> list[Job]:
    """``EXP[@SEED][|key=value|...]`` strings -> jobs (rows without a seed get every one of ``seeds``)."""
    jobs = []
    for row in rows:
        head, *extra = row.split("|")
        if "@" in head:
            exp, seed = head.split("@", 1)
            jobs.append(Job(exp, int(seed), extra))
        else:
            jobs.extend(Job(head, s, list(extra)) for s in seeds)
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise SystemExit(f"lra_rows: duplicate rows in {names}")
    return jobs


def data_root(task: str, data: Path) -> Path:
    return {"listops": data / "listops-1000", "pathfinder": data / "pathfinder32"}[task]


def prepare_data(tasks: set[str], data: Path, log) -> dict[str, float]:
    """Generate the procedural data sets the jobs need (if missing); returns seconds per task."""
    took = {}
    for task in sorted(tasks):
        root = data_root(task, data)
        marker = root / ".complete"
        if marker.exists():
            continue
        t0 = time.time()
        if task == "listops":
            cmd = [
                sys.executable,
                "scripts/prepare_data/listops.py",
                "--out",
                str(root),
                "--train",
                "96000",
                "--val",
                "2000",
                "--test",
                "2000",
                "--seed",
                "0",
                "--no-progress",
            ]
        elif task == "pathfinder":
            cmd = [
                sys.executable,
                "scripts/prepare_data/pathfinder.py",
                "--out",
                str(root),
                "--n",
                "200000",
                "--seed",
                "0",
                "--no-progress",
            ]
        else:
            raise SystemExit(f"lra_rows: no generator for task {task!r} (its data must be the release files)")
        subprocess.run(cmd, cwd=REPO, check=True)
        marker.write_text("ok\n")
        took[task] = round(time.time() - t0, 1)
        log(f"generated {task} in {took[task]} s")
    return took


def command(job: Job, args: argparse.Namespace, deadline: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tasks.run",
        f"experiment={job.experiment}",
        f"seed={job.seed}",
        f"run_name={job.name}",
        f"data.root={data_root(job.task, args.data)}",
        f"data.num_workers={args.num_workers}",
        f"paths.log_dir={args.state / 'logs'}",
        f"paths.results_dir={args.state / 'records'}",
        "logger=csv",
        "trainer.enable_progress_bar=false",
        "resume=auto",
        f"deadline={deadline:.0f}",
        *job.extra,
    ]


def finished_records(state: Path) -> dict[str, Path]:
    """run_name -> record of rows already finished in an earlier call (read from the records' config)."""
    done = {}
    for path in sorted((state / "records").rglob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        name = (rec.get("config") or {}).get("run_name")
        if name:
            done[name] = path
    return done


def run_dir(state: Path, job: Job) -> Path | None:
    dirs = sorted((state / "logs" / job.name).glob("*/"))
    return dirs[0] if dirs else None


def pack_records(state: Path, out: Path, jobs: list[Job]) -> None:
    """records.tar.gz: every record, with the curves and log of its row, named after the record."""
    tmp = out / "records.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted((state / "records").rglob("*.json")):
            rel = path.relative_to(state / "records")
            tar.add(path, arcname=f"records/{rel}")
            rec = json.loads(path.read_text())
            name = (rec.get("config") or {}).get("run_name", "")
            job = next((j for j in jobs if j.name == name), None)
            rdir = run_dir(state, job) if job else None
            if rdir is None:
                continue
            for metrics in sorted(rdir.glob("csv/metrics*.csv")):
                suffix = "" if metrics.name == "metrics.csv" else f"-{metrics.stem}"
                tar.add(metrics, arcname=f"records/{rel.with_suffix('')}{suffix}.metrics.csv")
            log = state / "logs" / f"{name}.log"
            if log.exists():
                tar.add(log, arcname=f"records/{rel.with_suffix('')}.log")
    tmp.replace(out / "records.tar.gz")


def pack_state(state: Path, out: Path, jobs: list[Job]) -> list[str]:
    """The state of the rows that did not finish (checkpoints, curves, logs) as state.tar.partNN."""
    unfinished = [j for j in jobs if j.status != "done"]
    tar_path = out / "state.tar"
    with tarfile.open(tar_path, "w") as tar:
        for job in unfinished:
            base = state / "logs" / job.name
            if base.exists():
                for path in sorted(base.rglob("*")):
                    # The periodic step checkpoints duplicate last.ckpt; the best-validation one is needed at the end.
                    if path.is_file() and not (path.parent.name == "checkpoints" and path.name.startswith("step")):
                        tar.add(path, arcname=str(path.relative_to(state)))
            log = state / "logs" / f"{job.name}.log"
            if log.exists():
                tar.add(log, arcname=str(log.relative_to(state)))
    parts = []
    with tar_path.open("rb") as f:
        i = 0
        while chunk := f.read(PART_BYTES):
            part = out / f"state.tar.part{i:02d}"
            part.write_bytes(chunk)
            parts.append(part.name)
            i += 1
    tar_path.unlink()
    return parts


def last_metrics(rdir: Path | None) -> dict[str, str]:
    """The last logged step and the last validation accuracy of a run's CSV curve."""
    if rdir is None:
        return {}
    out: dict[str, str] = {}
    for metrics in sorted(rdir.glob("csv/metrics*.csv")):
        lines = metrics.read_text().splitlines()
        if not lines:
            continue
        header = lines[0].split(",")
        for line in lines[1:]:
            row = dict(zip(header, line.split(","), strict=False))
            if row.get("step"):
                out["step"] = row["step"]
            for key in ("val/acc1", "perf/step_time_s"):
                if row.get(key):
                    out[key] = row[key]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", required=True, help="EXP[@SEED][|key=value...] rows")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds of rows given without @SEED")
    parser.add_argument("--parallel", type=int, default=8, help="concurrent training processes")
    parser.add_argument("--budget", type=float, default=540, help="seconds this call may take, packing included")
    parser.add_argument("--state", type=Path, default=REPO / ".gpu_state", help="checkpoints, logs and records")
    parser.add_argument("--out", type=Path, required=True, help="folder for what comes back")
    parser.add_argument("--data", type=Path, default=Path("/tmp/lra_release"), help="generated data sets")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per process")
    parser.add_argument("--group", default=None, help="name of this batch of runs (default: the date)")
    parser.add_argument(
        "--eval-margin",
        type=float,
        default=EVAL_MARGIN_S,
        help="seconds between the training deadline and the end of the budget",
    )
    parser.add_argument(
        "--min-slot", type=float, default=MIN_SLOT_S, help="start no row with fewer seconds than this to the deadline"
    )
    args = parser.parse_args(argv)
    t0 = time.time()
    args.state, args.out = args.state.resolve(), args.out.resolve()
    args.state.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    summary_log = (args.out / "driver.log").open("a")

    def log(message: str) -> None:
        line = f"[{time.time() - t0:6.0f} s] {message}"
        print(line, flush=True)
        summary_log.write(line + "\n")
        summary_log.flush()

    if not os.environ.get("MITA_COMMIT"):
        raise SystemExit(
            "lra_rows: set MITA_COMMIT=<the commit of this tree> (the copy on the GPU machine has no .git)"
        )
    jobs = parse_rows(args.rows, args.seeds)
    done = finished_records(args.state)
    for job in jobs:
        if job.name in done:
            job.status = "done"
    todo = [j for j in jobs if j.status != "done"]
    gen = prepare_data({j.task for j in todo}, args.data, log)
    end = t0 + args.budget
    deadline = end - args.eval_margin
    concurrency = min(args.parallel, len(todo))
    # One intra-op thread per process: the processes share the machine's cores.
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        MITA_CONCURRENT_RUNS=str(concurrency),
        MITA_RUN_GROUP=args.group or time.strftime("%Y-%m-%d"),
    )
    log(
        f"{len(todo)} rows to run, {len(jobs) - len(todo)} finished earlier; {concurrency} at a time; "
        f"deadline in {deadline - time.time():.0f} s"
    )
    queue = list(todo)
    running: list[Job] = []
    while queue or running:
        while queue and len(running) < args.parallel and deadline - time.time() > args.min_slot:
            job = queue.pop(0)
            (args.state / "logs" / job.name).parent.mkdir(parents=True, exist_ok=True)
            out = (args.state / "logs" / f"{job.name}.log").open("a")
            job.proc = subprocess.Popen(
                command(job, args, deadline), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
            )
            job.status, job.started = "running", time.time()
            running.append(job)
            log(f"started {job.name}")
        if not running:
            break
        time.sleep(2)
        for job in list(running):
            rc = job.proc.poll()
            if rc is None and time.time() > end - 10:
                job.proc.kill()
                rc = job.proc.wait()
                job.status = "killed at the call's end"
            if rc is None:
                continue
            running.remove(job)
            job.ended = time.time()
            if job.status == "running":
                job.status = {0: "done", PAUSED: "paused"}.get(rc, f"failed (exit {rc})")
            m = last_metrics(run_dir(args.state, job))
            log(
                f"{job.name}: {job.status} after {job.ended - job.started:.0f} s, step {m.get('step')}, "
                f"val/acc1 {m.get('val/acc1')}, step time {m.get('perf/step_time_s')}"
            )
            if job.status == "done":
                pack_records(args.state, args.out, jobs)
    for job in queue:
        job.status = "not started (no time left)"
    pack_records(args.state, args.out, jobs)
    parts = pack_state(args.state, args.out, jobs)
    summary = {
        "commit": os.environ["MITA_COMMIT"],
        "generation_s": gen,
        "wall_s": round(time.time() - t0, 1),
        "concurrency": concurrency,
        "state_parts": parts,
        "rows": {j.name: {"status": j.status, **last_metrics(run_dir(args.state, j))} for j in jobs},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"done in {summary['wall_s']} s; state parts {parts}")
    for name, row in summary["rows"].items():
        print(f"  {name:55s} {row['status']:28s} step {row.get('step')} val {row.get('val/acc1')}")
    shutil.copy(args.out / "driver.log", args.state / "driver.log")


if __name__ == "__main__":
    main()
