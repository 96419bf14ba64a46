"""One MiTA forward (or forward + backward) inside a CUDA profiler range, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --set full --import-source yes -o REPORT \\
        python scripts/bench/ncu_forward.py [--n 65536] [--m 128] [--backward]

The call is warmed up first (every kernel compiled), outside the range; the landmarks are pooled as bench_op.py's
MiTA calls pool them. B 1, H 2, d 64, bf16, m = k (``--m``; default sqrt(N) / 2, as at bench_op's points: 128 at
64K, 256 at 256K, 512 at 1M).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from mita.ops.landmarks import pool_landmarks  # noqa: E402
from mita.ops.mita.api import mita_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--m", type=int, default=None)
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    n = args.n
    m = args.m or max(16, int(round(n**0.5)) // 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=args.backward)
        for _ in range(3)
    )
    do = torch.randn_like(q)

    def call():
        r = pool_landmarks(q, m, layout="1d")
        o = mita_attention(q, k, v, r, m, backend="triton")
        if args.backward:
            o.backward(do)
        return o

    with torch.set_grad_enabled(args.backward):
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"N {n}, m = k = {m}, backward {args.backward}: profiled one call")


if __name__ == "__main__":
    main()
