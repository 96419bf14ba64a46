"""Layer-level benchmark: every registered attention (mita.registry) against full attention on the fastest dense
SDPA kernel measured in the same run.

Each attention is built with ``create_attention(name, C = H * d, H, ...)`` and timed on ``[B, N, C]`` tokens
(its projections included): forward and forward+backward time, peak memory above the inputs, and the speed-up
over the fastest ``full`` variant (SDPA pinned to flash / cuDNN / efficient) per stage. Points as in bench_op.py:
the DeiT-S layer (B 256, N 197 with a class token on a 14 x 14 grid, H 6, d 64) and long sequences N = 1K, 4K,
... (B 1, H 2, d 64, 1D layout: no prefix token, m = k = sqrt(N / 4)). Before timing, each attention passes a
correctness gate at a small shape (at most 1024 tokens), forward output and input gradient, relative error < 5e-2;
one that fails gets no speed-up:
- dense ``full``: the layer in the benchmark dtype on the device against the same weights in float32 on the CPU
  (SDPA's own kernel choice there: the pinned kernels exist on CUDA only);
- every other attention: the layer in float32 on the device against float32 on the CPU. Attentions that select
  keys (top-k, routing, blocks) are discontinuous: in bf16 their selections differ from float32's on near ties,
  which moves the output by several per cent without any bug, so the bench dtype is not compared with float32;
- layers with a MiTA ``backend`` also run in the benchmark dtype on the device with their default backend (the
  Triton kernels on CUDA) against ``backend="naive"`` on the same bf16 inputs and weights.

    python scripts/bench/bench_layers.py --out results/bench [--max-n 65536] [--attentions mita,agent,...]
    python scripts/bench/bench_layers.py --device cpu --points tiny --dtype float32   # a CPU smoke run

On the CPU times are wall-clock medians of eager calls (no peak memory); on CUDA, CUDA-event medians in each
``--timing`` mode (as bench_op.py: ``eager`` calls launched from Python, what a user gets, the default;
``cuda_graph`` replays of a captured call; ``cuda_graph_queued`` the same queued behind a spin kernel, the GPU's
execution of one call), every mode a row per method with its ``timing`` and speed-ups against the fastest dense
layer of the same point and mode; peak memory of eager calls only (a replay allocates nothing); a layer whose
capture fails gets an ``error`` in that mode. One mode writes ``layer_bench.csv``, several
``layer_bench_<mode>_<mode>.csv``. ``--rounds R`` times every method R times with the methods interleaved and
reports the median of the rounds' medians (spread: their range), so a host whose speed drifts during the run weighs
on every method alike.

    python scripts/bench/bench_layers.py --points deit_s --timing eager,cuda_graph_queued   # the DeiT-S layer
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from bench_op import shapes  # noqa: E402
from common import environment, parse_timings, time_ms, time_stage, wall_time, write_csv  # noqa: E402

from mita.registry import create_attention, list_attentions  # noqa: E402

DENSE_KERNELS = ("flash", "cudnn", "efficient")


def points(max_n: int) -> list[dict]:
    """bench_op.py's points, each with its token grid (a class token before it at the DeiT-S point; None for the
    1D layout of the long points), and ``tiny`` for CPU smoke runs."""
    pts = [dict(name="tiny", B=2, H=2, N=257, d=32, m=16, k=16, layout="official")] + shapes(max_n)
    for p in pts:
        side = math.isqrt(p["N"] - (p["layout"] == "official"))
        p["grid"] = None if p["layout"] == "1d" else (side, side)
    return pts


def build(name: str, opts: dict, p: dict) -> torch.nn.Module:
    """Attention ``name`` for point ``p``: at 1D points without prefix tokens (Agent Attention and MoBA then use
    their 1D layouts: segment-mean agents, contiguous key blocks)."""
    geometry = {"num_prefix_tokens": 0} if p["layout"] == "1d" else {}
    return create_attention(name, p["H"] * p["d"], p["H"], **opts, **geometry)


def layer_options(name: str, p: dict) -> dict:
    """Keyword options of attention ``name`` at point ``p`` (budgets from the point's m and k)."""
    layout = p["layout"]
    return {
        "mita": dict(m=p["m"], k=p["k"], landmark_layout=layout),
        "mita_routing": dict(m=p["m"], k=p["k"], landmark_layout=layout),
        "topk": dict(k=p["k"]),
        "agent": dict(agent_num=p["m"]),
        "agent_minus": dict(agent_num=p["m"]),
    }.get(name, {})


def methods(p: dict, wanted: list[str], device: str) -> dict[str, tuple[str, dict]]:
    """Method label -> (registered name, options): ``full[<kernel>]`` per dense SDPA kernel (``full[auto]`` on the
    CPU), then every wanted attention except ``full``."""
    out = {}
    for kern in DENSE_KERNELS if device == "cuda" else ("auto",):
        out[f"full[{kern}]"] = ("full", dict(sdpa_backend=kern, use_flash_attn=False))
    for name in wanted:
        if name != "full":
            out[name] = (name, layer_options(name, p))
    return out


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _out_and_grad(layer, x: torch.Tensor, g: torch.Tensor, grid) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    o = layer(x, grid=grid)
    (gx,) = torch.autograd.grad(o, x, g.to(o.device, o.dtype))
    return o, gx


def gate(name: str, opts: dict, p: dict, device: str, dtype: torch.dtype) -> tuple[bool, str]:
    """Correctness gate of one attention at point ``p`` (see the module docstring): (ok, message)."""
    torch.manual_seed(0)
    small = dict(p, N=min(p["N"], 1024))
    if small["N"] != p["N"] and p["layout"] != "1d":
        raise ValueError(f"point {p['name']}: a 2D grid cannot be shrunk to the gate's 1024 tokens")
    ref_opts = dict(opts, sdpa_backend="auto") if name == "full" else opts
    ref = build(name, ref_opts, small).float()
    x = torch.randn(2, small["N"], p["H"] * p["d"])
    g = torch.randn(2, small["N"], p["H"] * p["d"])
    o_ref, gx_ref = _out_and_grad(ref, x, g, p["grid"])
    dut = copy.deepcopy(ref)
    if name == "full":
        dut.sdpa_backend = opts.get("sdpa_backend", "auto")
        checks = [("", dut.to(device, dtype), (o_ref, gx_ref))]
    else:
        checks = [("float32 ", dut.to(device), (o_ref, gx_ref))]
    errs = []
    for tag, layer, (o_b, gx_b) in checks:
        o_a, gx_a = _out_and_grad(layer, x.to(device, next(layer.parameters()).dtype), g, p["grid"])
        for what, a, b in (("out", o_a, o_b), ("dx", gx_a, gx_b)):
            err = _rel_err(a, b)
            if not err < 5e-2:
                errs.append(f"{tag}{what} rel err {err:.2e}")
    if hasattr(ref, "backend") and device == "cuda":
        fast, slow = copy.deepcopy(ref).to(device, dtype), copy.deepcopy(ref).to(device, dtype)
        slow.backend = "naive"
        xd = x.to(device, dtype)
        for what, a, b in zip(
            ("out", "dx"), _out_and_grad(fast, xd, g, p["grid"]), _out_and_grad(slow, xd, g, p["grid"])
        ):
            err = _rel_err(a, b)
            if not err < 5e-2:
                errs.append(f"{dtype} {what} vs naive rel err {err:.2e}")
    return not errs, "; ".join(errs) or "ok"


def time_call(fn, device: str, warmup: int, reps: int, timing: str = "eager") -> tuple[float, float]:
    """Median and spread in ms (CUDA events on CUDA in the ``timing`` mode, wall clock of eager calls on the CPU)."""
    if device == "cuda":
        return time_ms(fn, timing, warmup=warmup, reps=reps)
    return wall_time(fn, warmup=warmup, reps=reps)


def stage_fns(layer, x, grid):
    """``(("fwd", fn), ("fwdbwd", fn))`` of one layer on tokens x (the backward with a fixed random gradient)."""
    do = torch.randn_like(x)

    def fwd():
        return layer(x, grid=grid)

    def fwdbwd():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x, grid=grid).backward(do)

    return (("fwd", fwd), ("fwdbwd", fwdbwd))


