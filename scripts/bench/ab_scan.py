"""A/B of the long-row top-k's settings on the GPU: each value of one ``SCAN_CONFIG`` key side by side in one
process, on i.i.d. and on correlated tokens (AR(1) along N, as bench_op.py --rho).

    python scripts/bench/ab_scan.py [--points 1048576:512,65536:128] [--rho 0.9,0] [--sweep block_top=1,2,4]
        [--sweep fwd.maxnreg=None,128 ...] [--batch 1] [--timing eager,cuda_graph] [--backward]
        [--set "fwd.shared_in_route=1;route.bs=64"] [--variants "|bs=128;num_warps=8"]

For each (N, rho, value) prints the MiTA forward time (CUDA events, median) and the top-k alone, in each timing
mode (eager: host launches included; cuda_graph: replays, GPU time only), the forward output's relative difference
to the first value's, how many landmark rows overflowed their candidate list (those take the refinement passes) and
whether the selection is bitwise the first value's. Results
print as they come, so a run cut short still reports its first points. Examples: ``--sweep block_top=1,2,4`` (start
threshold), ``--sweep num_warps=4,8``, ``--sweep fwd.bm_max=64,128 --backward`` (the fused attention's query tile,
forward and forward + backward), ``--sweep route.bm=64,128`` (the routing kernel's query tile), ``--sweep
lv.maxnreg=None,80`` (the landmark-value kernel's LV_CONFIG), ``--backward --sweep bwd.final_maxnreg=None,128``
(a backward kernel's register cap, BWD_CONFIG). Several ``--sweep`` options run one after the other on
the same inputs of each point (each from the defaults and ``--set``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common import correlated_tokens, environment, time_ms, wall_time  # noqa: E402

from mita.ops.landmarks import pool_landmarks  # noqa: E402
from mita.ops.mita.api import mita_attention  # noqa: E402
from mita.ops.mita.triton import attention_bwd as abwd  # noqa: E402
from mita.ops.mita.triton import attention_fwd as afwd  # noqa: E402
from mita.ops.mita.triton import landmark_values as tlv  # noqa: E402
from mita.ops.mita.triton import pool as tp  # noqa: E402
from mita.ops.mita.triton import routing as trt  # noqa: E402
from mita.ops.mita.triton import topk as ttk  # noqa: E402


def parse_sweep(text: str) -> tuple[dict, str, list]:
    """``key=v1,v2`` -> (config, key, [v1, v2]) with ints as ints and ``None`` as None; the key is a SCAN_CONFIG key,
    ``fwd.<key>`` for a key of the fused attention's FWD_CONFIG, ``route.<key>`` for one of the routing kernel's
    ROUTE_CONFIG, ``lv.<key>`` for one of the landmark-value kernels' LV_CONFIG, ``bwd.<key>`` for one of the
    backward kernels' BWD_CONFIG or ``pool.<key>`` for one of the 1D landmark pooling kernel's settings
    (pool.CONFIG["fwd1d"]; timed by bench_op.py, whose MiTA calls pool the landmarks)."""
    key, _, vals = text.partition("=")
    cfg = ttk.SCAN_CONFIG
    if key.startswith("fwd."):
        cfg, key = afwd.FWD_CONFIG, key[4:]
    elif key.startswith("route."):
        cfg, key = trt.ROUTE_CONFIG, key[6:]
    elif key.startswith("lv."):
        cfg, key = tlv.LV_CONFIG, key[3:]
    elif key.startswith("bwd."):
        cfg, key = abwd.BWD_CONFIG, key[4:]
    elif key.startswith("pool."):
        cfg, key = tp.CONFIG["fwd1d"], key[5:]
    if key not in cfg or not vals:
        raise SystemExit(
            f"--sweep needs key=v1,v2 with key one of {sorted(ttk.SCAN_CONFIG)}, fwd.<key> with one of "
            f"{sorted(afwd.FWD_CONFIG)}, route.<key> with one of {sorted(trt.ROUTE_CONFIG)}, "
            f"lv.<key> with one of {sorted(tlv.LV_CONFIG)}, bwd.<key> with one of "
            f"{sorted(abwd.BWD_CONFIG)} or pool.<key> with one of {sorted(tp.CONFIG['fwd1d'])}: "
            f"{text!r}"
        )

    def conv(x: str):
        if x == "None":
            return None
        try:
            return int(x)
        except ValueError:
            return x

    return cfg, key, [conv(x) for x in vals.split(",")]


def apply_settings(text: str) -> list[tuple[str, object]]:
    """Apply ``--set`` text (';'-separated ``key=value``, keys as :func:`parse_sweep` takes them, prefix included)
    to the kernel configs for the whole run; returns the applied ``(key as given, value)`` pairs."""
    applied = []
    for item in filter(None, text.split(";")):
        cfg, key, vals = parse_sweep(item)
        if len(vals) != 1:
            raise SystemExit(f"--set takes one value per key: {item!r}")
        cfg[key] = vals[0]
        applied.append((item.partition("=")[0], vals[0]))
    return applied


class Variants:
    """A sweep over whole settings: ``cfg["variant"] = text`` applies ``--set`` text (after putting back what the
    previous value set), so ``run_sweep`` can time ``"" | "bs=128;num_warps=8"`` side by side like one key."""

    def __init__(self):
        self.text = ""
        self.saved: list[tuple[dict, str, object]] = []

    def __getitem__(self, key):
        return self.text

    def __setitem__(self, key, text):
        for cfg, name, old in reversed(self.saved):
            cfg[name] = old
        self.saved = []
        for item in filter(None, (text or "").split(";")):
            cfg, name, vals = parse_sweep(item)
            if len(vals) != 1:
                raise SystemExit(f"--variants takes one value per key: {item!r}")
            self.saved.append((cfg, name, cfg[name]))
            cfg[name] = vals[0]
        self.text = text or ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="1048576:512,65536:128", help="N:m (m = k) pairs, H 2, d 64")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rho", default="0.9,0")
    ap.add_argument("--sweep", action="append", help="key=v1,v2 (repeatable; default block_top=1,2,4)")
    ap.add_argument("--timing", default="eager", help="comma-separated: eager, cuda_graph")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (wall-clock times)")
    ap.add_argument("--backward", action="store_true", help="also time forward + backward")
    ap.add_argument("--set", default="", help="fixed settings for the whole run, ';'-separated key=value (same keys)")
    ap.add_argument(
        "--variants",
        help="'|'-separated settings ('';'-separated key=value, empty: the defaults), timed side by side as one sweep",
    )
    args = ap.parse_args()
    fixed = [f"{name.rpartition('.')[2]}={val}" for name, val in apply_settings(args.set)]
    sweeps = [
        (*parse_sweep(text), text.partition("=")[0])
        for text in (args.sweep or ([] if args.variants else ["block_top=1,2,4"]))
    ]
    if args.variants:
        vs = args.variants.split("|")
        check = Variants()
        for text in vs:
            check["variant"] = text  # parse each up front (then undo it): a typo fails before any timing
        check["variant"] = ""
        sweeps.append((Variants(), "variant", vs, "variant"))
    timings = args.timing.split(",") if args.device == "cuda" else ["wall"]
    dev, B = args.device, args.batch
    print(environment(), flush=True)
    if fixed:
        print("fixed settings: " + ", ".join(fixed), flush=True)
    for point in args.points.split(","):
        n, m = (int(x) for x in point.split(":"))
        for rho in (float(x) for x in args.rho.split(",")):
            g = torch.Generator(device=dev).manual_seed(n)
            q, k, v = (correlated_tokens((B, 2, n, 64), rho, g, device=dev) for _ in range(3))
            r = pool_landmarks(q, m, layout="1d")
            rf, kf = r.reshape(B * 2, m, 64), k.reshape(B * 2, n, 64)

            def topk(rf=rf, kf=kf, m=m):
                return ttk.exact_topk(rf, kf, None, m)

            def fwd(q=q, k=k, v=v, r=r, m=m):
                return mita_attention(q, k, v, r, m, backend="triton")

            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            do = torch.randn_like(q)

            def fwd_bwd(m=m, ins=(qg, kg, vg), do=do):
                for t in ins:
                    t.grad = None
                mita_attention(*ins, pool_landmarks(ins[0], m, layout="1d"), m, backend="triton").backward(do)

            for cfg, key, values, label in sweeps:
                run_sweep(cfg, key, values, label, args, timings, n, B, m, rho, rf, kf, topk, fwd, fwd_bwd)
            del q, k, v, r, qg, kg, vg, do
            if dev == "cuda":
                torch.cuda.empty_cache()


def run_sweep(cfg, key, values, label, args, timings, n, B, m, rho, rf, kf, topk, fwd, fwd_bwd) -> None:
    """Time each value of one setting at one point (the setting goes back to its value before the sweep)."""
    default = cfg[key]
    first = first_out = None
    try:
        with torch.no_grad():
            for val in values:
                cfg[key] = val
                st: dict = {}
                idx = ttk.exact_topk(rf, kf, None, m, stats=st)
                first = idx.clone() if first is None else first
                out = fwd().float()
                first_out = out if first_out is None else first_out
                diff = ((out - first_out).norm() / first_out.norm()).item()
                parts = []
                for t in timings:
                    if t == "wall":
                        topk_ms, fwd_ms = wall_time(topk, 1, args.reps)[0], wall_time(fwd, 1, args.reps)[0]
                    else:
                        topk_ms = time_ms(topk, t, warmup=1, reps=args.reps, max_s=5.0)[0]
                        fwd_ms = time_ms(fwd, t, warmup=1, reps=args.reps, max_s=5.0)[0]
                    parts.append(f"{t}: fwd {fwd_ms:.3f} ms, top-k {topk_ms:.3f} ms")
                    if args.backward:
                        with torch.enable_grad():
                            if t == "wall":
                                fb_ms = wall_time(fwd_bwd, 1, args.reps)[0]
                            else:
                                fb_ms = time_ms(fwd_bwd, t, warmup=1, reps=args.reps, max_s=5.0)[0]
                        parts[-1] += f", fwd+bwd {fb_ms:.3f} ms"
                print(
                    f"N {n} B {B} m=k {m} rho {rho} {label}={val}: {'; '.join(parts)}; output against the first "
                    f"value: rel. diff {diff:.1e}; overflow rows "
                    f"{int(st['overflow_rows'])}/{B * 2 * m}; same selection as the first value: "
                    f"{torch.equal(idx, first)}",
                    flush=True,
                )
    finally:
        cfg[key] = default


if __name__ == "__main__":
    main()
