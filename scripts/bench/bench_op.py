"""Op-level benchmark: MiTA backends against the fastest dense SDPA backend measured in the same run.

For each N: forward and forward+backward time (median of CUDA-event timings), TFLOP/s (dense: 4 N^2 d per head
forward; MiTA: 2 N d (4m + 2(m + S k)) per head forward, its routing included; backward counted as 2.5x the
forward for both) and peak memory above the inputs. MiTA timings include landmark pooling. A backend whose
correctness gate (naive_mita, forward and backward) fails gets no speed-up.

``--timing`` picks how calls are timed, several modes in one process (comma-separated): ``eager`` (the default:
each call launches its kernels from Python, what a user gets); ``cuda_graph`` captures each timed callable
(forward; forward+backward) of every method, dense SDPA included, in a CUDA graph after a warm-up on a side stream
and times graph replays, which removes the Python launch overhead (each replay is still launched onto an idle GPU,
so the graph's own launch latency is in the time); ``cuda_graph_queued`` queues each timed replay behind a spin
kernel, so the time is the GPU's execution of one call. The CSV's ``timing`` column says which, and a method that
cannot be captured gets ``capture failed: <reason>``.

Point sets (``--point-set``): ``long`` (default) is the DeiT-S layer shape and long rows (B 1, H 2, d 64, m = k =
sqrt(N / 4), N 1024 to ``--max-n``); ``training`` is where the paper trains: the DeiT-S layer, the Segmenter
512-crop layer, B 8 at N 4096, N 16K and 64K, and the Long Range Arena shapes read from configs/experiment/lra
(each task's MiTA row: batch, heads, full length, head dim, m, k; Retrieval's two documents double the batch).

    python scripts/bench/bench_op.py --out results/bench [--max-n 1048576] [--timing eager,cuda_graph_queued]
    python scripts/bench/bench_op.py --point-set training --timing eager,cuda_graph_queued --out OUT
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common import (  # noqa: E402
    correlated_tokens,
    environment,
    mita_correct,
    parse_timings,
    peak_memory_mib,
    time_ms,
    time_stage,
    write_csv,
)

from mita.ops.landmarks import pool_landmarks  # noqa: E402
from mita.ops.mita.api import list_backends, mita_attention  # noqa: E402

# Where the inputs live (tests of the loop replace the timing and run it on the CPU).
DEVICE = "cuda"

DENSE = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


LRA_TASKS = ("listops", "text", "retrieval", "image", "pathfinder")
DEIT_S = dict(name="deit_s", B=256, H=6, N=197, d=64, m=25, k=25, layout="official", grid=(14, 14))
# The training set's fixed points (the LRA shapes are read from the experiment files, lra_points).
TRAINING_POINTS = [
    DEIT_S,
    dict(name="seg_1025", B=64, H=6, N=1025, d=64, m=49, k=49, layout="official", grid=(32, 32)),
    dict(name="B8_N4096", B=8, H=2, N=4096, d=64, m=32, k=32, layout="1d"),
    dict(name="N16384", B=1, H=2, N=16384, d=64, m=64, k=64, layout="1d"),
    dict(name="N65536", B=1, H=2, N=65536, d=64, m=128, k=128, layout="1d"),
]


@functools.lru_cache(maxsize=1)
def lra_time_module():
    """scripts/lra_time.py as a module (it sits outside this folder): its config composition and training step."""
    spec = importlib.util.spec_from_file_location(
        "lra_time", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lra_time.py")
    )
    lra_time = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lra_time)
    return lra_time


@functools.lru_cache(maxsize=1)
def lra_points() -> tuple[dict, ...]:
    """One point per LRA task, from its MiTA experiment file: the batch (doubled for two-document tasks), heads,
    full sequence length, head dim, m and k that a training step of that row runs (padding compaction can make the
    real rows shorter: Pathfinder keeps about a third of its pixels). Composed once per process (profiler.py asks
    for each LRA point by name)."""
    compose = lra_time_module().compose

    pts = []
    for task in LRA_TASKS:
        cfg = compose(f"lra/{task}-mita", [])
        att = cfg.model.attention
        B = int(cfg.data.batch_size) * (2 if cfg.model.dual else 1)
        H, N, d = int(cfg.model.num_heads), int(cfg.data.max_length), int(cfg.model.head_dim)
        pts.append(dict(name=f"lra_{task}", B=B, H=H, N=N, d=d, m=int(att.m), k=int(att.k), layout="1d"))
    return tuple(pts)


def shapes(max_n: int, point_set: str = "long") -> list[dict]:
    """Benchmark points of ``point_set`` (``long`` or ``training``, see the module docstring); ``max_n`` caps N."""
    if point_set == "training":
        return [p for p in [*TRAINING_POINTS, *lra_points()] if p["N"] <= max_n]
    if point_set != "long":
        raise ValueError(f"point_set must be 'long' or 'training', got {point_set!r}")
    pts = [DEIT_S]
    n = 1024
    while n <= max_n:
        mk = int(math.sqrt(n / 4))
        pts.append(dict(name=f"N{n}", B=1, H=2, N=n, d=64, m=mk, k=mk, layout="1d"))
        n *= 4
    return pts


def csv_name(point_set: str, timings: list[str], rho: float = 0.0, block_top: int | None = None) -> str:
    """The CSV a run writes: op_bench[_training][_<timing>...][_rho<rho>][_top<t>].csv (eager alone adds nothing)."""
    name = "op_bench" + ("_training" if point_set == "training" else "")
    if timings != ["eager"]:
        name += "_" + "_".join(timings)
    if rho:
        name += f"_rho{rho:g}"
    if block_top and block_top > 1:
        name += f"_top{block_top}"
    return name + ".csv"


def dense_fn(q, k, v, backend):
    def f():
        with sdpa_kernel([DENSE[backend]]):
            return F.scaled_dot_product_attention(q, k, v)

    return f


def point_landmarks(q: torch.Tensor, p: dict) -> torch.Tensor:
    """The landmarks of a point's MiTA call, pooled from q as its layer pools them (bench_op.py and profiler.py)."""
    if p["layout"] == "official":
        return pool_landmarks(q, p["m"], layout="official", grid=p["grid"], num_prefix_tokens=1)
    return pool_landmarks(q, p["m"], layout="1d")


