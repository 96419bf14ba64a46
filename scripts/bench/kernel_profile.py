"""Per-kernel GPU time of MiTA and dense attention (torch.profiler), to see where an op-level call spends time.

    python scripts/bench/kernel_profile.py [--points deit_s,N65536] [--backend triton] [--sequence]
    python scripts/bench/kernel_profile.py --figf 65536:16,1048576:2 [--compile] [--fused-mlp]  # Figure F's MiTA model
    python scripts/bench/kernel_profile.py --layers deit_s [--attentions mita,full[cudnn]]  # bench_layers' layers

For each point prints: wall time per call (CUDA events, eager), the sum of GPU kernel time per call, and the
kernels sorted by GPU time. Wall time well above the GPU sum means the call is bound by the host (launches).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common import cuda_time  # noqa: E402

from mita.ops.landmarks import pool_landmarks  # noqa: E402
from mita.ops.mita.api import mita_attention  # noqa: E402

POINTS = {
    "deit_s": dict(B=256, H=6, N=197, m=25, k=25),
    "N4096": dict(B=1, H=2, N=4096, m=32, k=32),
    "N65536": dict(B=1, H=2, N=65536, m=128, k=128),
    # Figure F's MiTA layer at 64K (batch 16): 32 heads of rows, GPU-bound.
    "N65536xB16": dict(B=16, H=2, N=65536, m=128, k=128),
    "N262144": dict(B=1, H=2, N=1 << 18, m=256, k=256),
    "N1048576": dict(B=1, H=2, N=1 << 20, m=512, k=512),
}


def make_fns(p: dict, backend: str):
    B, H, N, d = p["B"], p["H"], p["N"], 64
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def mita():
        if N == 197:
            r = pool_landmarks(q, p["m"], layout="official", grid=(14, 14), num_prefix_tokens=1)
        else:
            r = pool_landmarks(q, p["m"], layout="1d")
        return mita_attention(q, k, v, r, p["k"], backend=backend)

    def dense():
        return F.scaled_dot_product_attention(q, k, v)

    def fb(f):
        def g():
            for t in (q, k, v):
                t.grad = None
            f().backward(do)

        return g

    return {"mita fwd": mita, "mita fwd+bwd": fb(mita), "dense fwd": dense, "dense fwd+bwd": fb(dense)}


def _profiled(fn, reps: int):
    """The profiler after one warm-up call and ``reps`` profiled calls of ``fn``."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_table(fn, reps: int = 5, top: int | None = 14) -> tuple[float, list[tuple[str, float, int]]]:
    prof = _profiled(fn, reps)
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = ev.cuda_time_total
        if t > 0 and ev.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((ev.key[:70], t / reps / 1e3, ev.count // reps))
    rows.sort(key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows[:top]


def kernel_sequence(fn, reps: int = 3) -> list[tuple[str, float]]:
    """The GPU kernels of one call of ``fn`` in launch order with their durations in ms (the last of ``reps``
    profiled calls), so kernels that share a name (the scan passes) are told apart."""
    prof = _profiled(fn, reps)
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    per = len(evs) // reps
    return [(e.name[:70], e.time_range.elapsed_us() / 1e3) for e in evs[len(evs) - per :]]


def profile_layers(names: list[str], labels: list[str]) -> None:
    """Wall and per-kernel GPU time of whole layers (projections included) as bench_layers.py builds them, forward
    (no_grad) and forward + backward."""
    from bench_layers import build, methods, points, stage_fns

    pts = {p["name"]: p for p in points(1 << 20)}
    for name in names:
        p = pts[name]
        meth = methods(p, [lab for lab in labels if not lab.startswith("full")], "cuda")
        for label in labels:
            reg, opts = meth[label]
            layer = build(reg, opts, p).to("cuda", torch.bfloat16)
            x = torch.randn(p["B"], p["N"], p["H"] * p["d"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for stage, fn in stage_fns(layer, x, p["grid"]):
                with torch.no_grad() if stage == "fwd" else contextlib.nullcontext():
                    wall, spread = cuda_time(fn, warmup=3, reps=30, max_s=5.0)
                    gpu, rows = kernel_table(fn, reps=5, top=20)
                head = f"== layer {name} {label} {stage}: wall {wall:.3f} ms (spread {spread:.3f})"
                print(f"{head}, GPU kernels {gpu:.3f} ms")
                for key, ms, cnt in rows:
                    print(f"   {ms:8.4f} ms  x{cnt:<3d} {key}", flush=True)
            del layer, x
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="deit_s,N65536")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--figf", default="", help="N:batch,... profile one forward of Figure F's MiTA model instead")
    ap.add_argument("--compile", action="store_true", help="with --figf: torch.compile the model first")
    ap.add_argument("--fused-mlp", action="store_true", help="with --figf: the blocks' fused MLP kernel")
    ap.add_argument("--layers", default="", help="bench_layers.py point names: profile whole layers instead")
    ap.add_argument("--attentions", default="mita,full[cudnn]", help="with --layers: bench_layers method labels")
    ap.add_argument(
        "--sequence", action="store_true", help="also list the MiTA forward's kernels in launch order with durations"
    )
    args = ap.parse_args()
    if args.layers:
        profile_layers(args.layers.split(","), args.attentions.split(","))
        return
    if args.figf:
        from bench_figf import DIM, build

        for item in args.figf.split(","):
            n, b = (int(s) for s in item.split(":"))
            model = build("mita", n, 2, fused_mlp=args.fused_mlp)
            if args.compile:
                model = torch.compile(model)
            x = torch.randn(b, n, DIM, device="cuda", dtype=torch.bfloat16)
            fwd = functools.partial(model, x)
            with torch.inference_mode():
                wall, spread = cuda_time(fwd, warmup=2, reps=5, max_s=5.0)
                gpu, rows = kernel_table(fwd, reps=3, top=25)
            tag = (" compiled" if args.compile else "") + (" fused-mlp" if args.fused_mlp else "")
            print(f"== figf N={n} B={b}{tag}: wall {wall:.3f} ms (spread {spread:.3f}), GPU kernels {gpu:.3f} ms")
            print(f"   {b * n / wall * 1e3:.3e} tokens/s wall, {b * n / gpu * 1e3:.3e} tokens/s GPU sum", flush=True)
            for key, ms, cnt in rows:
                print(f"   {ms:8.4f} ms  x{cnt:<3d} {key}", flush=True)
            del model, x
            torch.cuda.empty_cache()
        return
    for name in args.points.split(","):
        p = POINTS[name]
        fns = make_fns(p, args.backend)
        for fname, fn in fns.items():
            if fname.startswith("dense") and p["N"] > 1 << 18:
                continue
            wall, spread = cuda_time(fn, warmup=3, reps=20, max_s=5.0)
            gpu, rows = kernel_table(fn)
            print(f"== {name} {fname}: wall {wall:.3f} ms (spread {spread:.3f}), GPU kernels {gpu:.3f} ms", flush=True)
            for key, ms, cnt in rows:
                print(f"   {ms:8.4f} ms  x{cnt:<3d} {key}", flush=True)
            if args.sequence and fname == "mita fwd":
                with torch.no_grad():
                    seq = kernel_sequence(fn)
                print(f"   launch order ({len(seq)} kernels, {sum(t for _, t in seq):.4f} ms):")
                for i, (key, ms) in enumerate(seq):
                    print(f"   [{i:2d}] {ms:8.4f} ms  {key}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
