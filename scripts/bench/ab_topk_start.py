"""A/B of the long-row top-k's start threshold on the GPU: SCAN_CONFIG["block_top"] = t for each t, side by side in
one process, on i.i.d. and on correlated tokens (AR(1) along N, as bench_op.py --rho).

For each (N, rho, t) prints the MiTA forward time (CUDA events, median), the top-k alone, and how many landmark rows
overflowed their candidate list (those take the refinement passes). Results print as they come, so a run cut short
still reports its first points.

    python scripts/bench/ab_topk_start.py [--points 1048576:512,65536:128] [--rho 0.9,0] [--tops 1,2,4]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common import correlated_tokens, cuda_time, environment, wall_time  # noqa: E402

from mita.ops.landmarks import pool_landmarks  # noqa: E402
from mita.ops.mita import triton_routing  # noqa: E402
from mita.ops.mita.api import mita_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="1048576:512,65536:128", help="N:m (m = k) pairs, B 1, H 2, d 64")
    ap.add_argument("--rho", default="0.9,0")
    ap.add_argument("--tops", default="1,2,4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (wall-clock times)")
    args = ap.parse_args()
    dev = args.device
    timer = cuda_time if dev == "cuda" else wall_time
    print(environment(), flush=True)
    for point in args.points.split(","):
        n, m = (int(x) for x in point.split(":"))
        for rho in (float(x) for x in args.rho.split(",")):
            g = torch.Generator(device=dev).manual_seed(n)
            q, k, v = (correlated_tokens((1, 2, n, 64), rho, g, device=dev) for _ in range(3))
            r = pool_landmarks(q, m, layout="1d")
            rf, kf = r.reshape(2, m, 64), k.reshape(2, n, 64)

            def topk(rf=rf, kf=kf, m=m):
                return triton_routing.exact_topk(rf, kf, None, m)

            def fwd(q=q, k=k, v=v, r=r, m=m):
                return mita_attention(q, k, v, r, m, backend="triton")

            first = None
            with torch.no_grad():
                for t in (int(x) for x in args.tops.split(",")):
                    triton_routing.SCAN_CONFIG["block_top"] = t
                    st: dict = {}
                    idx = triton_routing.exact_topk(rf, kf, None, m, stats=st)
                    first = idx.clone() if first is None else first
                    topk_ms, _ = timer(topk, warmup=1, reps=args.reps, max_s=5.0)
                    fwd_ms, _ = timer(fwd, warmup=1, reps=args.reps, max_s=5.0)
                    print(
                        f"N {n} m=k {m} rho {rho} block_top {t}: fwd {fwd_ms:.3f} ms, top-k {topk_ms:.3f} ms, "
                        f"overflow rows {int(st['overflow_rows'])}/{2 * m}, same selection as the first setting: "
                        f"{torch.equal(idx, first)}",
                        flush=True,
                    )
            del q, k, v, r
            if dev == "cuda":
                torch.cuda.empty_cache()
    triton_routing.SCAN_CONFIG["block_top"] = 1


if __name__ == "__main__":
    main()
