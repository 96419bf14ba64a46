"""The long-row top-k's fallback on the GPU: each pass of ``exact_topk`` timed in place (CUDA events around each
named launch, median of the repetitions) for several settings side by side, on inputs where no row, one row or most
rows overflow the candidate list.

    python scripts/bench/fallback_bench.py [--points 65536:128,262144:256] [--reps 20]
        [--variants "fallback=0|fallback=1|fallback=1;fb_spin=1"]

Inputs per point (B 1, H 2, d 64, bf16, m = k, landmarks pooled from the queries as ab_scan.py's): i.i.d. tokens (no
row overflows), AR(1) 0.9 tokens (a few rows overflow at 64K) and i.i.d. tokens with the list forced to k entries (cap
= k: most rows take the fallback). Each line gives the total of the passes and each pass's time, the overflowing rows,
and whether the selection is bitwise the first variant's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from ab_scan import Variants  # noqa: E402
from common import correlated_tokens, environment  # noqa: E402

from mita.ops.landmarks import pool_landmarks  # noqa: E402
from mita.ops.mita.triton import topk as ttk  # noqa: E402


def time_passes(r, k, ksel, cap, reps: int) -> tuple[dict, torch.Tensor, int]:
    """Median time of each named pass (ms), the selection and the overflowing rows."""
    times: dict[str, list[float]] = {}

    def timer(name, fn):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        events.append((name, a, b))
        return out

    st: dict = {}
    idx = ttk.exact_topk(r, k, None, ksel, cap=cap, stats=st)
    for _ in range(3):
        ttk.exact_topk(r, k, None, ksel, cap=cap)
    for _ in range(reps):
        events: list = []
        ttk.exact_topk(r, k, None, ksel, cap=cap, timer=timer)
        torch.cuda.synchronize()
        for name, a, b in events:
            times.setdefault(name, []).append(a.elapsed_time(b))
    return {n: statistics.median(v) for n, v in times.items()}, idx, int(st["overflow_rows"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="65536:128,262144:256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="fallback=0|fallback=1|fallback=1;fb_spin=1")
    args = ap.parse_args()
    print(environment())
    texts = args.variants.split("|")
    # Each entry's settings over the defaults (any key ab_scan.py --variants takes), put back after it.
    apply = Variants()
    for point in args.points.split(","):
        n, m = (int(x) for x in point.split(":"))
        for label, rho, cap in (("iid", 0.0, None), ("ar0.9", 0.9, None), ("iid cap=k", 0.0, m)):
            g = torch.Generator(device="cuda").manual_seed(n)
            q, k = (correlated_tokens((1, 2, n, 64), rho, g, device="cuda") for _ in range(2))
            r = pool_landmarks(q, m, layout="1d").reshape(2, m, 64)
            k = k.reshape(2, n, 64)
            first = None
            for text in texts:
                apply["variant"] = text
                t, idx, ov = time_passes(r, k, m, cap, args.reps)
                first = idx if first is None else first
                parts = ", ".join(f"{name} {ms * 1e3:.1f}" for name, ms in t.items())
                print(
                    f"N {n} m=k {m} {label} [{text}]: total {sum(t.values()) * 1e3:.1f} us; overflow rows {ov}/"
                    f"{2 * m}; same as first: {torch.equal(idx, first)}; passes (us): {parts}",
                    flush=True,
                )
    apply["variant"] = ""


if __name__ == "__main__":
    main()