def mita_fn(q, k, v, p, backend):
    def f():
        return mita_attention(q, k, v, point_landmarks(q, p), p["k"], backend=backend)

    return f


def fwd_bwd(f, do, ins):
    def g():
        for t in ins:
            t.grad = None
        f().backward(do)

    return g


def measure(f, ins, do, long_run: bool, timing: str = "eager", reps_long: int = 3) -> dict:
    """Forward and forward+backward time (``timing``: eager calls or CUDA-graph replays) and peak memory (always
    of an eager call: a replay allocates nothing). A failed capture becomes the row's ``error``."""
    row = {}
    reps, warmup = (reps_long, 1) if long_run else (20, 3)
    for stage, fn in (("fwd", f), ("fwdbwd", fwd_bwd(f, do, ins))):
        with torch.no_grad() if stage == "fwd" else contextlib.nullcontext():
            if not time_stage(row, stage, timing, lambda fn=fn: time_ms(fn, timing, warmup=warmup, reps=reps)):
                break
        with torch.no_grad() if stage == "fwd" else contextlib.nullcontext():
            row[f"{stage}_peak_mib"] = peak_memory_mib(fn)
    return row


def point_rows(
    p: dict, res: dict[str, dict], gate: dict[str, tuple[bool, str]], timing: str, env: dict, rho: float = 0.0
) -> list[dict]:
    """CSV rows of one point: each method's measurement, TFLOP/s, and for MiTA the speed-ups over the fastest dense
    backend of the same run and timing, per stage (a failed capture may leave a method with only a forward)."""
    B, H, N, d = p["B"], p["H"], p["N"], p["d"]
    dense_flops = 4 * N * N * d * B * H
    mita_flops = 2 * N * d * (4 * p["m"] + 2 * (p["m"] + p["k"])) * B * H
    dense = {n: r for n, r in res.items() if n.startswith("dense_")}
    best = {
        st: min((n for n in dense if f"{st}_ms" in dense[n]), key=lambda n: dense[n][f"{st}_ms"], default=None)
        for st in ("fwd", "fwdbwd")
    }
    rows = []
    for method, r in res.items():
        row = dict(point=p["name"], B=B, H=H, N=N, d=d, m=p["m"], k=p["k"], method=method, timing=timing, **r)
        row["rho"] = rho
        is_mita = method.startswith("mita_")
        fl = mita_flops if is_mita else dense_flops
        if "fwd_ms" in r:
            row["fwd_tflops"] = fl / (r["fwd_ms"] * 1e-3) / 1e12
        if "fwdbwd_ms" in r:
            row["fwdbwd_tflops"] = 3.5 * fl / (r["fwdbwd_ms"] * 1e-3) / 1e12
        row["best_dense_fwd"] = best["fwd"]
        row["best_dense_fwdbwd"] = best["fwdbwd"]
        if is_mita:
            for st, key in (("fwd", "speedup_fwd"), ("fwdbwd", "speedup_fwdbwd")):
                if f"{st}_ms" not in r or best[st] is None:
                    continue
                if not gate[method[5:]][0]:
                    row[key] = "refused: correctness gate failed"
                    continue
                row[key] = dense[best[st]][f"{st}_ms"] / r[f"{st}_ms"]
                if st == "fwdbwd":
                    row["mem_ratio_fwdbwd"] = r["fwdbwd_peak_mib"] / dense[best[st]]["fwdbwd_peak_mib"]
        row["correctness"] = ("PASS" if gate[method[5:]][0] else "FAIL") if is_mita else ""
        row.update(env)
        rows.append(row)
    return rows


