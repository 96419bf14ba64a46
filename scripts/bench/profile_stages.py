"""Where the Triton MiTA forward spends its time: each stage timed alone (CUDA events, median).

    python scripts/bench/profile_stages.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common import cuda_time  # noqa: E402

from mita.ops.mita import triton_mita as tm  # noqa: E402


def profile_point(name: str, B: int, H: int, N: int, m: int, k: int) -> None:
    """Print the median time of each forward stage at one shape (bf16, d 64, S 1)."""
    BH, d = B * H, 64
    q, kk, v = (torch.randn(BH, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    r = torch.randn(BH, m, d, device="cuda", dtype=torch.bfloat16)
    rk = torch.matmul(r.float(), kk.float().transpose(1, 2))
    rq = torch.matmul(q.float(), r.float().transpose(1, 2))
    plan = tm.build_plan(rk, rq, None, k, 1)
    vt = (torch.softmax(rk * d**-0.5, -1) @ v.float()).to(q.dtype)
    stages = {
        "scores R k^T (fp32 matmul)": lambda: torch.matmul(r.float(), kk.float().transpose(1, 2)),
        "scores q R^T (fp32 matmul)": lambda: torch.matmul(q.float(), r.float().transpose(1, 2)),
        "top-k (packed int64)": lambda: tm.topk_lowest_index(rk, k),
        "top-k (torch.topk fp32, reference)": lambda: torch.topk(rk, k, dim=-1),
        "build_plan (top-k + routing + tiles)": lambda: tm.build_plan(rk, rq, None, k, 1),
        "landmark values softmax(.)v": lambda: (torch.softmax(rk * d**-0.5, -1) @ v.float()).to(q.dtype),
        "fused attention kernel": lambda: tm.mita_fwd(q, kk, v, r, vt, plan, 1, True, d**-0.5, 1.0 / d),
        "whole triton_mita forward": lambda: tm.triton_mita(
            q.view(B, H, N, d), kk.view(B, H, N, d), v.view(B, H, N, d), r.view(B, H, m, d), k),
    }
    for sname, fn in stages.items():
        with torch.no_grad():
            ms, spread = cuda_time(fn, warmup=2, reps=10, max_s=5.0)
        print(f"{name:9s} {sname:40s} {ms:9.3f} ms (spread {spread:.3f})", flush=True)


def main() -> None:
    pts = [("deit_s", 256, 6, 197, 25, 25), ("N65536", 1, 2, 65536, 128, 128), ("N1048576", 1, 2, 1 << 20, 512, 512)]
    for p in pts:
        profile_point(*p)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
