"""Sweep the launch settings of the general (long-sequence) path at the Figure F shapes: the fused attention
forward (attention_fwd.FWD_CONFIG) and the long-row top-k scan passes (topk.SCAN_CONFIG).

    python scripts/bench/tune_long.py [--points N262144,N1048576] [--parts fwd,topk]

Each setting is checked against the default before its time is printed: the top-k indices bitwise, the attention
output closely (max relative error). Times are CUDA-event medians of the stage alone (bf16, d 64, B 1, H 2).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common import cuda_time  # noqa: E402
from kernel_profile import POINTS  # noqa: E402

from mita.ops.mita.triton import attention_fwd as afwd  # noqa: E402
from mita.ops.mita.triton import landmark_values as tlv  # noqa: E402
from mita.ops.mita.triton import plan as tplan  # noqa: E402
from mita.ops.mita.triton import routing as trt  # noqa: E402
from mita.ops.mita.triton import topk as ttk  # noqa: E402

FWD_VARIANTS = [
    dict(bm_max=64, bn_max=None, num_warps=None, num_stages=None),
    dict(bm_max=64, bn_max=None, num_warps=4, num_stages=None),
    dict(bm_max=64, bn_max=None, num_warps=8, num_stages=2),
    dict(bm_max=64, bn_max=None, num_warps=4, num_stages=4),
    dict(bm_max=64, bn_max=128, num_warps=8, num_stages=None),
    dict(bm_max=64, bn_max=128, num_warps=4, num_stages=2),
    dict(bm_max=128, bn_max=None, num_warps=8, num_stages=None),
    dict(bm_max=128, bn_max=None, num_warps=8, num_stages=2),
    dict(bm_max=128, bn_max=128, num_warps=8, num_stages=2),
    dict(bm_max=128, bn_max=None, num_warps=4, num_stages=None),
    dict(bm_max=32, bn_max=None, num_warps=4, num_stages=None),
]
SCAN_VARIANTS = [
    dict(bn=64, bs=None, num_warps=4),
    dict(bn=64, bs=None, num_warps=8),
    dict(bn=128, bs=None, num_warps=4),
    dict(bn=128, bs=None, num_warps=8),
    dict(bn=64, bs=128, num_warps=8),
    dict(bn=32, bs=None, num_warps=4),
    dict(bn=64, bs=32, num_warps=4),
]


def tune_point(name: str, parts: tuple[str, ...] = ("fwd", "topk")) -> None:
    """Time every variant at one point and restore the default settings."""
    fwd_default, scan_default = copy.deepcopy(afwd.FWD_CONFIG), copy.deepcopy(ttk.SCAN_CONFIG)
    p = POINTS[name]
    BH, N, d, m, k = p["B"] * p["H"], p["N"], 64, p["m"], p["k"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, kk, v = (torch.randn(BH, N, d, device="cuda", generator=g).bfloat16() for _ in range(3))
    r = torch.randn(BH, m, d, device="cuda", generator=g).bfloat16()
    idx_ref = ttk.exact_topk(r, kk, None, k)
    route = trt.route_topk(q, r, 1)
    vt, _ = tlv.landmark_values_fwd(r, kk, v, None, d**-0.5)
    o_ref = None
    for var in FWD_VARIANTS if "fwd" in parts else []:
        afwd.FWD_CONFIG.update(fwd_default)
        afwd.FWD_CONFIG.update(var)
        try:
            plan = tplan.build_plan(idx_ref, route, m)

            def fwd(plan=plan):
                return afwd.mita_fwd(q, kk, v, r, vt, plan, 1, True, d**-0.5, 1.0 / d)[0]

            o = fwd()
            if o_ref is None:
                o_ref = o.float()
            err = ((o.float() - o_ref).norm() / o_ref.norm()).item()
            ms, spread = cuda_time(fwd, warmup=3, reps=20, max_s=3.0)
            print(f"{name:9s} fwd  {str(var):70s} {ms:8.4f} ms (spread {spread:.4f}) rel err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 (a setting that does not compile or fit is reported, not fatal)
            print(f"{name:9s} fwd  {str(var):70s} FAILED {str(e).splitlines()[0][:100]}", flush=True)
    afwd.FWD_CONFIG.update(fwd_default)
    for var in SCAN_VARIANTS if "topk" in parts else []:
        ttk.SCAN_CONFIG.update(scan_default)
        ttk.SCAN_CONFIG.update(var)
        try:

            def topk():
                return ttk.exact_topk(r, kk, None, k)

            same = torch.equal(topk(), idx_ref)
            ms, spread = cuda_time(topk, warmup=3, reps=20, max_s=3.0)
            print(f"{name:9s} topk {str(var):70s} {ms:8.4f} ms (spread {spread:.4f}) equal {same}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name:9s} topk {str(var):70s} FAILED {str(e).splitlines()[0][:100]}", flush=True)
    ttk.SCAN_CONFIG.update(scan_default)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="N262144,N1048576")
    ap.add_argument("--parts", default="fwd,topk", help="comma-separated: fwd (FWD_VARIANTS), topk (SCAN_VARIANTS)")
    args = ap.parse_args()
    parts = tuple(args.parts.split(","))
    if not parts or any(p not in ("fwd", "topk") for p in parts):
        raise SystemExit(f"--parts takes fwd and/or topk, got {args.parts!r}")
    for name in args.points.split(","):
        tune_point(name, parts)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
