"""Host (CPU) time of the Triton MiTA forward, stage by stage: where an eager call spends time when the GPU waits.

    python scripts/bench/host_overhead.py [--points deit_s,N65536,N262144]

For each stage: host time per call (perf_counter around back-to-back calls, no synchronisation inside: the time
the Python thread needs to issue the stage) and the wall time per call with a synchronisation at the end. A stage
whose host time is close to its wall time is bound by launches, not by the GPU. Also prints the cost of single
launches (an empty Triton kernel with few and with many arguments, torch.empty, a small PyTorch op) and a cProfile
of one whole forward sorted by own and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from kernel_profile import POINTS  # noqa: E402

from mita.ops.landmarks import pool_landmarks  # noqa: E402
from mita.ops.mita.api import mita_attention  # noqa: E402
from mita.ops.mita.triton import attention_fwd as afwd  # noqa: E402
from mita.ops.mita.triton import landmark_values as tlv  # noqa: E402
from mita.ops.mita.triton import op as tmop  # noqa: E402
from mita.ops.mita.triton import plan as tplan  # noqa: E402
from mita.ops.mita.triton import routing as trt  # noqa: E402
from mita.ops.mita.triton import short as ts  # noqa: E402
from mita.ops.mita.triton import topk as ttk  # noqa: E402


@triton.jit
def _empty3(X, N, M):
    pass


@triton.jit
def _empty24(
    A, B, C, D, E, F, G, H, I, J, K, L, N0, N1, N2, N3, N4, N5, N6, N7,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
):  # fmt: skip
    pass


def host_and_wall(fn, reps: int = 10) -> tuple[float, float]:
    """(host ms per call, wall ms per call) over ``reps`` back-to-back calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3 / reps, (t2 - t0) * 1e3 / reps


def launch_costs() -> None:
    x = torch.zeros(64, device="cuda")
    ptrs = [torch.zeros(64, device="cuda") for _ in range(12)]
    cases = {
        "empty Triton kernel, 3 args": lambda: _empty3[(1,)](x, 64, 64),
        "empty Triton kernel, 20 args + 4 constexpr": lambda: _empty24[(1,)](
            *ptrs, 1, 2, 3, 4, 5, 6, 7, 8, C0=1, C1=2, C2=3, C3=4
        ),
        "torch.empty(1024)": lambda: torch.empty(1024, device="cuda"),
        "x.sum()": lambda: x.sum(),
    }
    for name, fn in cases.items():
        h, w = host_and_wall(fn, reps=200)
        print(f"launch  {name:45s} host {h * 1e3:8.1f} us  wall {w * 1e3:8.1f} us", flush=True)


def point(name: str) -> None:
    p = POINTS[name]
    B, H, N, d, m, k = p["B"], p["H"], p["N"], 64, p["m"], p["k"]
    BH = B * H
    q, kk, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    grid = (14, 14) if N == 197 else None

    def pool():
        if grid is not None:
            return pool_landmarks(q, m, layout="official", grid=grid, num_prefix_tokens=1)
        return pool_landmarks(q, m, layout="1d")

    r = pool()
    qf, kf, vf, rf = q.view(BH, N, d), kk.view(BH, N, d), v.view(BH, N, d), r.reshape(BH, m, d)
    stages = {
        "landmark pooling": pool,
        "mita_attention (dispatch + op)": lambda: mita_attention(q, kk, v, r, k, backend="triton"),
        "triton_mita (op)": lambda: tmop.triton_mita(q, kk, v, r, k),
        "pooling + mita_attention": lambda: mita_attention(q, kk, v, pool(), k, backend="triton"),
    }
    if not (tmop.SHORT_PATH and ts.small_supported(N, m, d)):
        idx = ttk.exact_topk(rf, kf, None, k)
        route = trt.route_topk(qf, rf, 1)
        plan = tplan.build_plan(idx, route, m)
        vt, _ = tlv.landmark_values_fwd(rf, kf, vf, None, d**-0.5)
        stages.update(
            {
                "exact_topk": lambda: ttk.exact_topk(rf, kf, None, k),
                "route_topk": lambda: trt.route_topk(qf, rf, 1),
                "build_plan": lambda: tplan.build_plan(idx, route, m),
                "landmark_values_fwd": lambda: tlv.landmark_values_fwd(rf, kf, vf, None, d**-0.5),
                "mita_fwd (fused attention)": lambda: afwd.mita_fwd(qf, kf, vf, rf, vt, plan, 1, True, d**-0.5, 1 / d),
            }
        )
    with torch.no_grad():
        for sname, fn in stages.items():
            h, w = host_and_wall(fn)
            print(f"{name:8s} {sname:34s} host {h:7.3f} ms  wall {w:7.3f} ms", flush=True)
        prof = cProfile.Profile()
        for _ in range(3):
            mita_attention(q, kk, v, pool(), k, backend="triton")
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(10):
            mita_attention(q, kk, v, pool(), k, backend="triton")
        prof.disable()
        torch.cuda.synchronize()
    for order in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(order).print_stats(25)
        print(f"== {name} cProfile of 10 calls (pooling + mita_attention), by {order}", flush=True)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:7000], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="deit_s,N65536,N262144")
    args = ap.parse_args()
    launch_costs()
    for name in args.points.split(","):
        point(name)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
