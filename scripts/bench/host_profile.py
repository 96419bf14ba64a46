"""Host time of one MiTA call: where an eager call's Python goes, and how many launches it makes.

At the lengths where the paper trains (197 to 64K tokens) an eager MiTA call takes longer on the host than on the
GPU (bench_op.py: eager against CUDA-graph times), so this measures the host side alone, for the calls bench_op.py
times (``mita_attention``, forward, then backward; ``--calls bench`` with the point's landmark pooling inside
the call as bench_op.py has it, ``op`` with the landmarks given):

- ``host_us``: median wall time of the call's host work. On CUDA each group of calls is queued behind a spin
  kernel, so no launch waits for the GPU and the time is the enqueueing alone. On the CPU (``--device cpu``,
  any machine) the Triton launches are replaced by no-ops after the project's own launch wrapper (``launch.py``:
  key, cache lookup, argument tuple), so the time is MiTA's Python, PyTorch's dispatch and allocations without
  Triton's C launcher or the CUDA driver (a lower bound of the GPU host's time; hosts differ in speed).
- ``launches``: Triton kernels launched; ``torch_ops``: PyTorch ops other than allocations, views and detaches
  (each launches a kernel on a GPU), named in ``torch_op_names``.
- ``--profile N``: the N functions with the most own time (cProfile) over the timed calls, printed per point.

    python scripts/bench/host_profile.py --device cpu --points deit_s,N1024,N16384 --out OUT
    python scripts/bench/host_profile.py --points deit_s,seg_1025,N1024,N4096,N16384,N65536 --profile 25 --out OUT

Writes ``OUT/host_profile_<device>.csv`` (one row per point and pass) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from bench_op import TRAINING_POINTS, lra_points, point_landmarks  # noqa: E402
from common import environment, write_csv  # noqa: E402

from mita.ops.mita.api import mita_attention  # noqa: E402

# Long-row points (bench_op.py's long set) beside the training set's.
LONG_POINTS = [dict(name=f"N{n}", B=1, H=2, N=n, d=64, m=int((n / 4) ** 0.5), k=int((n / 4) ** 0.5), layout="1d")
               for n in (1024, 4096)]  # fmt: skip
# Ops that allocate, view or detach: no kernel on a GPU.
FREE_OPS = {"empty", "new_empty", "new_empty_strided", "empty_like", "empty_strided", "view", "detach",
            "_unsafe_view", "alias", "as_strided", "_reshape_alias", "unsqueeze", "transpose", "t", "expand",
            "slice", "select", "permute", "squeeze", "split", "unbind", "reshape"}  # fmt: skip


def all_points() -> dict[str, dict]:
    pts = {p["name"]: p for p in [*TRAINING_POINTS, *LONG_POINTS]}
    with contextlib.suppress(Exception):  # the LRA shapes need hydra and the experiment files
        pts.update({p["name"]: p for p in lra_points()})
    return pts


class _Ops(TorchDispatchMode):
    """Counts PyTorch ops that launch kernels (everything but FREE_OPS), outside Triton launches."""

    def __init__(self, inside):
        super().__init__()
        self.inside = inside
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside[0] and func.overloadpacket.__name__ not in FREE_OPS:
            self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _NoLaunch:
    """Stands in for a compiled Triton kernel on the CPU: ``compiled[grid](*args)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args: None


def _count_launches(inside: list, counter: list):
    """Patch the project's launch wrapper to count launches (and, on the CPU, to stop before Triton's launcher)."""
    from mita.ops.mita.triton import launch

    real = launch.FastKernel._launch

    def counted(self, grid, args, kwargs):
        counter[0] += 1
        inside[0] = True
        try:
            return real(self, grid, args, kwargs)
        finally:
            inside[0] = False

    launch.FastKernel._launch = counted
    return launch


def _cpu_stubs(launch) -> None:
    """CPU mode: no driver, so the first call of each key (which compiles through Triton) caches a no-op kernel,
    and everything after it takes the direct path exactly as on a GPU, minus the launch itself."""
    from mita.ops.mita.triton import backend, common

    os.environ.pop("TRITON_INTERPRET", None)
    getattr(launch.interpreting, "cache_clear", lambda: None)()
    # The backend takes CPU tensors only under the interpreter; here they stand in for CUDA ones.
    backend.interpreting = lambda: True
    torch.cuda.current_device = lambda: 0
    common._SM_COUNT.setdefault(0, 132)

    class _FakeJit:
        def __init__(self, fn):
            self.arg_names, self.params, self.__name__ = fn.arg_names, fn.params, fn.__name__

        def __getitem__(self, grid):
            return lambda *args, **kwargs: _NoLaunch()

    real_init = launch.FastKernel.__init__

    def init(self, fn):
        real_init(self, fn)
        self.fn = _FakeJit(fn)

    launch.FastKernel.__init__ = init