def time_mita(res: dict, backends: list, q, k, v, p: dict, ins, do, timing: str) -> None:
    """Time each MiTA backend at one point into ``res`` (``mita_<backend>``: a measurement or an error)."""
    for b in backends:
        try:
            # MiTA's calls are short at every N (at most ~16 ms at 1M): 3 warm-ups and 20 timed runs, not the few
            # long-N runs of dense attention (before run 18, 1 and 3 at N >= 256K).
            res[f"mita_{b}"] = measure(mita_fn(q, k, v, p, b), ins, do, False, timing)
        except (RuntimeError, ValueError) as e:
            res[f"mita_{b}"] = {"error": str(e).splitlines()[0][:80]}
            torch.cuda.empty_cache()
        print(f"{p['name']} {timing} mita_{b} {res[f'mita_{b}']}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--max-n", type=int, default=1 << 20)
    ap.add_argument("--backends", default="triton,torch")
    ap.add_argument(
        "--dense-long",
        default="flash,cudnn",
        help="dense SDPA backends timed at N >= 256K (each point costs seconds there)",
    )
    ap.add_argument("--points", default="", help="comma-separated point names (deit_s, N65536, ...); empty: all")
    ap.add_argument("--dense-reps-long", type=int, default=3, help="timed runs of a dense backend at N >= 256K")
    ap.add_argument(
        "--timing",
        default="eager",
        help="comma-separated timing modes, each point timed in each: eager (calls launched from Python), cuda_graph "
        "(replays of a captured call, launched onto an idle GPU), cuda_graph_queued (replays queued behind a spin "
        "kernel: the GPU's execution of one call)",
    )
    ap.add_argument("--point-set", choices=("long", "training"), default="long", help="benchmark points (docstring)")
    ap.add_argument(
        "--rho",
        type=float,
        default=0.0,
        help="token correlation of q, k, v (AR(1) along N; 0: i.i.d.). Correlated tokens make the long-row top-k "
        "take its refinement passes (sweep.py --model models it); writes op_bench_rho<rho>.csv",
    )
    ap.add_argument(
        "--block-top",
        type=int,
        default=None,
        help="long-row top-k start from the t largest scores of each key block (SCAN_CONFIG block_top; 1: the "
        "maximum); default: the library's (topk.py _block_top); writes op_bench..._top<t>.csv when above 1",
    )
    ap.add_argument(
        "--set",
        default="",
        help="kernel settings for the whole run, ';'-separated key=value as sweep.py --set takes them (e.g. "
        "'block_top=1;fwd.maxnreg=0'); recorded in each row's settings column",
    )
    ap.add_argument(
        "--order",
        choices=("dense-first", "mita-first"),
        default="dense-first",
        help="at each point, time dense attention before MiTA (dense-first, the default) or after it; recorded in each "
        "row's order column",
    )
    args = ap.parse_args(argv)
    try:
        timings = parse_timings(args.timing)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    from sweep import apply_settings

    settings = [f"{name}={val}" for name, val in apply_settings(args.set)]
    if settings:
        print("settings: " + ", ".join(settings), flush=True)
    if args.block_top is not None:
        from mita.ops.mita.triton import topk as ttk

        ttk.SCAN_CONFIG["block_top"] = args.block_top
        print(f"top-k start: {args.block_top} scores per key block", flush=True)
    wanted = [x for x in args.points.split(",") if x]
    points = shapes(args.max_n, args.point_set)
    unknown = sorted(set(wanted) - {p["name"] for p in points})
    if unknown:
        raise SystemExit(
            f"--points: {unknown} not in point set {args.point_set!r} (up to --max-n {args.max_n}): "
            f"{[p['name'] for p in points]}"
        )
    out_csv = csv_name(args.point_set, timings, args.rho, args.block_top)
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    if settings:
        env["settings"] = ";".join(settings)
    env["order"] = args.order
    backends = [b for b in args.backends.split(",") if b in list_backends()]
    gate = {b: mita_correct(b) for b in backends}
    for b, (ok, msg) in gate.items():
        print(f"correctness gate {b}: {'PASS' if ok else 'FAIL'} ({msg})", flush=True)
    rows = []
    for p in points:
        if wanted and p["name"] not in wanted:
            continue
        B, H, N, d = p["B"], p["H"], p["N"], p["d"]
        g = torch.Generator(device=DEVICE).manual_seed(N)
        q, k, v = (correlated_tokens((B, H, N, d), args.rho, g, device=DEVICE) for _ in range(3))
        do = torch.randn(B, H, N, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
        ins = [t.requires_grad_() for t in (q, k, v)]
        for timing in timings:
            res = time_point(p, timing, backends, q, k, v, ins, do, args)
            rows += point_rows(p, res, gate, timing, env, args.rho)
            write_csv(os.path.join(args.out, out_csv), rows)
        del q, k, v, do, ins
        torch.cuda.empty_cache()
    head = "point      timing             method          fwd_ms   fwdbwd_ms  speedup_fwd  speedup_fwdbwd"
    print(f"\n{head}  peak_fb_MiB  error")
    for r in rows:
        print(
            f"{r['point']:10s} {r['timing']:18s} {r['method']:15s} {r.get('fwd_ms', float('nan')):9.3f} "
            f"{r.get('fwdbwd_ms', float('nan')):10.3f} {str(r.get('speedup_fwd', ''))[:8]:>12s} "
            f"{str(r.get('speedup_fwdbwd', ''))[:8]:>14s} {r.get('fwdbwd_peak_mib', float('nan')):10.1f}  "
            f"{r.get('error', '')}"
        )


def time_point(p: dict, timing: str, backends: list[str], q, k, v, ins, do, args) -> dict[str, dict]:
    """Every dense SDPA backend and MiTA backend at one point in one timing mode (``--order`` says which first)."""
    long_run = p["N"] >= 1 << 18
    res: dict[str, dict] = {}
    if args.order == "mita-first":
        time_mita(res, backends, q, k, v, p, ins, do, timing)
    for name in DENSE:
        if long_run and name not in args.dense_long.split(","):
            continue
        t0 = time.time()
        try:
            res[f"dense_{name}"] = measure(dense_fn(q, k, v, name), ins, do, long_run, timing, args.dense_reps_long)
        except RuntimeError as e:
            res[f"dense_{name}"] = {"error": str(e).splitlines()[0][:80]}
            torch.cuda.empty_cache()
        print(f"{p['name']} {timing} dense_{name} {res[f'dense_{name}']} ({time.time() - t0:.1f}s)", flush=True)
    if args.order == "dense-first":
        time_mita(res, backends, q, k, v, p, ins, do, timing)
    return res


if __name__ == "__main__":
    main()
