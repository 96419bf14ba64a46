"""Recorded launch sequences (mita/ops/mita/triton/replay.py): a replayed call gives bitwise what the call itself
gives, on every top-k path, forward and backward; what a recording cannot reproduce is never replayed."""

from __future__ import annotations

import pytest
import torch

from mita.ops.mita.triton import op as tmop
from mita.ops.mita.triton import replay
from mita.ops.mita.triton import topk as ttk

pytestmark = pytest.mark.replay

_CUDA = torch.cuda.is_available()
DEV = "cuda" if _CUDA else "cpu"


def _qkvr(B, H, N, d, m, dtype, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, generator=g) for _ in range(3))
    r = torch.randn(B, H, m, d, generator=g)
    ts = [t.to(DEV, dtype).requires_grad_(True) for t in (q, k, v, r)]
    if strided:
        # q, k, v as the head split of one fused projection: views of a [B, N, 3, H, d] tensor.
        qkv = torch.stack([t.detach().transpose(1, 2) for t in ts[:3]], dim=2).requires_grad_(True)
        ts[:3] = [qkv[:, :, i].transpose(1, 2) for i in range(3)]
    return ts


def _call(q, k, v, r, topk, S, shared):
    o = tmop.triton_mita(q, k, v, r, topk, experts_per_query=S, shared=shared)
    do = torch.linspace(-1, 1, o.numel(), device=o.device).view_as(o).to(o.dtype)
    return (o, *torch.autograd.grad(o, (q, k, v, r), do))


@pytest.fixture
def replayers(monkeypatch):
    """The op's forward and backward wrappers, fresh and allowed to replay under the CPU interpreter."""
    fwd = replay.Replayed(tmop._MiTAFn.in_order, allow_cpu=True)
    bwd = replay.Replayed(tmop.mita_bwd, allow_cpu=True)
    monkeypatch.setattr(tmop, "_fwd_replayed", fwd)
    monkeypatch.setattr(tmop, "_bwd_replayed", bwd)
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    return fwd, bwd


@pytest.mark.parametrize(
    "N,d,m,topk,dtype,S,shared,medium,strided,replays",
    [
        (120, 32, 8, 16, torch.float32, 1, True, None, False, True),  # the on-chip top-k
        (600, 32, 16, 24, torch.bfloat16, 1, True, None, True, True),  # medium rows, fused landmark values
        # Long rows, routing only (90 s under the interpreter; the GPU test covers long rows): slow selection.
        pytest.param(600, 64, 8, 40, torch.float16, 1, False, 0, False, True, marks=pytest.mark.slow),
        (300, 32, 8, 16, torch.float32, 2, True, None, False, True),  # S = 2: PyTorch ops in both passes
    ],
    ids=["small", "medium-strided", "long-routing-only", "S2"],
)
def test_replayed_calls_match_direct_calls(
    monkeypatch, replayers, N, d, m, topk, dtype, S, shared, medium, strided, replays
):
    """Two calls with new values at one signature: the first records, the second replays; each is bitwise what
    the call gives with replay off (forward output and all four gradients), PyTorch ops of the passes (S = 2: the
    forward's merge of the experts' partial outputs, the backward's sum of dq) replayed too."""
    if medium is not None:
        monkeypatch.setattr(ttk, "MEDIUM_N", medium)
    fwd, bwd = replayers
    for seed in range(2):
        ins = _qkvr(2, 2, N, d, m, dtype, seed, strided)
        monkeypatch.setattr(replay, "ENABLED", False)
        want = _call(*ins, topk, S, shared)
        monkeypatch.setattr(replay, "ENABLED", True)
        got = _call(*ins, topk, S, shared)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            assert torch.equal(a, b)
    assert fwd.replays == bwd.replays == (1 if replays else 0)
    assert all((p is not None) == replays for p in (*fwd.programs.values(), *bwd.programs.values()))


def test_a_new_signature_records_again(replayers):
    """Another length, dtype or k is another signature: recorded on its own first call, never given an earlier
    signature's program."""
    fwd, _ = replayers
    for N, dtype, topk in [(200, torch.float32, 16), (200, torch.float32, 16), (210, torch.float32, 16),
                           (200, torch.bfloat16, 16), (200, torch.float32, 12)]:  # fmt: skip
        q, k, v, r = _qkvr(1, 2, N, 32, 8, dtype, 0)
        with torch.no_grad():
            tmop.triton_mita(q, k, v, r, topk)
    assert len(fwd.programs) == 4 and fwd.replays == 1


def _padded_call(q, k, v, r, mask):
    o = tmop.triton_mita(q, k, v, r, 16, key_padding_mask=mask)
    return (o, *torch.autograd.grad(o, (q, k, v, r), torch.ones_like(o)))


