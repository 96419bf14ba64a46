"""Shared helpers of the benchmarks: environment stamp, CUDA-event timing, correctness gate, CSV output."""

from __future__ import annotations

import csv
import datetime
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch


def environment() -> dict[str, str]:
    """GPU, driver, torch, triton, python versions, the date and whether the machine was shared (``load_1m``,
    ``gpu_other_procs``: ``tasks.common.records.machine_load``): stamped on every CSV row."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "none"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, IndexError):
        env["driver"] = "unknown"
    from tasks.common.records import machine_load  # (imported here: the scripts put the repository on sys.path)

    env.update(machine_load())
    return env


def wall_time(fn: Callable[[], object], warmup: int = 2, reps: int = 10, max_s: float = 20.0) -> tuple[float, float]:
    """Median and spread (max - min) in ms of ``fn`` over ``reps`` wall-clock runs (CPU smoke runs; ``max_s`` is
    accepted for the same signature as :func:`cuda_time` and not used)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), max(times) - min(times)


# GPU clock cycles of the spin kernel queued before each timed run with queued=True (~0.1 ms at the H200's 1.98 GHz;
# enqueueing the start event, one graph replay and the end event takes the host ~10-30 us).
QUEUE_CYCLES = 200_000


def cuda_time(
    fn: Callable[[], object], warmup: int = 2, reps: int = 10, max_s: float = 20.0, queued: bool = False
) -> tuple[float, float]:
    """Median and spread (max - min) in ms of ``fn`` over ``reps`` runs timed with CUDA events.

    Fewer runs are made when one run is long (``max_s`` bounds the total). ``queued``: a spin kernel
    (``torch.cuda._sleep``) runs before each start event, so the host has enqueued the start event, ``fn``'s work
    and the end event before the GPU reaches them and the interval holds the GPU's execution only; otherwise the
    GPU is idle when the start event is recorded and the interval also holds the time the host takes to launch
    ``fn``'s work (for a CUDA-graph replay, the graph's launch latency).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    t_budget = max_s * 1e3
    while len(times) < reps:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(QUEUE_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if sum(times) > t_budget and len(times) >= 2:
            break
    return statistics.median(times), max(times) - min(times)


# eager: each call launches its kernels from Python; cuda_graph: replays of a graph capturing one call, each launched
# onto an idle GPU (the replay's launch latency is in the interval); cuda_graph_queued: the same replays with the GPU
# kept busy before each (cuda_time's queued), i.e. the GPU's execution time of one call.
TIMING_MODES = ("eager", "cuda_graph", "cuda_graph_queued")


def capture_graph(fn: Callable[[], object], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, object]:
    """Capture one call of ``fn`` in a CUDA graph; replaying the graph reruns its kernels on the same memory.

    ``fn`` is first run ``warmup`` times on a side stream (Triton autotuning and compilation, cuBLAS workspaces,
    lazily built caches, autograd's accumulators: nothing that allocates or synchronises only once may happen
    during capture), then captured once with ``torch.cuda.graph``. To replay on new data, copy it into the
    tensors ``fn`` reads (``static.copy_(new)``) and call ``graph.replay()``; the outputs (the returned value,
    and ``.grad`` of the leaves when ``fn`` runs a backward) are overwritten in place. The graph reads and writes
    by address: keep every tensor ``fn`` uses (inputs, parameters, optimiser state) alive while replaying; freed,
    their memory goes to the next allocation and a replay reads whatever that wrote.

    Args:
        fn: a callable without arguments that launches CUDA work only (no host synchronisation).
        warmup: eager calls before capture.

    Returns:
        ``(graph, static_output)``: the captured graph and what ``fn`` returned during capture.

    Raises:
        RuntimeError: when the capture fails (an op that synchronises with the host or is not capturable).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def capture_failure(err: BaseException, stage: str = "") -> str:
    """The ``"capture failed: [<stage>: ]<reason>"`` text recorded for a callable that could not be captured in a
    CUDA graph; waits for the device and frees cached memory so that the next measurement starts clean."""
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        pass
    torch.cuda.empty_cache()
    text = str(err).strip()
    reason = text.splitlines()[0][:100] if text else type(err).__name__
    return f"capture failed: {stage + ': ' if stage else ''}{reason}"


def time_stage(row: dict, stage: str, timing: str, timer: Callable[[], tuple[float, float]]) -> bool:
    """``row[stage_ms], row[stage_spread_ms] = timer()``. In a CUDA-graph mode a failed capture (anything but running
    out of memory) becomes ``row["error"]`` instead and False is returned: the caller times no later stage."""
    try:
        row[f"{stage}_ms"], row[f"{stage}_spread_ms"] = timer()
    except RuntimeError as e:
        if timing == "eager" or isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        row["error"] = capture_failure(e, "" if stage == "fwd" else "fwd+bwd")
        return False
    return True


