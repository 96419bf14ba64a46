"""Sweep the launch settings of the short-sequence Triton kernels (mita/ops/mita/triton/short.py, short_bwd.py) at
one shape.

    python scripts/bench/tune_small.py [--shape 256,6,197,25,25] [--flat]

Each kernel's settings are varied one at a time from short.CONFIG; the forward (route + attention) and the
backward (the fused kernel, or the split variant's query + key kernels) are timed with CUDA events (median), and
every setting's output is checked against the default setting's (bitwise for the routing, closely for the rest)
before its time is printed. First, the two backward variants at their defaults, side by side.
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

from mita.ops.mita.triton import short as ts  # noqa: E402
from mita.ops.mita.triton import short_bwd as tsb  # noqa: E402

# (BM, BN, num_warps, num_stages) tried for each block kernel.
_BLOCK_SETTINGS = (
    (64, 64, 4, 2),
    (64, 64, 8, 2),
    (64, 32, 4, 2),
    (32, 64, 4, 2),
    (64, 64, 4, 1),
    (128, 64, 8, 2),
    (32, 32, 2, 2),
    (16, 64, 2, 2),
    (64, 128, 8, 2),
)
VARIANTS = {
    "route": [dict(BS=16, num_warps=w, num_stages=1) for w in (2, 4, 8)]
    + [dict(BS=32, num_warps=w, num_stages=1) for w in (4, 8)],
    **{
        name: [dict(BM=bm, BN=bn, num_warps=w, num_stages=st) for bm, bn, w, st in _BLOCK_SETTINGS]
        for name in ("attn", "bwd_q", "bwd_k")
    },
    "bwd": [
        dict(BM=bm, BN=bn, num_warps=w, num_stages=st)
        for bm, bn, w, st in (
            (64, 64, 4, 1),
            (64, 64, 8, 1),
            (64, 32, 4, 1),
            (32, 64, 4, 1),
            (32, 32, 4, 1),
            (64, 64, 4, 2),
            (128, 64, 8, 1),
            (64, 128, 8, 1),
        )
    ],
}
# bwd_q and bwd_k are the split backward's kernels, bwd the fused one's (short_bwd.BWD).
_BWD_MODE = {"bwd_q": "split", "bwd_k": "split", "bwd": "fused"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="256,6,197,25,25", help="B,H,N,m,k")
    ap.add_argument("--flat", action="store_true", help="contiguous [B*H, N, d] inputs instead of the layer's views")
    args = ap.parse_args()
    B, H, N, m, k = (int(x) for x in args.shape.split(","))
    BH, d = B * H, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.flat:
        q, kk, v = (torch.randn(BH, N, d, device="cuda", generator=g).bfloat16() for _ in range(3))
        do = torch.randn(BH, N, d, device="cuda", generator=g).bfloat16()
    else:
        # As MiTAAttention calls it: q, k, v views of one [B, N, 3, H, d] projection, do in the output's order.
        qkv = torch.randn(B, N, 3, H, d, device="cuda", generator=g).bfloat16()
        q, kk, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        do = torch.randn(B, N, H, d, device="cuda", generator=g).bfloat16().transpose(1, 2)
    r = torch.randn(BH, m, d, device="cuda", generator=g).bfloat16()
    sc = d**-0.5
    default = copy.deepcopy(ts.CONFIG)

    def fwd():
        return ts.small_fwd(q, kk, v, r, None, k, 1, True, sc, sc * sc)

    ref = fwd()
    o, lse, memb, route, vt, lvlse = ref

    def bwd():
        return tsb.small_bwd(do, q, kk, v, r, None, o, lse, memb, route, vt, lvlse, 1, True, sc, sc * sc)

    mode = tsb.BWD
    ref_b = bwd()
    # The two backward variants at their default settings, side by side (interleaved rounds).
    times = {"fused": [], "split": []}
    for _ in range(3):
        for b in times:
            tsb.BWD = b
            times[b].append(cuda_time(bwd, warmup=3, reps=30, max_s=3.0)[0])
    print("backward at defaults, 3 rounds: " + ", ".join(f"{b} {sorted(t)[1]:.4f} ms" for b, t in times.items()))
    for name, variants in VARIANTS.items():
        for var in variants:
            ts.CONFIG = copy.deepcopy(default)
            ts.CONFIG[name] = var
            tsb.BWD = _BWD_MODE.get(name, mode)
            fn = fwd if name in ("route", "attn") else bwd
            try:
                out = fn()
                refs = ref if fn is fwd else ref_b
                errs = [
                    ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                    for a, b in zip(out, refs)
                    if a.is_floating_point()
                ]
                same_int = all(torch.equal(a, b) for a, b in zip(out, refs) if not a.is_floating_point())
                ms, spread = cuda_time(fn, warmup=3, reps=30, max_s=3.0)
                print(
                    f"{name:6s} {str(var):62s} {ms:8.4f} ms (spread {spread:.4f}) max rel err {max(errs):.1e} "
                    f"ints equal {same_int}",
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001 (a setting that does not compile or fit is reported, not fatal)
                print(f"{name:6s} {str(var):62s} FAILED {str(e).splitlines()[0][:100]}", flush=True)
    ts.CONFIG = default
    tsb.BWD = mode


if __name__ == "__main__":
    main()
