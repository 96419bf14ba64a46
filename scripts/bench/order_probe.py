"""What earlier work in a process does to a later MiTA timing: a sequence of steps in one process, each printed with
its time, so a slowdown can be pinned on the step before it.

    python scripts/bench/order_probe.py --steps "mita:262144,dense:65536,mita:262144,sleep:5,mita:262144"

Steps (comma-separated, run in order):
    mita:N     pooling + MiTA forward at bench_op.py's point N (B 1, H 2, d 64, m = k = sqrt(N / 4)), timed as
               bench_op.py --graph times it (CUDA graph, 3 warm-ups, median of 20 replays), on fresh inputs
    fwdbwd:N   the same for forward + backward
    dense:N    cuDNN dense attention forward and forward + backward at N (CUDA graph, 1 warm-up, 3 replays)
    point:N    bench_op.py's whole point N (every dense backend it times there, MiTA forward, forward + backward and
               peak memory), as bench_op.py --graph runs it
    empty      torch.cuda.empty_cache()
    sleep:S    time.sleep(S)
    keep:N     allocate and keep N MiB (changes where later allocations land)

After each step it prints the GPU's SM clock, temperature and power (nvidia-smi, when present), read once the step
is over.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from bench_op import DENSE, dense_fn, fwd_bwd, measure, mita_fn, time_mita  # noqa: E402
from common import correlated_tokens, environment, time_ms  # noqa: E402


def point(n: int) -> dict:
    mk = int(math.sqrt(n / 4))
    return dict(name=f"N{n}", B=1, H=2, N=n, d=64, m=mk, k=mk, layout="1d")


def inputs(p: dict):
    g = torch.Generator(device="cuda").manual_seed(p["N"])
    q, k, v = (correlated_tokens((p["B"], p["H"], p["N"], p["d"]), 0.0, g) for _ in range(3))
    do = torch.randn_like(q)
    return [t.requires_grad_() for t in (q, k, v)], do


def gpu_state() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out.splitlines()[0] if out else "?"
    except (OSError, subprocess.SubprocessError):
        return "no nvidia-smi"


def run_step(step: str, kept: list) -> str:
    kind, _, arg = step.partition(":")
    if kind in ("mita", "fwdbwd"):
        p = point(int(arg))
        (q, k, v), do = inputs(p)
        f = mita_fn(q, k, v, p, "triton")
        if kind == "mita":
            with torch.no_grad():
                ms, spread = time_ms(f, "cuda_graph", warmup=3, reps=20)
        else:
            ms, spread = time_ms(fwd_bwd(f, do, [q, k, v]), "cuda_graph", warmup=3, reps=20)
        return f"{ms:.4f} ms (spread {spread:.4f})"
    if kind == "dense":
        p = point(int(arg))
        ins, do = inputs(p)
        r = measure(dense_fn(*ins, "cudnn"), ins, do, True, "cuda_graph", 3)
        return f"fwd {r.get('fwd_ms', float('nan')):.3f} ms, fwd+bwd {r.get('fwdbwd_ms', float('nan')):.3f} ms"
    if kind == "point":
        p = point(int(arg))
        ins, do = inputs(p)
        long_run = p["N"] >= 1 << 18
        res = {}
        for name in DENSE:
            if long_run and name != "cudnn":
                continue
            try:
                res[f"dense_{name}"] = measure(dense_fn(*ins, name), ins, do, long_run, "cuda_graph", 2)
            except RuntimeError as e:
                res[f"dense_{name}"] = {"error": str(e).splitlines()[0][:80]}
        time_mita(res, ["triton"], *ins, p, ins, do, "cuda_graph")
        return f"mita fwd {res['mita_triton'].get('fwd_ms', float('nan')):.4f} ms"
    if kind == "empty":
        torch.cuda.empty_cache()
        return "emptied"
    if kind == "sleep":
        time.sleep(float(arg))
        return f"slept {arg} s"
    if kind == "keep":
        kept.append(torch.empty(int(arg) << 20, dtype=torch.uint8, device="cuda"))
        return f"keeping {sum(t.numel() for t in kept) >> 20} MiB"
    raise SystemExit(f"unknown step {step!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", required=True)
    args = ap.parse_args()
    print(environment(), flush=True)
    kept: list = []
    t0 = time.time()
    for i, step in enumerate(s for s in args.steps.split(",") if s):
        what = run_step(step, kept)
        torch.cuda.synchronize()
        print(f"[{i:2d}] t={time.time() - t0:7.1f}s {step:14s} {what:40s} | {gpu_state()}", flush=True)


if __name__ == "__main__":
    main()
