"""results/bench/README.md and figf.png from the committed benchmark CSVs (only measured numbers; the paper's as the
paper's), and the bookkeeping of a new run's CSVs.

    python scripts/bench/make_report.py                       # README.md + figf.png of results/bench
    python scripts/bench/make_report.py --add-run h200_run25 --commit abc1234 OUT/op_bench_cuda_graph_queued.csv ...

results/bench holds one current CSV per benchmark (``op_bench.csv``, ``layer_bench.csv``, ``figf.csv``: the newest
run's, with a ``run`` column) and ``history.csv`` (every run's rows, with run, benchmark, source file and commit).
The README's tables are the current CSVs'; the figure takes Figure F's latest runs from the history. ``--add-run``
appends a run's CSVs (as bench_op.py / bench_layers.py / bench_figf.py wrote them) to the history and makes them
the current CSVs of their benchmarks (several CSVs of one benchmark, e.g. two timings, become one current CSV).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from make_tables import replace_block  # noqa: E402  (scripts/make_tables.py: README's generated blocks)

# Paper (RTX 4090, whole-model Figure F speed-ups over full attention on FlashAttention).
PAPER_FIGF_SPEEDUP = {65536: 19.0, 262144: 56.0, 1048576: 159.0}


def read(paths: list[str]) -> list[dict]:
    """Rows of the CSVs, each with ``run`` (its ``run`` column, else the CSV's folder: the kernel version it was
    measured with) and ``timing``
    (``eager`` for CSVs written before the column existed, which all timed eager calls; ``+compile`` appended for
    Figure F rows of models run through torch.compile, ``+compile(<mode>)`` for a mode other than the default)."""
    rows = []
    for p in paths:
        with open(p) as f:
            for r in csv.DictReader(f):
                model = r.get("model") or ""
                # "compiled" -> +compile; "compiled (<mode>)" -> +compile(<mode>)
                comp = "+compile" + model[len("compiled") :].replace(" ", "") if model.startswith("compiled") else ""
                timing = (r.get("timing") or "eager") + comp
                if (r.get("mlp") or "").startswith("fused"):  # bench_figf.py --fused-mlp (both models)
                    timing += "+fused-mlp"
                run = r.get("run") or os.path.basename(os.path.dirname(p)) or p
                rows.append(dict(r, run=run, timing=timing))
    return rows


def num(x: str) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def cell(r: dict, key: str, digits: int = 3) -> str:
    v = num(r.get(key))
    return f"{v:.{digits}f}" if v is not None else (r.get(key) or "")


TIMING_NOTE = (
    "timing: eager = each call launches its kernels from Python (host overhead included); "
    "cuda_graph = replays of one captured call (no Python launch overhead; each replay is launched onto an idle GPU, "
    "so the graph's launch latency is in the time); cuda_graph_queued = the same replays queued behind a spin kernel "
    "(the GPU's execution time of one call, without that latency); +compile (Figure F) = both "
    "models run through torch.compile (bench_figf.py --compile); +compile(max-autotune-no-cudagraphs) = the same with "
    "inductor's GEMM autotuning (--compile-mode); +fused-mlp (Figure F) = both models run each block's residual add, "
    "norm, MLP and residual add as one Triton kernel (bench_figf.py --fused-mlp)."
)


def run_order(run: str) -> tuple:
    """Sort key of run folder names by their number (h200_run9 before h200_run16)."""
    digits = "".join(c for c in run.rsplit("run", 1)[-1] if c.isdigit())
    return (int(digits) if digits else -1, run)


def op_table(rows: list[dict]) -> str:
    env = rows[0]
    dates = {}
    for r in rows:
        dates.setdefault(r["run"], r["date"])
    out = [
        f"Op level, bf16, d 64 ({env['gpu']}, driver {env['driver']}, torch {env['torch']}, triton "
        f"{env['triton']}; runs: " + ", ".join(f"{k} {v}" for k, v in dates.items()) + "). Times in ms (median of "
        "CUDA events); peak = fwd+bwd MiB above inputs; speed-ups against the fastest dense backend of the same "
        f"run and timing. {TIMING_NOTE}",
        "",
        "| point | run | timing | method | fwd ms | fwd+bwd ms | fwd TFLOP/s | speed-up fwd | speed-up fwd+bwd "
        "| peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        # A failed measurement (error, "capture failed: ...") shows where its time would be.
        fwd, fb = cell(r, "fwd_ms") or r.get("error", ""), cell(r, "fwdbwd_ms") or r.get("error", "")
        out.append(
            f"| {r['point']} | {r['run']} | {r['timing']} | {r['method']} | {fwd} | {fb} | "
            f"{cell(r, 'fwd_tflops', 1)} | {cell(r, 'speedup_fwd', 2)} | {cell(r, 'speedup_fwdbwd', 2)} | "
            f"{cell(r, 'fwdbwd_peak_mib', 0)} |"
        )
    return "\n".join(out)


def figf_table(rows: list[dict]) -> str:
    env = rows[0]
    out = [
        f"Figure F, 3 layers, dim 128, 2 heads, bf16, inference ({env['gpu']}, torch {env['torch']}, triton "
        f"{env['triton']}). tokens/s at the best batch. {TIMING_NOTE}",
        "",
        "| N | run | timing | full: kernel | full tokens/s (batch) | MiTA m, k | MiTA tokens/s (batch) | speed-up "
        "| paper speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_n: dict[tuple[int, str, str], dict] = {}
    for r in rows:
        by_n.setdefault((int(r["N"]), r["run"], r["timing"]), {})[
            "mita" if r["method"].startswith("mita") else "full"
        ] = r
    for n, run, timing in sorted(by_n):
        fu, mi = by_n[n, run, timing].get("full", {}), by_n[n, run, timing].get("mita", {})
        ft, mt, sp = num(fu.get("tokens_per_s")), num(mi.get("tokens_per_s")), num(mi.get("speedup"))
        out.append(
            f"| {n} | {run} | {timing} | {fu.get('method', '')} | "
            f"{f'{ft:.3g}' if ft else fu.get('tokens_per_s', '')} "
            f"({fu.get('batch', '')}) | {mi.get('m', '')}, {mi.get('k', '')} | "
            f"{f'{mt:.3g}' if mt else mi.get('tokens_per_s', '')} ({mi.get('batch', '')}) | "
            f"{f'{sp:.2f}' if sp else mi.get('speedup', '')} | {PAPER_FIGF_SPEEDUP.get(n, '')} |"
        )
    return "\n".join(out)


def full_curve(rows: list[dict], series: list[tuple[str, str]]) -> dict[int, tuple[float, str]]:
    """Figure F's full-attention curve: at each N, (tokens/s, run) of the latest run among ``series`` ((run,
    timing) pairs) that measured it (the runs' dense numbers differ by a few percent, so one curve per run would
    lie on top of the others)."""
    full = {}
    for r in sorted(rows, key=lambda r: run_order(r["run"])):
        if (r["run"], r["timing"]) in series and r["method"].startswith("full") and num(r["tokens_per_s"]):
            full[int(r["N"])] = (num(r["tokens_per_s"]), r["run"])
    return full


def figf_plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 6))
    runs = sorted({r["run"] for r in rows}, key=run_order)
    # The three latest runs (older ones are in the table): more curves hide each other.
    series = sorted(
        {(r["run"], r["timing"]) for r in rows if r["run"] in runs[-3:]}, key=lambda s: (run_order(s[0]), s[1])
    )
    full = full_curve(rows, series)
    if full:
        ns = sorted(full)
        used = ", ".join(sorted({full[n][1] for n in ns}, key=run_order))
        a1.plot(ns, [full[n][0] for n in ns], "o-", color="k", label=f"full attention (fastest SDPA), {used}")
    for run, timing in series:
        pts = sorted(
            (int(r["N"]), num(r["tokens_per_s"]))
            for r in rows
            if (r["run"], r["timing"]) == (run, timing) and r["method"].startswith("mita") and num(r["tokens_per_s"])
        )
        if pts:
            a1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"MiTA (Triton), {run}, {timing}")
    for run, timing in series:
        sp = sorted(
            (int(r["N"]), num(r["speedup"]))
            for r in rows
            if (r["run"], r["timing"]) == (run, timing) and r["method"].startswith("mita") and num(r["speedup"])
        )
        if sp:
            a2.plot([p[0] for p in sp], [p[1] for p in sp], "o-", label=f"measured (H200, {run}, {timing})")
    a2.plot(list(PAPER_FIGF_SPEEDUP), list(PAPER_FIGF_SPEEDUP.values()), "ks--", label="paper (RTX 4090)")
    for a, t in ((a1, "tokens/s"), (a2, "speed-up over full attention")):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("N (tokens)")
        a.set_ylabel(t)
        a.grid(True, which="both", alpha=0.3)
        # Below the axes: inside they hide the curves once several runs are shown.
        a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


BENCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "results", "bench")
# Current CSV of each benchmark in results/bench; a run's CSVs are told apart by their names' start.
CURRENT = {"op": "op_bench.csv", "layers": "layer_bench.csv", "figf": "figf.csv"}
HISTORY = "history.csv"
HISTORY_FIRST = ["run", "benchmark", "source", "commit"]


def benchmark_of(path: str) -> str | None:
    """``op`` / ``layers`` / ``figf`` from a CSV's file name (op_bench*.csv, layer_bench*.csv, figf*.csv)."""
    name = os.path.basename(path)
    for bench, prefix in (("op", "op_bench"), ("layers", "layer_bench"), ("figf", "figf")):
        if name.startswith(prefix) and name.endswith(".csv"):
            return bench
    return None


