"""GPU time of the 1D landmark pooling kernel (mita/ops/mita/triton/pool.py: pool1d_fwd) for each of several
settings of its CONFIG["fwd1d"], side by side in one process, against the PyTorch form of pool_landmarks(layout="1d").

    python scripts/bench/pool_bench.py [--points 65536:128,262144:256] [--variants "|BL=128|BL=256;num_warps=8"]
    python scripts/bench/pool_bench.py --device cpu      # smoke run under TRITON_INTERPRET=1, tiny sizes

A point is N:m (B 1, H 2, d 64, bf16). A variant is ';'-separated key=value pairs of CONFIG["fwd1d"] (empty: the
defaults). Printed per line: the median of CUDA-graph replays of one call (wall-clock time on the CPU), whether the
output equals the first variant's bit for bit, and its largest difference to the float32-sum reference.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def parse_variant(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(";")):
        key, _, val = item.partition("=")
        if key not in ("BL", "num_warps", "unmasked") or not val.lstrip("-").isdigit():
            raise SystemExit(f"--variants: unknown setting {item!r} (keys: BL, num_warps, unmasked)")
        out[key] = int(val)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="65536:128,262144:256,1048576:512")
    ap.add_argument("--variants", default="|unmasked=0|BL=128|BL=128;num_warps=8|BL=256;num_warps=8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    variants = [(v, parse_variant(v)) for v in args.variants.split("|")]
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from common import environment, time_ms, wall_time

    from mita.ops.mita.triton import pool as tp

    if args.device == "cuda":
        print(environment(), flush=True)
    base = dict(tp.CONFIG["fwd1d"])
    for point in args.points.split(","):
        n, m = (int(x) for x in point.split(":"))
        g = torch.Generator(device=args.device).manual_seed(n)
        x = torch.randn(1, 2, n, 64, device=args.device, generator=g).to(torch.bfloat16)
        ref = x.reshape(1, 2, m, n // m, 64).sum(3, dtype=torch.float32) / (n // m)
        first = None
        for text, cfg in variants:
            tp.CONFIG["fwd1d"] = {**base, **cfg}
            try:
                out = tp.pool1d_fwd(x, m)
                first = out if first is None else first

                def call(x=x, m=m):
                    return tp.pool1d_fwd(x, m)

                if args.device == "cuda":
                    ms = time_ms(call, "cuda_graph", warmup=3, reps=args.reps)[0]
                else:
                    ms = wall_time(call, 1, 1)[0]
            finally:
                tp.CONFIG["fwd1d"] = dict(base)
            err = (out.float() - ref).abs().max().item()
            print(
                f"N {n} m {m} variant={text}: {ms:.4f} ms; same as the first variant: {torch.equal(out, first)}; "
                f"max |out - float32 mean| {err:.2e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
