"""CUDA-graph capture of the MiTA op (landmark pooling included) with the benchmarks' capture helper
(scripts/bench/common.py): replays on new input values give the eager results, forward and forward+backward."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from mita import mita_attention, pool_landmarks


def _bench_common():
    """scripts/bench/common.py (not a package), loaded once per process."""
    if "bench_common" not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "common.py"
        spec = importlib.util.spec_from_file_location("bench_common", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_common"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_common"]


# (N, m, k, S, pooling kwargs): the DeiT-S grid (one prefix token) and a long 1D sequence (N not a multiple of m).
CASES = [
    (197, 25, 25, 1, dict(layout="official", grid=(14, 14), num_prefix_tokens=1)),
    (4097, 32, 64, 2, dict(layout="1d")),
]
B, H, D = 2, 3, 64


def _randn(N: int, seed: int) -> list[torch.Tensor]:
    """q, k, v and an output cotangent, [B, H, N, D] bf16 on the GPU."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g).to("cuda", torch.bfloat16) for _ in range(4)]


def _op(q, k, v, m, topk, S, pool, backend):
    return mita_attention(q, k, v, pool_landmarks(q, m, **pool), topk, experts_per_query=S, backend=backend)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("N,m,topk,S,pool", CASES)
def test_forward_graph_replays_match_eager(backend, N, m, topk, S, pool):
    common = _bench_common()
    static = _randn(N, seed=0)[:3]
    with torch.no_grad():
        graph, out = common.capture_graph(lambda: _op(*static, m, topk, S, pool, backend))
        previous = None
        for seed in (1, 2):
            fresh = _randn(N, seed)[:3]
            for s, f in zip(static, fresh):
                s.copy_(f)
            graph.replay()
            ref = _op(*(f.clone() for f in fresh), m, topk, S, pool, backend)
            # Same kernels on the same values: equal up to a summation order.
            assert _rel_err(out, ref) < 1e-3
            if previous is not None:
                assert _rel_err(out, previous) > 0.5  # the replay read the new inputs
            previous = out.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("N,m,topk,S,pool", CASES)
def test_forward_backward_graph_replays_match_eager(N, m, topk, S, pool):
    """Forward + backward captured together (the leaves' .grad are the graph's static outputs), triton backend."""
    common = _bench_common()
    *qkv, do = _randn(N, seed=0)
    leaves = [t.requires_grad_() for t in qkv]

    def step():
        for t in leaves:
            t.grad = None
        out = _op(*leaves, m, topk, S, pool, "triton")
        out.backward(do)
        return out

    graph, out = common.capture_graph(step)
    for seed in (1, 2):
        *fresh, fresh_do = _randn(N, seed)
        with torch.no_grad():
            for s, f in zip([*leaves, do], [*fresh, fresh_do]):
                s.copy_(f)
        graph.replay()
        ref_in = [f.clone().requires_grad_() for f in fresh]
        ref = _op(*ref_in, m, topk, S, pool, "triton")
        ref_grads = torch.autograd.grad(ref, ref_in, fresh_do)
        assert _rel_err(out, ref) < 1e-3
        for name, t, r in zip("qkv", leaves, ref_grads):
            assert _rel_err(t.grad, r) < 1e-3, name


@pytest.mark.gpu
def test_capture_failure_is_reported_and_timing_recovers():
    """A callable that synchronises cannot be captured: the helper raises, the benchmark's text for the row says
    so, and the next capture and replay timing still work."""
    common = _bench_common()
    x = torch.randn(1024, device="cuda")
    with pytest.raises(RuntimeError) as err:
        common.capture_graph(lambda: (x * 2).sum().item())
    assert common.capture_failure(err.value).startswith("capture failed: ")
    median, spread = common.time_ms(lambda: x * 2, "cuda_graph", warmup=2, reps=5)
    assert median > 0 and spread >= 0


@pytest.mark.gpu
@pytest.mark.exclusive
def test_queued_graph_timing_leaves_out_the_spin():
    """cuda_graph_queued times a replay queued behind a spin kernel: the interval is the replay's own execution
    (the spin, longer than the replay, is not in it), close to the idle-GPU replay of the same graph, and more
    than zero; an unknown timing mode is refused. (Whether it reads below the idle-GPU replay depends on the
    driver batching the start event with the launch: on the H200 with torch 2.11 it read 0.046 against 0.041 ms
    for this graph, so that is not asserted.)"""
    common = _bench_common()
    x = torch.randn(1024, device="cuda")

    def many():
        y = x
        for _ in range(40):
            y = y * 1.0001
        return y

    spin, _ = common.cuda_time(lambda: torch.cuda._sleep(common.QUEUE_CYCLES), warmup=2, reps=10)
    idle, _ = common.time_ms(many, "cuda_graph", warmup=2, reps=20)
    queued, _ = common.time_ms(many, "cuda_graph_queued", warmup=2, reps=20)
    assert 0 < queued < spin, (queued, spin)
    assert 0.5 * idle < queued < 2.0 * idle, (queued, idle)
    with pytest.raises(ValueError):
        common.time_ms(many, "graph", reps=1)
