"""Markdown tables and PNG plots from the benchmark CSVs (only measured numbers; the paper's as the paper's).

    python scripts/bench/make_report.py --op results/bench/h200_run3/op_bench.csv \
        --figf results/bench/h200_run1/figf.csv results/bench/h200_run2/figf.csv --out results/bench
"""

from __future__ import annotations

import argparse
import csv
import os

# Paper (RTX 4090, whole-model Figure F speed-ups over full attention on FlashAttention).
PAPER_FIGF_SPEEDUP = {65536: 19.0, 262144: 56.0, 1048576: 159.0}


def read(paths: list[str]) -> list[dict]:
    """Rows of the CSVs, each with ``run`` (the folder: the kernel version it was measured with) and ``timing``
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
                rows.append(dict(r, run=os.path.basename(os.path.dirname(p)) or p, timing=timing))
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
    "norm, MLP and residual add as one Triton kernel (bench_figf.py --fused-mlp, mita/ops/fused_mlp.py)."
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", nargs="+", required=True)
    ap.add_argument("--figf", nargs="+", required=True)
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args()
    op_rows, figf_rows = read(args.op), read(args.figf)
    md = [
        "# Benchmarks (generated by scripts/bench/make_report.py; do not edit)",
        "",
        f"Sources: op {', '.join(args.op)}; Figure F {', '.join(args.figf)} (logs beside each CSV; commands "
        "in docs/kernels.md, history in notes/kernels-notes.md).",
        "",
        op_table(op_rows),
        "",
        figf_table(figf_rows),
        "",
        "![Figure F](figf.png)",
        "",
    ]
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(md))
    figf_plot(figf_rows, os.path.join(args.out, "figf.png"))


if __name__ == "__main__":
    main()