def history_rows(path: str, run: str, commit: str = "", source: str | None = None) -> list[dict]:
    """A benchmark CSV's rows as history rows: ``run``, ``benchmark``, ``source`` (the CSV's path as given, or
    ``source``) and ``commit`` (the measured commit, "" when unknown) before the CSV's own columns."""
    bench = benchmark_of(path)
    if bench is None:
        raise SystemExit(f"{path}: not a benchmark CSV (op_bench*.csv, layer_bench*.csv, figf*.csv)")
    with open(path) as f:
        return [
            {"run": run, "benchmark": bench, "source": source or path, "commit": commit, **r} for r in csv.DictReader(f)
        ]


def write_rows(path: str, rows: list[dict], first: list[str]) -> None:
    """Rows with different columns as one CSV: ``first`` columns first, then the others in order of appearance."""
    keys = list(first)
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def add_run(out: str, run: str, paths: list[str], commit: str = "", current: bool = True) -> None:
    """Append ``paths`` (one run's CSVs) to ``out``/history.csv and (``current``) make them the current CSVs of
    their benchmarks."""
    history = read_rows(os.path.join(out, HISTORY))
    by_bench: dict[str, list[dict]] = {}
    for p in paths:
        new = history_rows(p, run, commit, source=f"{run}/{os.path.basename(p)}")
        history += new
        by_bench.setdefault(new[0]["benchmark"] if new else "", []).extend(new)
    write_rows(os.path.join(out, HISTORY), [{k: v for k, v in r.items() if v is not None} for r in history],
               HISTORY_FIRST)  # fmt: skip
    for bench, rows in by_bench.items():
        if bench and current:
            latest = [{"run": r["run"], **{k: v for k, v in r.items() if k not in HISTORY_FIRST}} for r in rows]
            write_rows(os.path.join(out, CURRENT[bench]), latest, ["run"])


