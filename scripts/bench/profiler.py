"""Where a MiTA call spends its time and memory, on the GPU (one subcommand per view):

    python scripts/bench/profiler.py kernels [--points deit_s,N65536] [--backend triton] [--sequence]
    python scripts/bench/profiler.py kernels --figf 65536:16,1048576:2 [--compile] [--fused-mlp]  # Figure F's model
    python scripts/bench/profiler.py kernels --layers deit_s [--attentions mita,full[cudnn]]  # bench_layers' layers
    python scripts/bench/profiler.py stages [--max-n 1048576] [--points deit_s,N65536,N65536xB16,...]
    python scripts/bench/profiler.py memory [--points N65536,N262144] [--top 10]
    python scripts/bench/profiler.py host [--points deit_s,N1024,N16384] [--device cpu] [--profile 25] [--out DIR]
    ncu --clock-control none --profile-from-start off --set full --import-source yes -o REPORT \\
        python scripts/bench/profiler.py ncu [--n 65536] [--m 128] [--backward]
    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > source.log
    python scripts/bench/profiler.py sass source.log[.gz] _topk_scan_kernel [--window 100]

kernels: per-kernel GPU time (torch.profiler) of MiTA and dense attention. For each point: wall time per call (CUDA
events, eager), the sum of GPU kernel time per call, and the kernels sorted by GPU time; wall time well above the
GPU sum means the call is bound by the host (launches). ``--sequence`` also lists the MiTA forward's kernels in
launch order (kernels that share a name, the scan passes, told apart).

stages: each stage of the Triton MiTA forward timed alone (CUDA events, median). For N above the on-chip top-k
limit also each pass of the long-row exact top-k in place, twice: as called (the candidates of every row fit the
list: the refinement passes exit at once on the device) and with the list forced to k entries, so that most rows
take the fallback (refinement, recount, ordered emission).

memory: where the peak memory of one call goes. For each point (MiTA with its landmark pooling, and SDPA's default
dense backend) and stage (forward under no_grad; forward + backward, as bench_op.py times them): the peak allocated
memory above what was allocated before the call (what bench_op.py reports) and the largest blocks live at that
moment, each with the innermost frame of this repository that allocated it (the allocator's history,
``torch.cuda.memory._record_memory_history``, of one call after a warm-up call).

host: where an eager call's host time goes. Per point, for the call bench_op.py times (``--calls bench``: the
landmarks pooled from q inside the call) or the operator alone (``op``: landmarks given): the median host time of
the forward and of the backward, each group of calls queued behind a spin kernel so that no launch waits for the
GPU (the time is the enqueueing alone), the Triton launches and the PyTorch ops that launch kernels (all but
allocations, views and detaches), and with ``--profile N`` the N functions with the most own time (cProfile) over
the timed calls. On CUDA also the cost of single launches (an empty Triton kernel with few and with many arguments,
torch.empty, a small PyTorch op) and each forward stage's host and wall time. ``--device cpu`` runs anywhere: the
Triton launches are replaced by no-ops after the project's own launch wrapper (``launch.py``: key, cache lookup,
argument tuple), so the time is MiTA's Python, PyTorch's dispatch and allocations without Triton's C launcher or
the driver (hosts differ in speed; the CPU figures compare code, not machines). ``--variants`` times kernel settings
side by side (sweep.py's syntax). ``--lra lra/listops-full,lra/listops-mita`` adds whole training steps
(scripts/lra_time.py's synthetic batches, full length and with ``--valid-fraction`` of the tokens valid; on the CPU
the landmark pooling picks its kernels as on CUDA): their launches and PyTorch kernels, and their wall time (a step
synchronises, so its host time alone is not measured). ``--points none`` skips the op points. ``--out DIR`` writes
``host_<device>.csv``.

ncu: one MiTA forward (or forward + backward) inside a CUDA profiler range, for Nsight Compute. The call is warmed
up first (every kernel compiled), outside the range; the landmarks are pooled as bench_op.py's MiTA calls pool
them. B 1, H 2, d 64, bf16, m = k (``--m``; default sqrt(N) / 2, as at bench_op's points: 128 at 64K, 256 at
256K, 512 at 1M).

sass: summaries of an Nsight Compute source page (SASS with per-instruction counters), as exported above. For one
kernel of the report: its stall reasons over all warp samples, then either the opcodes by share of executed
instructions and of samples, or (``--window W``) the listing cut into ranges of W instructions, each range holding
at least 1% of the samples or of the executed instructions printed with its hottest instruction (loops show up as
ranges with many executions). Needs no GPU.

(Not named profile.py: that would shadow the standard library's ``profile``, which cProfile and torch._dynamo
import, for every script run from this folder.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import csv
import functools
import gzip
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from bench_op import TRAINING_POINTS, lra_points, lra_time_module, point_landmarks  # noqa: E402
from common import cuda_time, environment, write_csv  # noqa: E402

from mita.ops.landmarks import pool_landmarks  # noqa: E402
from mita.ops.mita.api import mita_attention  # noqa: E402
from mita.ops.mita.triton import attention_fwd as afwd  # noqa: E402
from mita.ops.mita.triton import landmark_values as tlv  # noqa: E402
from mita.ops.mita.triton import op as tmop  # noqa: E402
from mita.ops.mita.triton import plan as tplan  # noqa: E402
from mita.ops.mita.triton import routing as trt  # noqa: E402
from mita.ops.mita.triton import short as ts  # noqa: E402
from mita.ops.mita.triton import topk as ttk  # noqa: E402
from mita.utils.kernel_ops import KernelOps  # noqa: E402

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# ---- kernels: torch.profiler tables ----------------------------------------------------------------------------------

# bench_op.py's training points (deit_s, seg_1025, B8_N4096, N16384, N65536, and lra_<task> read from the LRA
# experiment files) and these long rows (B 1, H 2 but for Figure F's layer at 64K, batch 16: GPU-bound).
LONG_POINTS = {
    p["name"]: dict(p, d=64, layout="1d")
    for p in (
        dict(name="N1024", B=1, H=2, N=1024, m=16, k=16),
        dict(name="N4096", B=1, H=2, N=4096, m=32, k=32),
        dict(name="N65536xB16", B=16, H=2, N=65536, m=128, k=128),
        dict(name="N262144", B=1, H=2, N=1 << 18, m=256, k=256),
        dict(name="N1048576", B=1, H=2, N=1 << 20, m=512, k=512),
    )
}
POINT_NAMES = "deit_s, seg_1025, B8_N4096, N16384, N65536, lra_<task>, " + ", ".join(LONG_POINTS)


def point(name: str) -> dict:
    """A benchmark point by name (the LRA shapes compose their experiment files, so they need Hydra)."""
    pts = {p["name"]: p for p in TRAINING_POINTS} | LONG_POINTS
    if name.startswith("lra_"):
        pts |= {p["name"]: p for p in lra_points()}
    if name not in pts:
        raise SystemExit(f"unknown point {name!r}; known: {POINT_NAMES}")
    return pts[name]


def make_fns(p: dict, backend: str):
    B, H, N, d = p["B"], p["H"], p["N"], p["d"]
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def mita():
        return mita_attention(q, k, v, point_landmarks(q, p), p["k"], backend=backend)

    def dense():
        return F.scaled_dot_product_attention(q, k, v)

    def fb(f):
        def g():
            for t in (q, k, v):
                t.grad = None
            f().backward(do)

        return g

    return {"mita fwd": mita, "mita fwd+bwd": fb(mita), "dense fwd": dense, "dense fwd+bwd": fb(dense)}


def _profiled(fn, reps: int):
    """The profiler after one warm-up call and ``reps`` profiled calls of ``fn``."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_table(fn, reps: int = 5, top: int | None = 14) -> tuple[float, list[tuple[str, float, int]]]:
    prof = _profiled(fn, reps)
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = ev.cuda_time_total
        if t > 0 and ev.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((ev.key[:70], t / reps / 1e3, ev.count // reps))
    rows.sort(key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows[:top]


def kernel_sequence(fn, reps: int = 3) -> list[tuple[str, float]]:
    """The GPU kernels of one call of ``fn`` in launch order with their durations in ms (the last of ``reps``
    profiled calls), so kernels that share a name (the scan passes) are told apart."""
    prof = _profiled(fn, reps)
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    per = len(evs) // reps
    return [(e.name[:70], e.time_range.elapsed_us() / 1e3) for e in evs[len(evs) - per :]]


def profile_layers(names: list[str], labels: list[str]) -> None:
    """Wall and per-kernel GPU time of whole layers (projections included) as bench_layers.py builds them, forward
    (no_grad) and forward + backward."""
    from bench_layers import build, methods, points, stage_fns

    pts = {p["name"]: p for p in points(1 << 20)}
    for name in names:
        p = pts[name]
        meth = methods(p, [lab for lab in labels if not lab.startswith("full")], "cuda")
        for label in labels:
            reg, opts = meth[label]
            layer = build(reg, opts, p).to("cuda", torch.bfloat16)
            x = torch.randn(p["B"], p["N"], p["H"] * p["d"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for stage, fn in stage_fns(layer, x, p["grid"]):
                with torch.no_grad() if stage == "fwd" else contextlib.nullcontext():
                    wall, spread = cuda_time(fn, warmup=3, reps=30, max_s=5.0)
                    gpu, rows = kernel_table(fn, reps=5, top=20)
                head = f"== layer {name} {label} {stage}: wall {wall:.3f} ms (spread {spread:.3f})"
                print(f"{head}, GPU kernels {gpu:.3f} ms")
                for key, ms, cnt in rows:
                    print(f"   {ms:8.4f} ms  x{cnt:<3d} {key}", flush=True)
            del layer, x
            torch.cuda.empty_cache()


# ---- stages: each forward stage alone --------------------------------------------------------------------------------


def profile_point(name: str, B: int, H: int, N: int, m: int, k: int, d: int = 64) -> None:
    """Print the median time of each forward stage at one shape (bf16, S 1)."""
    BH = B * H
    q, kk, v = (torch.randn(BH, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    r = torch.randn(BH, m, d, device="cuda", dtype=torch.bfloat16)
    idx = ttk.exact_topk(r, kk, None, k)
    route = trt.route_topk(q, r, 1)
    plan = tplan.build_plan(idx, route, m)
    vt, _ = tlv.landmark_values_fwd(r, kk, v, None, d**-0.5)
    q4, k4, v4, r4 = q.view(B, H, N, d), kk.view(B, H, N, d), v.view(B, H, N, d), r.view(B, H, m, d)
    ins = [t.requires_grad_() for t in (q4, k4, v4, r4)]
    do = torch.randn_like(q4)

    def fwd_bwd():
        for t in ins:
            t.grad = None
        tmop.triton_mita(q4, k4, v4, r4, k).backward(do)

    stages = {
        "exact top-k (Triton)": lambda: ttk.exact_topk(r, kk, None, k),
        "exact top-k, fallback forced (cap = k)": lambda: ttk.exact_topk(r, kk, None, k, cap=k),
        "top-S routing (Triton)": lambda: trt.route_topk(q, r, 1),
        "build_plan (sort + tiles)": lambda: tplan.build_plan(idx, route, m),
        "landmark values fwd (split-key)": lambda: tlv.landmark_values_fwd(r, kk, v, None, d**-0.5),
        "fused attention kernel": lambda: afwd.mita_fwd(q, kk, v, r, vt, plan, 1, True, d**-0.5, 1.0 / d),
        "whole triton_mita forward": lambda: tmop.triton_mita(q4, k4, v4, r4, k),
    }
    for sname, fn in stages.items():
        with torch.no_grad():
            ms, spread = cuda_time(fn, warmup=2, reps=10, max_s=5.0)
        print(f"{name:9s} {sname:40s} {ms:9.3f} ms (spread {spread:.3f})", flush=True)
    ms, spread = cuda_time(fwd_bwd, warmup=2, reps=10, max_s=5.0)
    print(f"{name:9s} {'whole forward + backward':40s} {ms:9.3f} ms (spread {spread:.3f})", flush=True)
    if N > ttk.SMALL_N:
        profile_topk_passes(name, r, kk, k)
        profile_topk_passes(name + "/fb", r, kk, k, cap=k)


def profile_topk_passes(name: str, r, kk, k: int, reps: int = 5, cap: int | None = None) -> None:
    """Print the median time of each pass of the long-row exact top-k (taken even where the default call takes the
    medium-row path), each timed in its place in a full call
    (``cap``: the candidate-list length, None for the default)."""
    acc: dict[str, list] = {}

    def timer(sname, fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        acc.setdefault(sname, []).append((start, end))
        return out

    ref = ttk.exact_topk(r, kk, None, k)
    for _ in range(reps):
        # The long-row path even where the default takes the medium-row one.
        got = ttk.exact_topk(r, kk, None, k, cap=cap, timer=timer, medium_max_n=0)
    # Same answer whatever the path (each row's k keys, ascending).
    assert torch.equal(got, ref), f"{name}: top-k with cap={cap} differs from the default call"
    torch.cuda.synchronize()
    total = 0.0
    for sname, evs in acc.items():
        ms = statistics.median(s.elapsed_time(e) for s, e in evs)
        total += ms
        print(f"{name:9s}   top-k: {sname:38s} {ms:9.3f} ms", flush=True)
    print(f"{name:9s}   top-k: {'sum of passes':38s} {total:9.3f} ms", flush=True)


# ---- memory: the blocks live at the peak -----------------------------------------------------------------------------


def _where(frames: list[dict]) -> str:
    """The innermost frame inside the repository (the allocating line of this project's code)."""
    for f in frames:
        name = f.get("filename", "")
        if name.startswith(_REPO) and not name.endswith("profiler.py"):
            return f"{os.path.relpath(name, _REPO)}:{f.get('line')} {f.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def peak_breakdown(fn, no_grad: bool) -> tuple[float, list[tuple[float, str]]]:
    """``(peak MiB above the allocations before the call, [(MiB, where)] of the blocks live at the peak)``."""
    ctx = torch.no_grad() if no_grad else contextlib.nullcontext()
    with ctx:
        fn()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    try:
        with ctx:
            fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    # Only this call's events: the trace restarts when recording starts.
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    at_best: list[tuple[int, str]] = []
    for ev in events:
        act, size = ev["action"], ev["size"]
        if act == "alloc":
            live[ev["addr"]] = (size, _where(ev.get("frames", [])))
            cur += size
            if cur > best:
                best, at_best = cur, list(live.values())
        elif act == "free_requested":
            live.pop(ev["addr"], None)
            cur -= size
    rows = sorted(((s / 2**20, w) for s, w in at_best), reverse=True)
    return best / 2**20, rows


# ---- host: launch time -----------------------------------------------------------------------------------------------


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
    """Host cost of one launch, piece by piece: Triton's own path, the project's direct launch (``fast``), a compiled
    kernel launched with tensors (its C launcher calls ``data_ptr()`` and ``cuPointerGetAttribute`` per tensor) and
    with addresses as ints (neither), beside PyTorch's allocation, a reduction and a stream fork (what the MiTA
    forward's second stream costs)."""
    from mita.ops.mita.triton.launch import _stream_getter, fast

    x = torch.zeros(64, device="cuda")
    ptrs = [torch.zeros(64, device="cuda") for _ in range(12)]
    addrs = [t.data_ptr() for t in ptrs]
    ints = (1, 2, 3, 4, 5, 6, 7, 8)
    compiled = _empty24[(1,)](*ptrs, *ints, C0=1, C1=2, C2=3, C3=4)
    run, function, meta = compiled.run, compiled.function, compiled.packed_metadata
    main, side, dev = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.current_device()

    def fork_join():
        side.wait_stream(main)
        main.wait_stream(side)

    cases = {
        "empty Triton kernel, 3 args": lambda: _empty3[(1,)](x, 64, 64),
        "empty Triton kernel, 20 args + 4 constexpr": lambda: _empty24[(1,)](*ptrs, *ints, C0=1, C1=2, C2=3, C3=4),
        "  the same through fast() (MiTA's launches)": lambda: fast(_empty24)[(1,)](
            *ptrs, *ints, C0=1, C1=2, C2=3, C3=4
        ),
        "  compiled[grid], 12 tensors": lambda: compiled[(1, 1, 1)](*ptrs, *ints, 1, 2, 3, 4),
        "  compiled.run, 12 addresses as ints": lambda: run(
            1, 1, 1, _stream_getter()(dev), function, meta, None, None, None, *addrs, *ints, 1, 2, 3, 4
        ),
        "torch.empty(1024)": lambda: torch.empty(1024, device="cuda"),
        "x.sum()": lambda: x.sum(),
        "stream fork + join (2 events)": fork_join,
    }
    for name, fn in cases.items():
        try:
            h, w = host_and_wall(fn, reps=200)
        except Exception as e:  # noqa: BLE001 (one case's failure, e.g. another Triton's launcher, is reported)
            print(f"launch  {name:45s} failed: {type(e).__name__}: {e}", flush=True)
            continue
        print(f"launch  {name:45s} host {h * 1e3:8.1f} us  wall {w * 1e3:8.1f} us", flush=True)


def host_stages(name: str) -> None:
    """Each forward stage's host time and wall time (CUDA)."""
    p = point(name)
    B, H, N, d, m, k = p["B"], p["H"], p["N"], p["d"], p["m"], p["k"]
    BH = B * H
    q, kk, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def pool():
        return point_landmarks(q, p)

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


def count_launches() -> tuple[list, list]:
    """Wrap the project's launch wrapper: ``(inside, count)``, whether a launch is running and launches so far."""
    from mita.ops.mita.triton import launch

    inside, count = [False], [0]
    real = launch.FastKernel._launch

    def counted(self, grid, args, kwargs):
        count[0] += 1
        inside[0] = True
        try:
            return real(self, grid, args, kwargs)
        finally:
            inside[0] = False

    launch.FastKernel._launch = counted
    # Replayed calls (replay.py) launch their recorded kernels without the wrapper: counted per replay.
    from mita.ops.mita.triton import replay

    real_run = replay._Program.run

    def counted_run(self, inputs, direct):
        count[0] += self.n_launches
        return real_run(self, inputs, direct)

    replay._Program.run = counted_run
    return inside, count


def cpu_launch_stubs() -> None:
    """``host --device cpu``: no driver, so the first call of each key (which would compile through Triton) caches a
    kernel that does nothing, and every later call takes the direct path exactly as on a GPU, minus the launch."""
    from mita.ops.mita.triton import backend, common, launch

    os.environ.pop("TRITON_INTERPRET", None)
    getattr(launch.interpreting, "cache_clear", lambda: None)()  # (older trees read the variable per call)
    backend.interpreting = lambda: True  # the backend takes CPU tensors only when interpreting
    from mita.ops import landmarks

    if hasattr(landmarks, "_kernels_for"):  # the landmark pooling picks its kernels as on CUDA
        landmarks._kernels_for = lambda x: landmarks._pool_kernels()
    torch.cuda.current_device = lambda: 0
    launch._stream_getter = lambda: lambda dev: 0
    common._SM_COUNT.setdefault(0, 132)

    class NoLaunch:
        """A compiled kernel whose launcher does nothing (the attributes the direct path reads)."""

        function = packed_metadata = None

        @staticmethod
        def run(*args):
            return None

    class Stub:
        def __init__(self, fn):
            self.arg_names, self.params, self.__name__ = fn.arg_names, fn.params, fn.__name__
            self.jit = fn  # the kernel itself (compile_check.py --point compiles what a call launched)

        def __getitem__(self, grid):
            return lambda *args, **kwargs: NoLaunch()

    real_init = launch.FastKernel.__init__

    def init(self, fn):
        real_init(self, fn)
        self.fn = Stub(fn)

    launch.FastKernel.__init__ = init


def op_fields(names) -> dict:
    """A row's PyTorch kernel ops from a :class:`KernelOps` counter: their number and ``opxN`` names."""
    return dict(torch_ops=sum(names.values()), torch_op_names=";".join(f"{op}x{n}" for op, n in sorted(names.items())))


def host_point(name: str, call: str, device: str, reps: int, counters, profile: int) -> list[dict]:
    """Forward and backward host time, launches and PyTorch kernel ops of one point's call (module docstring)."""
    p = point(name)
    inside, count = counters
    g = torch.Generator().manual_seed(0)
    shape = (p["B"], p["H"], p["N"], p["d"])
    q, k, v = (torch.randn(shape, generator=g).to(device, torch.bfloat16).requires_grad_(True) for _ in range(3))
    do = torch.randn(shape, generator=g).to(device, torch.bfloat16)
    if call == "bench":
        ins = (q, k, v)

        def fwd():
            return mita_attention(q, k, v, point_landmarks(q, p), p["k"], backend="triton")
    else:
        r = point_landmarks(q, p).detach().requires_grad_(True)
        ins = (q, k, v, r)

        def fwd():
            return mita_attention(q, k, v, r, p["k"], backend="triton")

    def bwd(out):
        out.backward(do)
        for t in ins:
            t.grad = None

    for _ in range(3):  # compile, fill the launch caches
        bwd(fwd())
    counts = {}
    count[0] = 0
    with KernelOps(lambda: inside[0]) as ops:
        out = fwd()
    counts["forward"] = (count[0], ops.names)
    count[0] = 0
    with KernelOps(lambda: inside[0]) as ops:
        bwd(out)
    counts["backward"] = (count[0], ops.names)
    times = {"forward": [], "backward": []}
    prof = cProfile.Profile() if profile else None
    group = 8
    for i in range(0, reps, group):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work ahead of the group: no launch waits for the GPU
        for _ in range(min(group, reps - i)):
            if prof:
                prof.enable()
            t0 = time.perf_counter()
            out = fwd()
            t1 = time.perf_counter()
            bwd(out)
            t2 = time.perf_counter()
            if prof:
                prof.disable()
            times["forward"].append(t1 - t0)
            times["backward"].append(t2 - t1)
    if device == "cuda":
        torch.cuda.synchronize()
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(profile)
        print(f"== {name} ({call}): cProfile of {reps} forward + backward calls, by own time", flush=True)
        print("\n".join(line for line in s.getvalue().splitlines()[4:] if line.strip()), flush=True)
    rows = []
    for pname in ("forward", "backward"):
        n_launch, op_names = counts[pname]
        rows.append(
            dict(
                point=name, call=call, pass_=pname, B=p["B"], H=p["H"], N=p["N"], d=p["d"], m=p["m"], k=p["k"],
                host_us=round(statistics.median(times[pname]) * 1e6, 1),
                host_us_min=round(min(times[pname]) * 1e6, 1), launches=n_launch,
                **op_fields(op_names), device=device, reps=reps,
            )
        )  # fmt: skip
    return rows


# ---- sass: Nsight Compute source pages -------------------------------------------------------------------------------


def rows_of(path: str, kernel: str) -> tuple[list[dict], list[str]]:
    """The instruction rows of ``kernel`` (its first section in the page) and the page's column names."""
    opener = gzip.open if path.endswith(".gz") else open
    rows, hdr, cur = [], [], None
    with opener(path, "rt") as f:
        for r in csv.reader(f):
            if r and r[0] == "Kernel Name":
                if cur == kernel and rows:
                    break
                cur, hdr = r[1], []
            elif r and r[0] == "Address":
                hdr = r
            elif cur == kernel and hdr:
                rows.append(dict(zip(hdr, r)))
    if not rows:
        raise SystemExit(f"no kernel named {kernel!r} in {path}")
    return rows, hdr


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):  # predicate
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


# ---- command line ----------------------------------------------------------------------------------------------------


def run_kernels(args) -> None:
    if args.layers:
        profile_layers(args.layers.split(","), args.attentions.split(","))
        return
    if args.figf:
        from bench_figf import DIM, build

        for item in args.figf.split(","):
            n, b = (int(s) for s in item.split(":"))
            model = build("mita", n, 2, fused_mlp=args.fused_mlp)
            if args.compile:
                model = torch.compile(model)
            x = torch.randn(b, n, DIM, device="cuda", dtype=torch.bfloat16)
            fwd = functools.partial(model, x)
            with torch.inference_mode():
                wall, spread = cuda_time(fwd, warmup=2, reps=5, max_s=5.0)
                gpu, rows = kernel_table(fwd, reps=3, top=25)
            tag = (" compiled" if args.compile else "") + (" fused-mlp" if args.fused_mlp else "")
            print(f"== figf N={n} B={b}{tag}: wall {wall:.3f} ms (spread {spread:.3f}), GPU kernels {gpu:.3f} ms")
            print(f"   {b * n / wall * 1e3:.3e} tokens/s wall, {b * n / gpu * 1e3:.3e} tokens/s GPU sum", flush=True)
            for key, ms, cnt in rows:
                print(f"   {ms:8.4f} ms  x{cnt:<3d} {key}", flush=True)
            del model, x
            torch.cuda.empty_cache()
        return
    for name in args.points.split(","):
        p = point(name)
        fns = make_fns(p, args.backend)
        for fname, fn in fns.items():
            if fname.startswith("dense") and p["N"] > 1 << 18:
                continue
            wall, spread = cuda_time(fn, warmup=3, reps=20, max_s=5.0)
            gpu, rows = kernel_table(fn)
            print(f"== {name} {fname}: wall {wall:.3f} ms (spread {spread:.3f}), GPU kernels {gpu:.3f} ms", flush=True)
            for key, ms, cnt in rows:
                print(f"   {ms:8.4f} ms  x{cnt:<3d} {key}", flush=True)
            if args.sequence and fname == "mita fwd":
                with torch.no_grad():
                    seq = kernel_sequence(fn)
                print(f"   launch order ({len(seq)} kernels, {sum(t for _, t in seq):.4f} ms):")
                for i, (key, ms) in enumerate(seq):
                    print(f"   [{i:2d}] {ms:8.4f} ms  {key}", flush=True)
        torch.cuda.empty_cache()


def run_stages(args) -> None:
    for name in args.points.split(","):
        p = point(name)
        if p["N"] <= args.max_n:
            profile_point(name, p["B"], p["H"], p["N"], p["m"], p["k"], p["d"])
            torch.cuda.empty_cache()


def run_memory(args) -> None:
    for name in args.points.split(","):
        fns = make_fns(point(name), "triton")
        for label, fn in fns.items():
            peak, rows = peak_breakdown(fn, no_grad=label.endswith("fwd"))
            print(f"== {name} {label}: peak {peak:.1f} MiB above the call's start")
            for mib, where in rows[: args.top]:
                print(f"   {mib:9.2f} MiB  {where}")
        del fns
        torch.cuda.empty_cache()


def host_lra_step(experiment: str, device: str, reps: int, counters, valid_fraction: float) -> dict:
    """One LRA training step (scripts/lra_time.py's synthetic batch; MiTA rows on the Triton backend): Triton launches
    and PyTorch kernel ops per step, and the step's wall time (each step synchronised after it, as lra_time's)."""
    lra_time = lra_time_module()
    inside, count = counters
    cfg = lra_time.compose(experiment, [])
    overrides = ["model.attention.backend=triton"] if "backend" in cfg.model.attention else []
    step, _, B, N = lra_time.build_step(experiment, device, overrides, valid_fraction)
    for _ in range(2):
        step()
    count[0] = 0
    with KernelOps(lambda: inside[0]) as ops:
        step()
    launches = count[0]
    times = lra_time.step_times(step, device, 0, reps)
    return dict(
        point=experiment, call=f"step (valid {valid_fraction:g})", pass_="step wall", B=B, N=N,
        host_us=round(statistics.median(times) * 1e6, 1), host_us_min=round(min(times) * 1e6, 1), launches=launches,
        **op_fields(ops.names), device=device, reps=reps,
    )  # fmt: skip


def run_host(args) -> None:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
    names = [x for x in args.points.split(",") if x and x != "none"]
    for name in names:
        point(name)  # unknown names stop the run before anything is timed
    calls = [x for x in (args.calls or ("op,bench" if device == "cuda" else "op")).split(",") if x]
    if set(calls) - {"op", "bench"}:
        raise SystemExit(f"--calls takes op and bench, got {args.calls!r}")
    counters = count_launches()
    if device == "cpu":
        cpu_launch_stubs()
        torch.set_num_threads(1)
    else:
        launch_costs()
    from sweep import Variants

    variants = args.variants.split("|") if args.variants else [""]
    switch = Variants()
    env = environment()
    rows = []
    for name in names:
        for call in calls:
            # Variants in turn, twice (a, b, a, b), so a drift of the host's speed shows as a spread, not a gap.
            for _ in range(2 if len(variants) > 1 else 1):
                for variant in variants:
                    switch["variant"] = variant
                    for r in host_point(name, call, device, args.reps, counters, args.profile):
                        rows.append(dict(r, variant=variant, **env))
            switch["variant"] = ""
        if device == "cuda" and args.stages:
            host_stages(name)
            torch.cuda.empty_cache()
    for exp in [x for x in args.lra.split(",") if x]:
        for frac in (1.0, args.valid_fraction) if args.valid_fraction < 1 else (1.0,):
            rows.append(dict(host_lra_step(exp, device, max(4, args.reps // 8), counters, frac), variant="", **env))
    print(
        f"{'point':12s} {'call':6s} {'pass':9s} {'host us':>9s} {'launches':>9s} {'torch ops':>10s}  variant; torch ops"
    )
    for r in rows:
        print(f"{r['point']:12s} {r['call']:6s} {r['pass_']:9s} {r['host_us']:9.1f} {r['launches']:9d} "
              f"{r['torch_ops']:10d}  {r['variant'] or 'defaults'}; {r['torch_op_names']}")  # fmt: skip
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_csv(os.path.join(args.out, f"host_{device}.csv"), rows)


def run_ncu(args) -> None:
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


def run_sass(args) -> None:
    rows, hdr = rows_of(args.page, args.kernel)
    samples = [num(d["Warp Stall Sampling (All Samples)"]) for d in rows]
    execd = [num(d["Instructions Executed"]) for d in rows]
    tot_s, tot_i = sum(samples) or 1.0, sum(execd) or 1.0
    print(f"{args.kernel}: {len(rows)} instructions, {tot_s:.0f} samples, {tot_i:.0f} executed (warp level)")
    stalls = collections.Counter()
    for d in rows:
        for h in hdr:
            if h.startswith("stall_") and "Not Issued" not in h:
                stalls[h[6:]] += num(d[h])
    print("stalls:", ", ".join(f"{k} {v / tot_s * 100:.1f}%" for k, v in stalls.most_common(10)))
    if args.window:
        w = args.window
        for i in range(0, len(rows), w):
            s, e = sum(samples[i : i + w]), sum(execd[i : i + w])
            if s / tot_s > 0.01 or e / tot_i > 0.01:
                hot = max(range(i, min(i + w, len(rows))), key=lambda j: samples[j])
                print(f"[{i:5d}] samples {s / tot_s * 100:5.1f}%  executed {e / tot_i * 100:5.1f}%  hottest: "
                      f"{rows[hot]['Source'].strip()[:60]}")  # fmt: skip
        return
    ops = collections.defaultdict(lambda: [0.0, 0.0])
    for d, s, e in zip(rows, samples, execd):
        op = ops[opcode(d["Source"])]
        op[0] += e
        op[1] += s
    for name, (e, s) in sorted(ops.items(), key=lambda x: -x[1][0])[: args.top]:
        print(f"  {name:10s} executed {e / tot_i * 100:5.1f}%  samples {s / tot_s * 100:5.1f}%")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("kernels", help="per-kernel GPU time (torch.profiler)")
    p.add_argument("--points", default="deit_s,N65536", help=f"names among {POINT_NAMES}")
    p.add_argument("--backend", default="triton")
    p.add_argument("--figf", default="", help="N:batch,... profile one forward of Figure F's MiTA model instead")
    p.add_argument("--compile", action="store_true", help="with --figf: torch.compile the model first")
    p.add_argument("--fused-mlp", action="store_true", help="with --figf: the blocks' fused MLP kernel")
    p.add_argument("--layers", default="", help="bench_layers.py point names: profile whole layers instead")
    p.add_argument("--attentions", default="mita,full[cudnn]", help="with --layers: bench_layers method labels")
    p.add_argument(
        "--sequence", action="store_true", help="also list the MiTA forward's kernels in launch order with durations"
    )
    p.set_defaults(run=run_kernels)
    p = sub.add_parser("stages", help="each forward stage and each top-k pass timed alone")
    p.add_argument("--max-n", type=int, default=1 << 20)
    p.add_argument("--points", default="deit_s,N65536,N262144,N1048576", help=f"names among {POINT_NAMES}")
    p.set_defaults(run=run_stages)
    p = sub.add_parser("memory", help="the blocks live at the peak of one call, with the code that made them")
    p.add_argument("--points", default="N65536,N262144", help=f"names among {POINT_NAMES}")
    p.add_argument("--top", type=int, default=10)
    p.set_defaults(run=run_memory)
    p = sub.add_parser("host", help="host time, launches and PyTorch ops of eager calls (CUDA or --device cpu)")
    p.add_argument("--points", default="deit_s,seg_1025,N1024,N4096,B8_N4096,N16384,N65536")
    p.add_argument("--device", default="", choices=("", "cuda", "cpu"), help="default: cuda when there is one")
    p.add_argument("--calls", default="", help="op, bench or both (default: both on CUDA, op on the CPU)")
    p.add_argument("--reps", type=int, default=48, help="timed forward + backward calls per point and call")
    p.add_argument("--profile", type=int, default=0, help="print the N functions with the most own time")
    p.add_argument("--stages", action="store_true", help="CUDA: also each forward stage's host and wall time")
    p.add_argument(
        "--variants",
        default="",
        help="'|'-separated kernel settings as sweep.py --variants takes them (empty: the defaults), each point "
        "timed under each in turn, twice; e.g. '|fwd.route_stream=0'",
    )
    p.add_argument("--out", default="", help="write host_<device>.csv here")
    p.add_argument(
        "--lra", default="", help="comma-separated LRA experiments (lra/listops-mita, ...): whole training steps too"
    )
    p.add_argument(
        "--valid-fraction", type=float, default=0.6, help="with --lra: also steps with this share of valid tokens"
    )
    p.set_defaults(run=run_host)
    p = sub.add_parser("ncu", help="one MiTA call inside a CUDA profiler range (run under Nsight Compute)")
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--m", type=int, default=None)
    p.add_argument("--backward", action="store_true")
    p.set_defaults(run=run_ncu)
    p = sub.add_parser("sass", help="opcode mix, stall reasons or hot ranges of one kernel of an ncu source page")
    p.add_argument("page")
    p.add_argument("kernel")
    p.add_argument("--window", type=int, default=0, help="print ranges of this many instructions instead of opcodes")
    p.add_argument("--top", type=int, default=25)
    p.set_defaults(run=run_sass)
    args = ap.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