def time_ms(
    fn: Callable[[], object], timing: str = "eager", warmup: int = 2, reps: int = 10, max_s: float = 20.0
) -> tuple[float, float]:
    """Median and spread in ms of ``fn`` (``timing="eager"``: each call launches its kernels) or of replays of a
    CUDA graph capturing one call of ``fn`` (``timing="cuda_graph"``: no Python launch overhead, each replay
    launched onto an idle GPU; ``"cuda_graph_queued"``: each replay queued behind a spin kernel, so its launch
    latency is not timed either, see :func:`cuda_time`).

    Raises:
        RuntimeError: the capture failed (cuda_graph only); :func:`capture_failure` turns it into a table entry.
    """
    if timing not in TIMING_MODES:
        raise ValueError(f"timing must be one of {TIMING_MODES}, got {timing!r}")
    if timing == "eager":
        return cuda_time(fn, warmup=warmup, reps=reps, max_s=max_s)
    graph, _ = capture_graph(fn, warmup=max(warmup, 1))
    try:
        return cuda_time(graph.replay, warmup=1, reps=reps, max_s=max_s, queued=timing == "cuda_graph_queued")
    finally:
        del graph
        torch.cuda.empty_cache()


def parse_timings(text: str) -> list[str]:
    """``--timing``'s comma-separated modes, checked, in the order given, without repeats."""
    modes = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [t for t in modes if t not in TIMING_MODES]
    if not modes or bad:
        raise ValueError(f"--timing takes a comma-separated list of {', '.join(TIMING_MODES)}; got {text!r}")
    return modes


def peak_memory_mib(fn: Callable[[], object]) -> float:
    """Peak allocated memory of one call of ``fn`` above what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def mita_correct(backend: str, device: str = "cuda") -> tuple[bool, str]:
    """Correctness gate: the backend against naive_mita, forward and backward, bf16, two awkward shapes.

    Returns:
        ``(ok, message)``; benchmarks print no speed-up for a backend whose gate fails.
    """
    from mita.ops.mita.api import mita_attention
    from mita.ops.mita.naive import naive_mita

    msgs = []
    ok = True
    for N, m, k, S in ((1025, 16, 64, 1), (4097, 32, 128, 2)):
        g = torch.Generator(device="cpu").manual_seed(N)
        ts = [torch.randn(1, 2, N, 64, generator=g).to(device, torch.bfloat16).requires_grad_() for _ in range(3)]
        r = torch.randn(1, 2, m, 64, generator=g).to(device, torch.bfloat16).requires_grad_()
        do = torch.randn(1, 2, N, 64, generator=g).to(device, torch.bfloat16)
        o = mita_attention(*ts, r, k, experts_per_query=S, backend=backend)
        gr = torch.autograd.grad(o, (*ts, r), do)
        o_ref = naive_mita(*ts, r, k, experts_per_query=S)
        gr_ref = torch.autograd.grad(o_ref, (*ts, r), do)
        for name, a, b in zip(["out", "dq", "dk", "dv", "dR"], (o, *gr), (o_ref, *gr_ref)):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            if not err < 4e-2:
                ok = False
                msgs.append(f"N={N} S={S} {name} rel err {err:.2e}")
    return ok, "; ".join(msgs) if msgs else "ok"


def correlated_tokens(
    shape: tuple[int, ...], rho: float, generator: torch.Generator, device: str = "cuda", dtype=torch.bfloat16
) -> torch.Tensor:
    """Standard-normal entries, independent except along dim -2 (the tokens), where each sequence is AR(1) with
    lag-1 correlation ``rho`` (rho = 0: i.i.d.). Built as white noise convolved (FFT) with the AR(1) impulse response
    truncated where it falls below 1e-4, so neighbouring tokens are alike, as in images or text."""
    e = torch.randn(*shape, device=device, generator=generator, dtype=torch.float32)
    if rho == 0:
        return e.to(dtype)
    if not 0 < rho < 1:
        raise ValueError(f"rho must be in [0, 1), got {rho}")
    n = shape[-2]
    L = min(n, int(math.ceil(math.log(1e-4) / math.log(rho))) + 1)
    h = math.sqrt(1 - rho * rho) * rho ** torch.arange(L, device=device, dtype=torch.float32)
    size = 1 << (n + L - 1).bit_length()
    x = torch.fft.irfft(torch.fft.rfft(e, size, dim=-2) * torch.fft.rfft(h, size)[:, None], size, dim=-2)[..., :n, :]
    return x.to(dtype).contiguous()  # the slice above is strided; dense SDPA backends refuse that layout


def write_csv(path: str | os.PathLike, rows: list[dict]) -> None:
    """Write rows (dicts with the same keys) as CSV, through a temporary file moved into place (a reader, or a run
    cut while writing, never sees half a file); the folder is created if missing."""
    if not rows:
        return
    keys = list(rows[0].keys())
    for r in rows[1:]:
        keys += [k for k in r if k not in keys]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)