@pytest.mark.parametrize(
    "N,medium",
    [(200, None), pytest.param(700, None, marks=pytest.mark.slow), pytest.param(700, 0, marks=pytest.mark.slow)],
    ids=["small", "medium", "long"],
)
def test_padded_calls_are_replayed(monkeypatch, replayers, N, medium):
    """Padded keys: the valid-key counts and the int8 mask are PyTorch ops of the passes, replayed on the new mask
    (a different padding each call), bitwise what the call gives with replay off, forward and backward."""
    if medium is not None:
        monkeypatch.setattr(ttk, "MEDIUM_N", medium)
    fwd, bwd = replayers
    for seed in range(2):
        q, k, v, r = _qkvr(2, 2, N, 32, 8, torch.float32, seed)
        mask = torch.zeros(2, N, dtype=torch.bool, device=DEV)
        mask[1, N - 40 * (seed + 1) :] = True
        mask[0, : 3 * seed] = True

        monkeypatch.setattr(replay, "ENABLED", False)
        want = _padded_call(q, k, v, r, mask)
        monkeypatch.setattr(replay, "ENABLED", True)
        for a, b in zip(_padded_call(q, k, v, r, mask), want):
            assert torch.equal(a, b)
    assert fwd.replays == bwd.replays == 1


def test_unreplayable_ops_are_not_replayed(replayers):
    """An op whose result depends on values (nonzero) makes its signature run as usual every time."""
    rep = replay.Replayed(lambda x: (x > 0).nonzero(), allow_cpu=True)
    x = torch.randn(64)
    for _ in range(2):
        assert torch.equal(rep(x), (x > 0).nonzero())
    assert rep.replays == 0 and list(rep.programs.values()) == [None]


def test_replay_is_off_where_it_must_be(monkeypatch):
    """Off by the switch, and on the CPU unless the interpreter runs and the wrapper allows it."""
    assert not replay.active(torch.device("cpu"))
    monkeypatch.setattr(replay, "ENABLED", False)
    assert not replay.active(torch.device("cpu"), allow_cpu=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "B,H,N,d,m,topk,shared",
    [(2, 6, 1025, 64, 49, 49, True), (2, 2, 4096, 64, 32, 32, True), (4, 2, 2000, 128, 32, 64, True),
     (1, 2, 16384, 64, 64, 64, False), (2, 2, 700, 32, 16, 24, True)],
)  # fmt: skip
def test_gpu_replayed_calls_match_direct_calls(monkeypatch, B, H, N, d, m, topk, shared):
    """On CUDA (direct launches of the recorded binaries): bitwise the results of calls with replay off, three
    calls with new values, forward and backward, with the op's own wrappers."""
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    for wrapper in ("_fwd_replayed", "_bwd_replayed"):
        fresh = replay.Replayed(getattr(tmop, wrapper).fn)
        monkeypatch.setattr(tmop, wrapper, fresh)
    for seed in range(3):
        ins = _qkvr(B, H, N, d, m, torch.bfloat16, seed, strided=seed == 2)
        monkeypatch.setattr(replay, "ENABLED", False)
        want = _call(*ins, topk, 1, shared)
        monkeypatch.setattr(replay, "ENABLED", True)
        got = _call(*ins, topk, 1, shared)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert tmop._fwd_replayed.replays == 1 and tmop._bwd_replayed.replays == 1  # seed 2 is another layout


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N,d,S", [(2000, 128, 1), (1025, 64, 2), (4096, 64, 1)])
def test_gpu_padded_and_two_expert_calls_match_direct_calls(monkeypatch, N, d, S):
    """On CUDA: padded keys (a new padding each call: the replayed valid-key counts and mask) and S = 2 (the
    replayed merges), bitwise the results with replay off, forward and backward."""
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    for wrapper in ("_fwd_replayed", "_bwd_replayed"):
        monkeypatch.setattr(tmop, wrapper, replay.Replayed(getattr(tmop, wrapper).fn))
    for seed in range(3):
        q, k, v, r = _qkvr(4, 2, N, d, 32, torch.bfloat16, seed)
        mask = torch.zeros(4, N, dtype=torch.bool, device=DEV)
        mask[1, N - 100 * (seed + 1) :] = True
        mask[2, : 7 * seed] = True
        monkeypatch.setattr(replay, "ENABLED", False)
        o = tmop.triton_mita(q, k, v, r, 64, key_padding_mask=mask, experts_per_query=S)
        want = (o, *torch.autograd.grad(o, (q, k, v, r), torch.ones_like(o)))
        monkeypatch.setattr(replay, "ENABLED", True)
        o = tmop.triton_mita(q, k, v, r, 64, key_padding_mask=mask, experts_per_query=S)
        for a, b in zip((o, *torch.autograd.grad(o, (q, k, v, r), torch.ones_like(o))), want):
            assert torch.equal(a, b)
    assert tmop._fwd_replayed.replays == 2 and tmop._bwd_replayed.replays == 2