def measure(
    layer, x, grid, device: str, long_run: bool, reps: int = 10, peak: bool = True, timing: str = "eager"
) -> dict:
    """Forward and forward+backward time (median of ``reps`` calls; 3 for long runs; ``timing``: eager calls or
    CUDA-graph replays) and (CUDA, ``peak``, eager) peak memory of one layer on tokens ``x``. A failed capture
    becomes the row's ``error``."""
    reps, warmup = (3, 1) if long_run else (reps, 2)
    row = {}
    for stage, fn in stage_fns(layer, x, grid):
        with torch.no_grad() if stage == "fwd" else torch.enable_grad():
            if not time_stage(row, stage, timing, lambda fn=fn: time_call(fn, device, warmup, reps, timing)):
                break
            if device == "cuda" and peak and timing == "eager":
                from common import peak_memory_mib

                row[f"{stage}_peak_mib"] = peak_memory_mib(fn)
    return row


def combine_rounds(first: dict, later: list[dict]) -> dict:
    """One row from interleaved rounds: per stage the median of the rounds' medians, and as spread the range of
    those medians (the first round's peak memory is kept)."""
    rounds = [first, *later]
    row = dict(first, rounds=len(rounds))
    for st in ("fwd", "fwdbwd"):
        meds = [r[f"{st}_ms"] for r in rounds]
        row[f"{st}_ms"] = statistics.median(meds)
        row[f"{st}_spread_ms"] = max(meds) - min(meds)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--max-n", type=int, default=1 << 16)
    ap.add_argument("--points", default="deit_s,N4096,N65536", help="comma-separated point names; empty: all")
    ap.add_argument("--attentions", default="", help="comma-separated registered names; empty: all")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=10, help="timed calls per stage below 256K tokens (median)")
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="time every method this many times, the methods interleaved (median of the rounds' medians): host "
        "speed that drifts during a run then weighs on all methods alike",
    )  # fmt: skip
    ap.add_argument(
        "--timing", default="eager",
        help="comma-separated timing modes (CUDA), each point timed in each: eager (calls launched from Python), "
        "cuda_graph (replays of a captured call), cuda_graph_queued (replays queued behind a spin kernel: the GPU's "
        "execution time)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    try:
        timings = parse_timings(args.timing)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.device != "cuda" and timings != ["eager"]:
        raise SystemExit(f"--timing {args.timing}: CUDA-graph timings need a CUDA device (the CPU times eager calls)")
    known = list_attentions()
    wanted = [a for a in args.attentions.split(",") if a] or known
    unknown = [a for a in wanted if a not in known]
    if unknown:
        raise SystemExit(f"unknown attention(s) {unknown}; registered: {', '.join(known)}")
    env = environment()
    os.makedirs(args.out, exist_ok=True)
    out_csv = "layer_bench.csv" if timings == ["eager"] else f"layer_bench_{'_'.join(timings)}.csv"
    rows: list[dict] = []
    sel = [x for x in args.points.split(",") if x]
    for p in points(args.max_n):
        if sel and p["name"] not in sel:
            continue
        res: dict[str, dict[str, dict]] = {t: {} for t in timings}
        gates, kept = {}, {}
        long_run = p["N"] >= 1 << 18
        for label, (name, opts) in methods(p, wanted, args.device).items():
            try:
                gates[label] = gate(name, opts, p, args.device, dtype)
                torch.manual_seed(0)
                layer = build(name, opts, p).to(args.device, dtype)
                x = torch.randn(p["B"], p["N"], p["H"] * p["d"], device=args.device, dtype=dtype, requires_grad=True)
                for timing in timings:
                    res[timing][label] = measure(layer, x, p["grid"], args.device, long_run, args.reps, timing=timing)
                if args.rounds > 1:
                    kept[label] = (layer, x)
                del layer, x
            except (RuntimeError, ValueError) as e:
                err = {"error": str(e).strip().splitlines()[0][:100] if str(e).strip() else type(e).__name__}
                for timing in timings:
                    res[timing].setdefault(label, err)
                gates.setdefault(label, (False, "not run"))
            if args.device == "cuda":
                torch.cuda.empty_cache()
            print(f"{p['name']} {label} gate {gates[label][1]} {[res[t][label] for t in timings]}", flush=True)
        if kept:
            later: dict[tuple[str, str], list[dict]] = {(t, label): [] for t in timings for label in kept}
            for _ in range(args.rounds - 1):
                for label, (layer, x) in kept.items():
                    for timing in timings:
                        if "error" not in res[timing][label]:
                            later[timing, label].append(
                                measure(layer, x, p["grid"], args.device, long_run, args.reps, False, timing)
                            )
            for (timing, label), more in later.items():
                if more:
                    res[timing][label] = combine_rounds(res[timing][label], more)
                    print(f"{p['name']} {timing} {label} over {args.rounds} rounds {res[timing][label]}", flush=True)
            kept.clear()
        for timing in timings:
            rows += point_rows(p, res[timing], gates, timing, env, args)
        write_csv(os.path.join(args.out, out_csv), rows)
    print("point    timing             method            fwd_ms   fwdbwd_ms  speedup_fwd  speedup_fwdbwd  correctness")
    for r in rows:
        print(
            f"{r['point']:8s} {r['timing']:18s} {r['method']:16s} {r.get('fwd_ms', float('nan')):9.3f} "
            f"{r.get('fwdbwd_ms', float('nan')):10.3f} {str(r.get('speedup_fwd', ''))[:8]:>12s} "
            f"{str(r.get('speedup_fwdbwd', ''))[:8]:>14s}  {r.get('error', r['correctness'])}"
        )
    return rows


def point_rows(p: dict, res: dict[str, dict], gates: dict, timing: str, env: dict, args) -> list[dict]:
    """One point's rows in one timing mode: each method's times, its gate's verdict and its speed-ups against the
    fastest dense layer that passed its gate, per stage."""
    dense = {lb: r for lb, r in res.items() if lb.startswith("full[") and gates[lb][0]}
    rows = []
    for label, r in res.items():
        row = dict(point=p["name"], B=p["B"], H=p["H"], N=p["N"], d=p["d"], m=p["m"], k=p["k"], method=label)
        row.update(timing=timing, **r)
        row["correctness"] = "PASS" if gates[label][0] else f"FAIL: {gates[label][1]}"
        for st in ("fwd", "fwdbwd"):
            cands = [lb for lb in dense if f"{st}_ms" in dense[lb]]
            if not cands or f"{st}_ms" not in r:
                continue
            best = min(cands, key=lambda lb: dense[lb][f"{st}_ms"])
            row[f"best_dense_{st}"] = best
            if not label.startswith("full["):
                row[f"speedup_{st}"] = (
                    dense[best][f"{st}_ms"] / r[f"{st}_ms"] if gates[label][0] else "refused: correctness gate"
                )
        row.update(env, device=args.device, dtype=args.dtype)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
