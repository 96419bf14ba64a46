"""Side-by-side sweeps of the MiTA kernels' settings: each value of a setting in turn, in one process, on the same
inputs, i.i.d. and correlated tokens (AR(1) along N, as bench_op.py --rho).

    python scripts/bench/sweep.py [--points 1048576:512,65536:128] [--rho 0.9,0] [--sweep block_top=1,2,4]
        [--sweep fwd.maxnreg=None,128 ...] [--batch 1] [--heads 2] [--timing eager,cuda_graph] [--backward]
        [--set "fwd.bm_max=32;route.bs=64"] [--variants "|bs=128;num_warps=8"]
    python scripts/bench/sweep.py --model [--points 65536:128] [--rho 0,0.9,0.99] [--sweep block_top=1,2,4]
    python scripts/bench/sweep.py --model --qk saved.pt    # a dict with "q" and "k": [N, d] or [B, H, N, d]

On the GPU (the default), for each (N, rho, value) prints the MiTA forward time (CUDA events, median) and the
top-k alone, in each timing mode (eager: host launches included; cuda_graph: replays, GPU time only), the forward
output's relative difference to the first value's, how many landmark rows overflowed their candidate list (those
take the refinement passes) and whether the selection is bitwise the first value's. Results print as they come, so
a run cut short still reports its first points. ``--device cpu`` is a smoke run under TRITON_INTERPRET=1.

Settings: a ``SCAN_CONFIG`` key of the long-row top-k (``--sweep block_top=1,2,4``: the start threshold;
``num_warps=4,8``), ``fwd.<key>`` of the fused attention (``--sweep fwd.bm_max=64,128 --backward``: its query
tile, forward and forward + backward), ``route.<key>`` of the routing kernel (``route.bm=64,128``), ``lv.<key>`` of
the landmark-value kernels (``lv.num_warps=4,8``), ``pool.<key>`` of the 1D landmark pooling kernel and
``small.<kernel>.<key>`` of the short-path kernels (ts.CONFIG; e.g. ``--points 197:25 --batch 256 --heads 6
--backward --sweep small.attn.BM=32,64``). Several ``--sweep`` options run one after the other on the same inputs
of each point (each from the defaults and ``--set``); ``--variants`` times whole settings (several keys each) side
by side.

``--model``: how often the long-row exact top-k leaves its fast path, from a PyTorch model of its start threshold
on the CPU (no kernels run). The Triton top-k (rows longer than 512 keys) takes, per landmark row, the kk-th
largest maximum of 64-key blocks (of the ``block_top`` largest scores of each block; of groups of f blocks when a
row has more than 8192 blocks), rounded down as its early-stopped bisection leaves it (``start_steps``), as a start
threshold, and emits every key at or above it into a candidate list of ``cap = next_pow2(max(2 k, 64))`` slots. A
row with more such keys than cap overflows into the refinement passes. The threshold is tight when a landmark's
top keys are spread over many blocks (independent tokens) and loose when they cluster in a few blocks
(neighbouring tokens alike). The model follows SCAN_CONFIG's ``block_top``, ``start_steps`` and ``start_narrow``,
which are the settings it can sweep; its tokens are AR(1) sequences (d ``--d``) through random q / k projections,
or q / k tensors saved from a real model (``--qk``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common import correlated_tokens, environment, time_ms, wall_time  # noqa: E402

from mita.ops.landmarks import pool_landmarks  # noqa: E402
from mita.ops.mita.api import mita_attention  # noqa: E402
from mita.ops.mita.triton import attention_fwd as afwd  # noqa: E402
from mita.ops.mita.triton import landmark_values as tlv  # noqa: E402
from mita.ops.mita.triton import pool as tp  # noqa: E402
from mita.ops.mita.triton import routing as trt  # noqa: E402
from mita.ops.mita.triton import short as ts  # noqa: E402
from mita.ops.mita.triton import topk as ttk  # noqa: E402
from mita.ops.mita.triton.plan import order_key  # noqa: E402


def parse_sweep(text: str) -> tuple[dict, str, list]:
    """``key=v1,v2`` -> (config, key, [v1, v2]) with ints as ints and ``None`` as None; the key is a SCAN_CONFIG key,
    ``fwd.<key>`` for a key of the fused attention's FWD_CONFIG, ``route.<key>`` for one of the routing kernel's
    ROUTE_CONFIG, ``lv.<key>`` for one of the landmark-value kernels' LV_CONFIG, ``pool.<key>`` for one of the 1D
    landmark pooling kernel's settings
    (tp.CONFIG["fwd1d"]; timed by bench_op.py, whose MiTA calls pool the landmarks) or
    ``small.<kernel>.<key>`` for one of a short-path kernel's settings (ts.CONFIG[kernel])."""
    key, _, vals = text.partition("=")
    cfg = ttk.SCAN_CONFIG
    if key.startswith("fwd."):
        cfg, key = afwd.FWD_CONFIG, key[4:]
    elif key.startswith("route."):
        cfg, key = trt.ROUTE_CONFIG, key[6:]
    elif key.startswith("lv."):
        cfg, key = tlv.LV_CONFIG, key[3:]
    elif key.startswith("pool."):
        cfg, key = tp.CONFIG["fwd1d"], key[5:]
    elif key.startswith("small."):
        kernel, _, key = key[6:].partition(".")
        cfg = ts.CONFIG.get(kernel, {})
    if key not in cfg or not vals:
        raise SystemExit(
            f"--sweep needs key=v1,v2 with key one of {sorted(ttk.SCAN_CONFIG)}, fwd.<key> with one of "
            f"{sorted(afwd.FWD_CONFIG)}, route.<key> with one of {sorted(trt.ROUTE_CONFIG)}, "
            f"lv.<key> with one of {sorted(tlv.LV_CONFIG)}, pool.<key> with one of {sorted(tp.CONFIG['fwd1d'])} or "
            f"small.<kernel>.<key> with kernel.key one of "
            f"{[f'{n}.{k}' for n, c in ts.CONFIG.items() for k in c]}: {text!r}"
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


# ---- --model: the long-row top-k's start threshold on the CPU -------------------------------------------------------


def start_key(entries: torch.Tensor, kk: int, steps: int = 32, narrow: bool = True) -> torch.Tensor:
    """``[m]`` int64: the start threshold key of each row of ``entries`` ``[m, E]`` (-inf: not an entry), by the
    select kernel's bisection: over [min, max + 1) of the row's keys when at least kk >= 1 entries are valid and
    ``narrow`` (``_kth_largest_key_narrow``), else over [-2^31, 2^31), halved until at most 2^(32 - steps) wide
    (32 steps: the kk-th largest key)."""
    key, valid = order_key(entries), entries > float("-inf")
    unit = 1 << (32 - steps)
    ok_rows = (valid.sum(-1) >= kk) & (kk >= 1) & narrow
    big = torch.full_like(key, 2**31)
    t = torch.where(ok_rows, torch.where(valid, key, big).amin(-1), torch.full_like(key[:, 0], -(2**31)))
    hi = torch.where(ok_rows, torch.where(valid, key, -big).amax(-1) + 1, torch.full_like(key[:, 0], 2**31))
    while True:
        act = hi - t > unit
        if not act.any():
            return t
        mid = t + (hi - t) // 2
        ok = ((key >= mid[:, None]) & valid).sum(-1) >= kk
        t = torch.where(act & ok, mid, t)
        hi = torch.where(act & ~ok, mid, hi)


def start_overflow(
    r: torch.Tensor,
    k: torch.Tensor,
    kk: int,
    bn: int = 64,
    max_groups: int = 8192,
    block_top: int = 1,
    steps: int = 32,
    narrow: bool = True,
) -> dict:
    """Share of rows of ``r @ k.T`` whose keys at or above the start threshold exceed the candidate list.

    Args:
        r: ``[m, d]`` landmarks; k: ``[N, d]`` keys (float32 scores as the kernels compute them).
        kk: keys per landmark.
        block_top: scores kept per key block (``SCAN_CONFIG["block_top"]``): the start is the kk-th largest of
            them (of their group maxima when a row has more than ``max_groups`` entries).
        steps, narrow: the start threshold's bisection (``SCAN_CONFIG["start_steps"]``, ``["start_narrow"]``), which
            :func:`start_key` repeats: below 32 steps the start's order key is rounded down, as the kernel's
            early-stopped bisection leaves it.

    Returns:
        ``{"overflow": share of rows, "median_count": median keys >= start, "cap": list length, "counts": [m]}``.
    """
    s = r.float() @ k.float().T
    m, N = s.shape
    nb = math.ceil(N / bn)
    blocks = torch.nn.functional.pad(s, (0, nb * bn - N), value=float("-inf")).view(m, nb, bn)
    bmax = blocks.topk(block_top, dim=-1).values.reshape(m, nb * block_top)  # per block, descending
    nb = nb * block_top
    f = 1 << max(0, math.ceil(nb / max_groups) - 1).bit_length()
    ng = math.ceil(nb / f)
    gmax = torch.nn.functional.pad(bmax, (0, ng * f - nb), value=float("-inf")).view(m, ng, f).amax(-1)
    t = start_key(gmax, kk, steps, narrow)
    cnt = (order_key(s) >= t[:, None]).sum(-1)
    cap = 1 << (max(2 * kk, kk, 64) - 1).bit_length()
    return {
        "overflow": (cnt > cap).float().mean().item(),
        "median_count": cnt.float().median().item(),
        "cap": cap,
        "counts": cnt,
    }


def ar1_tokens(n: int, d: int, rho: float, gen: torch.Generator) -> torch.Tensor:
    """``[n, d]`` tokens, each dimension an AR(1) sequence with lag-1 correlation rho (rho = 0: independent)."""
    e = torch.randn(n, d, generator=gen)
    if rho == 0:
        return e
    x = torch.empty(n, d)
    x[0] = e[0]
    c = math.sqrt(1 - rho * rho)
    for t in range(1, n):
        x[t] = rho * x[t - 1] + c * e[t]
    return x


MODEL_KEYS = ("block_top", "start_steps", "start_narrow")


def model_overflow(r: torch.Tensor, k: torch.Tensor, kk: int) -> dict:
    """:func:`start_overflow` with SCAN_CONFIG's current start settings (without the per-row counts); block_top
    None is the kernel's choice (2 while two entries per key block fit the start's registers, else 1)."""
    scan = ttk.SCAN_CONFIG
    top = scan["block_top"]
    if top is None:
        top = 2 if math.ceil(k.shape[0] / scan["bn"]) * 2 <= ttk._START_ENTRIES else 1
    res = start_overflow(
        r, k, kk, bn=scan["bn"], block_top=int(top), steps=scan["start_steps"], narrow=bool(scan["start_narrow"])
    )
    res.pop("counts")
    return res


def run_model(args, sweeps) -> None:
    """--model: the modelled share of overflowing rows for each value of each sweep (SCAN_CONFIG start keys)."""
    for cfg, key, _values, label in sweeps:
        if cfg is not ttk.SCAN_CONFIG or key not in MODEL_KEYS:
            raise SystemExit(f"--model sweeps only {', '.join(MODEL_KEYS)} (SCAN_CONFIG), not {label!r}")
    cases = []
    if args.qk:
        saved = torch.load(args.qk, map_location="cpu")
        q, k = saved["q"], saved["k"]
        q, k = (t.reshape(-1, t.shape[-2], t.shape[-1]) if t.dim() > 2 else t[None] for t in (q, k))
        n = q.shape[1]
        mk = max(1, int(math.sqrt(n / 4)))
        for i in range(q.shape[0]):
            r = q[i][: n - n % mk].reshape(mk, -1, q.shape[-1]).mean(1)
            cases.append((f"head {i}: N {n}, m = k = {mk}", r, k[i], mk))
    else:
        gen = torch.Generator().manual_seed(0)
        d = args.d
        w_q, w_k = (torch.randn(d, d, generator=gen) / math.sqrt(d) for _ in range(2))
        for point in args.points.split(","):
            n, mk = (int(x) for x in point.split(":"))
            for rho in (float(x) for x in args.rho.split(",")):
                x = ar1_tokens(n, d, rho, gen)
                q, k = x @ w_q, x @ w_k
                r = q[: n - n % mk].view(mk, -1, d).mean(1)  # 1-D landmarks: means of consecutive query segments
                cases.append((f"N {n}, m = k = {mk}, AR(1) rho {rho}", r, k, mk))
    for name, r, k, mk in cases:
        for cfg, key, values, label in sweeps:
            default = cfg[key]
            try:
                for val in values:
                    cfg[key] = val
                    print(f"{name}, {label}={val}: {model_overflow(r, k, mk)}", flush=True)
            finally:
                cfg[key] = default


# ---- on the GPU --------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="1048576:512,65536:128", help="N:m (m = k) pairs, H 2, d 64")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=2)
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
    ap.add_argument("--model", action="store_true", help="the CPU model of the top-k's start threshold (no kernels)")
    ap.add_argument("--d", type=int, default=64, help="with --model: the tokens' width")
    ap.add_argument("--qk", default="", help="with --model: a torch.save'd dict with q and k ([N, d] or [B, H, N, d])")
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
    if args.model:
        if args.variants:
            raise SystemExit("--model takes --sweep, not --variants")
        run_model(args, sweeps)
        return
    timings = args.timing.split(",") if args.device == "cuda" else ["wall"]
    dev, B, H = args.device, args.batch, args.heads
    print(environment(), flush=True)
    if fixed:
        print("fixed settings: " + ", ".join(fixed), flush=True)
    for point in args.points.split(","):
        n, m = (int(x) for x in point.split(":"))
        for rho in (float(x) for x in args.rho.split(",")):
            g = torch.Generator(device=dev).manual_seed(n)
            q, k, v = (correlated_tokens((B, H, n, 64), rho, g, device=dev) for _ in range(3))
            r = pool_landmarks(q, m, layout="1d")
            rf, kf = r.reshape(B * H, m, 64), k.reshape(B * H, n, 64)

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
                run_sweep(cfg, key, values, label, args, timings, n, B, H, m, rho, rf, kf, topk, fwd, fwd_bwd)
            del q, k, v, r, qg, kg, vg, do
            if dev == "cuda":
                torch.cuda.empty_cache()


def run_sweep(cfg, key, values, label, args, timings, n, B, H, m, rho, rf, kf, topk, fwd, fwd_bwd) -> None:
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
                    if t == "wall":  # (the CPU smoke run: nothing to compile, no warm-up)
                        topk_ms, fwd_ms = wall_time(topk, 0, args.reps)[0], wall_time(fwd, 0, args.reps)[0]
                    else:
                        topk_ms = time_ms(topk, t, warmup=1, reps=args.reps, max_s=5.0)[0]
                        fwd_ms = time_ms(fwd, t, warmup=1, reps=args.reps, max_s=5.0)[0]
                    parts.append(f"{t}: fwd {fwd_ms:.3f} ms, top-k {topk_ms:.3f} ms")
                    if args.backward:
                        with torch.enable_grad():
                            if t == "wall":
                                fb_ms = wall_time(fwd_bwd, 0, args.reps)[0]
                            else:
                                fb_ms = time_ms(fwd_bwd, t, warmup=1, reps=args.reps, max_s=5.0)[0]
                        parts[-1] += f", fwd+bwd {fb_ms:.3f} ms"
                print(
                    f"N {n} B {B} m=k {m} rho {rho} {label}={val}: {'; '.join(parts)}; output against the first "
                    f"value: rel. diff {diff:.1e}; overflow rows "
                    f"{int(st.get('overflow_rows', 0))}/{B * H * m}; same selection as the first value: "
                    f"{torch.equal(idx, first)}",
                    flush=True,
                )
    finally:
        cfg[key] = default


if __name__ == "__main__":
    main()