def layers_table(rows: list[dict]) -> str:
    env = rows[0]
    out = [
        f"Layer level: each attention layer with its projections, bf16 ({env['gpu']}, torch {env['torch']}, triton "
        f"{env['triton']}; {env['run']}, {env['date']}). Times in ms (median of CUDA events; timing as in the op "
        "table, eager where the run had no other mode); speed-ups against the fastest full-attention variant of the "
        "same point and timing.",
        "",
        "| point | timing | method | fwd ms | fwd+bwd ms | speed-up fwd | speed-up fwd+bwd | peak MiB fwd+bwd |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['point']} | {r.get('timing') or 'eager'} | {r['method']} | {cell(r, 'fwd_ms')} | "
            f"{cell(r, 'fwdbwd_ms')} | "
            f"{cell(r, 'speedup_fwd', 2)} | {cell(r, 'speedup_fwdbwd', 2)} | {cell(r, 'fwdbwd_peak_mib', 0)} |"
        )
    return "\n".join(out)


FILES_NOTE = """Files:

- `op_bench.csv`: the op-level benchmark (`scripts/bench/bench_op.py`) of the newest run, every timing it ran.
- `layer_bench.csv`: the layer-level benchmark (`scripts/bench/bench_layers.py`) of the newest run that ran it.
- `figf.csv`: Figure F (`scripts/bench/bench_figf.py`) of the newest run that ran it.
- `history.csv`: every run's rows of the three benchmarks (h200_run1 to the newest), one row per measurement, with
  `run`, `benchmark` (op / layers / figf), `source` (the CSV it came from, within the run's folder), `commit` (the
  measured commit where the run's call record named it) and the CSVs' own columns (date, GPU, driver, torch,
  triton, python, timing, ...). Before run 25 each run had a folder here with its call scripts, logs and profiler
  output; those left the tree and are in git history (`git log --diff-filter=D -- results/bench`).
- `figf.png`: Figure F's tokens/s and speed-ups of the three latest runs (from `history.csv`), with the paper's.
- `README.md`: this file, generated with the figure by `python scripts/bench/make_report.py` from the CSVs; a new
  run's CSVs go in with `make_report.py --add-run RUN --commit COMMIT CSV...`.

Commands: docs/kernels.md; what each run changed and measured: notes/kernels-notes.md."""


README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")
SPEED_BEGIN = "<!-- speed table: begin (scripts/bench/make_report.py) -->"
SPEED_END = "<!-- speed table: end -->"
SPEED_TIMINGS = (("eager", "eager"), ("cuda_graph_queued", "CUDA graph"))


