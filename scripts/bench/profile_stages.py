"""Where the Triton MiTA forward spends its time: each stage timed alone (CUDA events, median).

    python scripts/bench/profile_stages.py [--max-n 1048576] [--points deit_s,N65536,N65536xB16,...]

For N above the on-chip top-k limit it also times each pass of the long-row exact top-k in place, twice: as
called (the candidates of every row fit the list: the refinement passes exit at once on the device) and with
the list forced to k entries, so that most rows take the fallback (refinement, recount, ordered emission).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common import cuda_time  # noqa: E402
from kernel_profile import POINTS  # noqa: E402

from mita.ops.mita.triton import attention_fwd as afwd  # noqa: E402
from mita.ops.mita.triton import landmark_values as tlv  # noqa: E402
from mita.ops.mita.triton import op as tmop  # noqa: E402
from mita.ops.mita.triton import plan as tplan  # noqa: E402
from mita.ops.mita.triton import routing as trt  # noqa: E402
from mita.ops.mita.triton import topk as ttk  # noqa: E402


def profile_point(name: str, B: int, H: int, N: int, m: int, k: int) -> None:
    """Print the median time of each forward stage at one shape (bf16, d 64, S 1)."""
    BH, d = B * H, 64
    q, kk, v = (torch.randn(BH, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    r = torch.randn(BH, m, d, device="cuda", dtype=torch.bfloat16)
    idx = ttk.exact_topk(r, kk, None, k)
    route = trt.route_topk(q, r, 1)
    plan = tplan.build_plan(idx, route, m)
    vt, _ = tlv.landmark_values_fwd(r, kk, v, None, d**-0.5)
    q4, k4, v4, r4 = q.view(B, H, N, d), kk.view(B, H, N, d), v.view(B, H, N, d), r.view(B, H, m, d)
    ins = [t.requires_grad_() for t in (q4, k4, v4, r4)]
    do = torch.randn_like(q4)

    def fwd_bwd():
        for t in ins:
            t.grad = None
        tmop.triton_mita(q4, k4, v4, r4, k).backward(do)

    stages = {
        "exact top-k (Triton)": lambda: ttk.exact_topk(r, kk, None, k),
        "exact top-k, fallback forced (cap = k)": lambda: ttk.exact_topk(r, kk, None, k, cap=k),
        "top-S routing (Triton)": lambda: trt.route_topk(q, r, 1),
        "build_plan (sort + tiles)": lambda: tplan.build_plan(idx, route, m),
        "landmark values fwd (split-key)": lambda: tlv.landmark_values_fwd(r, kk, v, None, d**-0.5),
        "fused attention kernel": lambda: afwd.mita_fwd(q, kk, v, r, vt, plan, 1, True, d**-0.5, 1.0 / d),
        "whole triton_mita forward": lambda: tmop.triton_mita(q4, k4, v4, r4, k),
    }
    for sname, fn in stages.items():
        with torch.no_grad():
            ms, spread = cuda_time(fn, warmup=2, reps=10, max_s=5.0)
        print(f"{name:9s} {sname:40s} {ms:9.3f} ms (spread {spread:.3f})", flush=True)
    ms, spread = cuda_time(fwd_bwd, warmup=2, reps=10, max_s=5.0)
    print(f"{name:9s} {'whole forward + backward':40s} {ms:9.3f} ms (spread {spread:.3f})", flush=True)
    if N > ttk.SMALL_N:
        profile_topk_passes(name, r, kk, k)
        profile_topk_passes(name + "/fb", r, kk, k, cap=k)


def profile_topk_passes(name: str, r, kk, k: int, reps: int = 5, cap: int | None = None) -> None:
    """Print the median time of each pass of the long-row exact top-k, each timed in its place in a full call
    (``cap``: the candidate-list length, None for the default)."""
    acc: dict[str, list] = {}

    def timer(sname, fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        acc.setdefault(sname, []).append((start, end))
        return out

    ref = ttk.exact_topk(r, kk, None, k)
    for _ in range(reps):
        got = ttk.exact_topk(r, kk, None, k, cap=cap, timer=timer)
    # Same answer whatever the path (each row's k keys, ascending).
    assert torch.equal(got, ref), f"{name}: top-k with cap={cap} differs from the default call"
    torch.cuda.synchronize()
    total = 0.0
    for sname, evs in acc.items():
        ms = statistics.median(s.elapsed_time(e) for s, e in evs)
        total += ms
        print(f"{name:9s}   top-k: {sname:38s} {ms:9.3f} ms", flush=True)
    print(f"{name:9s}   top-k: {'sum of passes':38s} {total:9.3f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-n", type=int, default=1 << 20)
    ap.add_argument("--points", default="deit_s,N65536,N262144,N1048576", help=f"names among {sorted(POINTS)}")
    args = ap.parse_args()
    for name in args.points.split(","):
        if name not in POINTS:
            raise SystemExit(f"unknown point {name!r}; known: {sorted(POINTS)}")
        p = POINTS[name]
        if p["N"] <= args.max_n:
            profile_point(name, p["B"], p["H"], p["N"], p["m"], p["k"])
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