def _inputs(p: dict, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    shape = (p["B"], p["H"], p["N"], p["d"])
    q, k, v = (torch.randn(shape, generator=g).to(device, dtype).requires_grad_(True) for _ in range(3))
    do = torch.randn(shape, generator=g).to(device, dtype)
    return q, k, v, do


def measure_point(p: dict, call: str, device: str, reps: int, inside: list, launches: list, profile: int) -> list[dict]:
    q, k, v, do = _inputs(p, device, torch.bfloat16)
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

    for _ in range(3):  # first calls compile (GPU) and fill the launch caches
        bwd(fwd())
    if device == "cuda":
        torch.cuda.synchronize()
    counts = {}
    launches[0] = 0
    with _Ops(inside) as mode:
        out = fwd()
    counts["forward"] = (launches[0], mode.names)
    launches[0] = 0
    with _Ops(inside) as mode:
        bwd(out)
    counts["backward"] = (launches[0], mode.names)
    times = {"forward": [], "backward": []}
    prof = cProfile.Profile() if profile else None
    group = 8
    for i in range(0, reps, group):
        if device == "cuda":
            torch.cuda.synchronize()
            # Keep the GPU busy for longer than the group's host work, so that no launch waits on it.
            torch.cuda._sleep(200_000_000)
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
    rows = []
    for name in ("forward", "backward"):
        n_launch, op_names = counts[name]
        rows.append(
            dict(
                point=p["name"], call=call, B=p["B"], H=p["H"], N=p["N"], d=p["d"], m=p["m"], k=p["k"], pass_=name,
                host_us=round(statistics.median(times[name]) * 1e6, 1),
                host_us_min=round(min(times[name]) * 1e6, 1), launches=n_launch, torch_ops=sum(op_names.values()),
                torch_op_names=";".join(f"{k}x{v}" for k, v in sorted(op_names.items())), device=device, reps=reps,
            )
        )  # fmt: skip
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(profile)
        print(f"--- {p['name']} ({call}): cProfile over {reps} forward + backward calls (profiler overhead included)")
        print(s.getvalue().split("\n", 4)[-1].rstrip())
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--points", default="deit_s,seg_1025,N1024,N4096,B8_N4096,N16384,N65536")
    ap.add_argument(
        "--calls",
        default="",
        help="comma-separated: op (mita_attention with the landmarks given), bench (bench_op.py's call: the "
        "landmarks pooled from q inside the call); default op,bench on CUDA, op on the CPU (where the pooling's "
        "PyTorch ops would compute for real)",
    )
    ap.add_argument("--reps", type=int, default=48, help="timed forward + backward calls per point")
    ap.add_argument("--profile", type=int, default=0, help="print the N functions with the most own time")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
    pts = all_points()
    names = [x for x in args.points.split(",") if x]
    unknown = [x for x in names if x not in pts]
    if unknown:
        raise SystemExit(f"unknown points {unknown}; known: {sorted(pts)}")
    inside, launches = [False], [0]
    launch = _count_launches(inside, launches)
    if args.device == "cpu":
        _cpu_stubs(launch)
        torch.set_num_threads(1)
    env = environment()
    rows = []
    calls = [x for x in (args.calls or ("op,bench" if args.device == "cuda" else "op")).split(",") if x]
    if set(calls) - {"op", "bench"}:
        raise SystemExit(f"--calls takes op and bench, got {args.calls!r}")
    for name in names:
        for call in calls:
            for r in measure_point(pts[name], call, args.device, args.reps, inside, launches, args.profile):
                r.update(env)
                rows.append(r)
    print(f"{'point':12s} {'call':6s} {'pass':9s} {'host us':>9s} {'launches':>9s} {'torch ops':>10s}  torch ops")
    for r in rows:
        print(f"{r['point']:12s} {r['call']:6s} {r['pass_']:9s} {r['host_us']:9.1f} {r['launches']:9d} "
              f"{r['torch_ops']:10d}  {r['torch_op_names']}")  # fmt: skip
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_csv(os.path.join(args.out, f"host_profile_{args.device}.csv"), rows)


if __name__ == "__main__":
    main()