def speed_table(history: list[dict]) -> str:
    """MiTA (Triton) against the fastest dense SDPA backend of the same run and timing, per op benchmark point:
    the newest eager row beside the newest CUDA-graph (queued) row of history.csv measured on an H200 (README's
    "Speed on one H200"; rows of other GPUs stay in the history), each with its run and commit."""

    def age(r: dict) -> tuple:
        return run_order(r["run"]), r.get("date", "")

    newest: dict[tuple[str, str], dict] = {}
    for r in history:
        if r.get("benchmark") != "op" or r.get("method") != "mita_triton" or num(r.get("fwd_ms")) is None:
            continue
        if "H200" not in (r.get("gpu") or ""):
            continue
        key = (r["point"], r.get("timing") or "eager")
        if key not in newest or age(r) >= age(newest[key]):
            newest[key] = r
    points = sorted({p for p, _ in newest}, key=lambda p: (p != "deit_s", int(p[1:]) if p[1:].isdigit() else 0, p))
    head = "| point (B x H, N, d, m, k) |"
    rule = "|---|"
    for _, label in SPEED_TIMINGS:
        head += f" {label}: MiTA fwd / fwd+bwd ms | speed-up fwd / fwd+bwd | run, commit, date |"
        rule += "---|---|---|"
    out = [head, rule]
    for p in points:
        first = next(newest[(p, t)] for t, _ in SPEED_TIMINGS if (p, t) in newest)
        shape = f"{p} ({first['B']} x {first['H']}, {first['N']}, {first['d']}, {first['m']}, {first['k']})"
        cells = [shape]
        for t, _ in SPEED_TIMINGS:
            r = newest.get((p, t))
            if r is None:
                cells += ["—", "—", "—"]
                continue
            cells += [
                f"{cell(r, 'fwd_ms')} / {cell(r, 'fwdbwd_ms')}",
                f"{cell(r, 'speedup_fwd', 2)}x / {cell(r, 'speedup_fwdbwd', 2)}x",
                f"{r['run']}, {(r.get('commit') or '?')[:7]}, {r.get('date', '')[:10]}",
            ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.normpath(BENCH_DIR), help="results/bench")
    ap.add_argument("--add-run", metavar="RUN", help="a run's name (h200_runN): add the CSVs given to the history")
    ap.add_argument("--commit", default="", help="with --add-run: the commit the run measured")
    ap.add_argument("csvs", nargs="*", help="with --add-run: the run's benchmark CSVs")
    ap.add_argument(
        "--readme",
        default=None,
        help="the README whose speed table is regenerated from history.csv (default: the repository's README when "
        "--out is results/bench, else none)",
    )
    ap.add_argument(
        "--history-only",
        action="store_true",
        help="with --add-run: add the CSVs to history.csv only (a partial run: the current CSVs stay as they are)",
    )
    args = ap.parse_args(argv)
    if args.add_run:
        if not args.csvs:
            raise SystemExit("--add-run needs the run's CSVs")
        add_run(args.out, args.add_run, args.csvs, args.commit, current=not args.history_only)
    elif args.csvs:
        raise SystemExit("CSVs are taken with --add-run only")
    cur = {b: os.path.join(args.out, name) for b, name in CURRENT.items()}
    md = ["# Benchmarks (generated by scripts/bench/make_report.py; do not edit)", "", FILES_NOTE, ""]
    if os.path.exists(cur["op"]):
        md += [op_table(read([cur["op"]])), ""]
    if os.path.exists(cur["layers"]):
        md += [layers_table(read([cur["layers"]])), ""]
    if os.path.exists(cur["figf"]):
        md += [figf_table(read([cur["figf"]])), ""]
    all_history = read([os.path.join(args.out, HISTORY)]) if os.path.exists(os.path.join(args.out, HISTORY)) else []
    readme = args.readme
    if readme is None and os.path.abspath(args.out) == os.path.abspath(BENCH_DIR):
        readme = os.path.normpath(README)
    if (
        all_history
        and readme
        and os.path.exists(readme)
        and not replace_block(Path(readme), SPEED_BEGIN, SPEED_END, lambda: speed_table(all_history))
    ):
        raise SystemExit(f"{readme}: no speed-table markers ({SPEED_BEGIN} ... {SPEED_END})")
    # The figure: each run's published Figure F CSVs (a run folder's top level; not its calls' partial repeats).
    history = [r for r in all_history if r.get("benchmark") == "figf" and r.get("source", "").count("/") == 1]
    if history:
        figf_plot(history, os.path.join(args.out, "figf.png"))
        md += ["![Figure F](figf.png)", ""]
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(md))


if __name__ == "__main__":
    main(sys.argv[1:])
