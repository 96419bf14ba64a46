"""Fused Triton MiTA kernels against naive_mita, forward and backward.

Without a GPU the kernels run under TRITON_INTERPRET=1 at small shapes (the variable is set before the kernel
module is decorated; if something imported it earlier without the interpreter, it is reloaded). On a GPU the
same checks run at N = 63 .. 65536 (marked gpu).
"""

from __future__ import annotations

import functools
import importlib
import math
import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from mita.ops.mita.api import mita_attention, mita_attention_pooled  # noqa: E402
from mita.ops.mita.naive import naive_mita  # noqa: E402
from mita.ops.mita.triton import attention_bwd as abwd  # noqa: E402
from mita.ops.mita.triton import attention_fwd as afwd  # noqa: E402
from mita.ops.mita.triton import backend  # noqa: E402
from mita.ops.mita.triton import common as tc  # noqa: E402
from mita.ops.mita.triton import key_lists as tkl  # noqa: E402
from mita.ops.mita.triton import landmark_values as tlv  # noqa: E402
from mita.ops.mita.triton import op as tmop  # noqa: E402
from mita.ops.mita.triton import plan as tplan  # noqa: E402
from mita.ops.mita.triton import pool as tp  # noqa: E402
from mita.ops.mita.triton import routing as trt  # noqa: E402
from mita.ops.mita.triton import short as ts  # noqa: E402
from mita.ops.mita.triton import short_bwd as tsb  # noqa: E402
from mita.ops.mita.triton import topk as ttk  # noqa: E402
from mita.ops.mita.triton import topk_scan as tks  # noqa: E402
from mita.ops.mita.triton import topk_select as tsel  # noqa: E402

# Every test here runs with poisoned allocations (tests/conftest.py: NaN floats, integers no kernel writes).
pytestmark = pytest.mark.usefixtures("poison")

if not _CUDA and type(afwd._mita_fwd_kernel).__name__ != "InterpretedFunction":
    # Imported earlier without the interpreter: reload the kernel modules, each after the ones it imports from.
    for _mod in (tc, tks, tlv, tsel, ttk, trt, afwd, tplan, abwd, ts, tsb, tp, tmop):
        importlib.reload(_mod)

DEV = "cuda" if _CUDA else "cpu"
# Relative L2 error bounds against the float32 reference (bf16/fp16 operands round P and the output).
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(B, H, N, d, m, dtype, pad_from=None, imbalanced=False, seed=0, strided=False, key_growth=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, generator=g) for _ in range(3))
    if key_growth != 1.0:
        # Key norms growing along N: later key blocks raise the softmax maxima (online-softmax rescaling).
        k = k * torch.linspace(1.0, key_growth, N)[:, None]
    r = torch.randn(B, H, m, d, generator=g)
    if imbalanced:
        # One landmark aligned with a direction every query shares: it takes most queries.
        u = torch.randn(d, generator=g)
        q = q + 2.0 * u
        r[:, :, 0] = 4.0 * u
    mask = None
    if pad_from is not None:
        mask = torch.zeros(B, N, dtype=torch.bool)
        for b, start in enumerate(pad_from):
            mask[b, start:] = True
    ts = [t.to(DEV, dtype).requires_grad_(True) for t in (q, k, v, r)]
    if strided:
        # q, k, v as the head split of one fused projection: views of a [B, N, 3, H, d] tensor.
        qkv = torch.stack([t.detach().transpose(1, 2) for t in ts[:3]], dim=2).requires_grad_(True)
        ts[:3] = [qkv[:, :, i].transpose(1, 2) for i in range(3)]
    return ts, (None if mask is None else mask.to(DEV))


def _check(
    B, H, N, d, m, topk, dtype, S=1, shared=True, pad_from=None, imbalanced=False, seed=0, strided=False, key_growth=1.0
):
    (q, k, v, r), mask = _inputs(B, H, N, d, m, dtype, pad_from, imbalanced, seed, strided, key_growth)
    kw = dict(experts_per_query=S, shared=shared, key_padding_mask=mask)
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(B, H, N, d, generator=g).to(DEV, dtype)
    valid = torch.ones(B, N, dtype=torch.bool, device=DEV) if mask is None else ~mask
    # Callers ignore padded query rows, so their output gradient is zero.
    do = do * valid[:, None, :, None]
    out = tmop.triton_mita(q, k, v, r, topk, **kw)
    grads = torch.autograd.grad(out, (q, k, v, r), do, allow_unused=True)
    ref = naive_mita(q, k, v, r, topk, **kw)
    ref_grads = torch.autograd.grad(ref, (q, k, v, r), do, allow_unused=True)
    tol = TOL[dtype]
    sel = valid[:, None, :, None].expand_as(out)
    # Padded query rows may hold any finite value (the operator's contract), but finite: written.
    assert torch.isfinite(out).all()
    err = _rel(out[sel], ref[sel])
    assert err < tol, f"output rel err {err:.2e} >= {tol:.0e}"
    for name, a, b in zip("q k v landmarks".split(), grads, ref_grads):
        if b is None:
            # Routing-only: the landmarks enter no differentiable path.
            assert a is None or torch.all(a == 0), name
            continue
        assert torch.isfinite(a).all(), name
        if name in ("k", "v") and mask is not None:
            # Padded keys enter no logit and no value: their gradients are exactly zero.
            assert (a.transpose(1, 2)[mask] == 0).all(), f"d{name} of padded keys"
        e = _rel(a, b)
        assert e < 2 * tol, f"d{name} rel err {e:.2e} >= {2 * tol:.0e}"
    return out, grads


CPU_CASES = [
    # (B, H, N, d, m, topk, dtype, S, shared, pad_from)
    (1, 2, 63, 32, 4, 8, torch.float32, 1, True, None),
    (1, 2, 63, 32, 4, 100, torch.bfloat16, 1, True, None),
    (2, 1, 70, 32, 5, 7, torch.float16, 2, True, (70, 33)),
    (2, 1, 63, 32, 4, 16, torch.bfloat16, 1, False, (50, 20)),
    (1, 1, 197, 64, 9, 9, torch.float32, 1, True, None),
    (1, 1, 40, 128, 4, 8, torch.float32, 2, False, None),
]


@pytest.fixture(params=["short", "general"])
def path(request, monkeypatch):
    """Run a test on the short-sequence kernels (triton/short.py) and on the general sparse path."""
    monkeypatch.setattr(tmop, "SHORT_PATH", request.param == "short")
    return request.param


@pytest.mark.parametrize("B,H,N,d,m,topk,dtype,S,shared,pad_from", CPU_CASES)
def test_matches_naive(path, B, H, N, d, m, topk, dtype, S, shared, pad_from):
    _check(B, H, N, d, m, topk, dtype, S, shared, pad_from)


_LAZY_CASES = [
    (1, 2, 200, 32, 16, 32, torch.bfloat16, 1, True, None),  # FULL: no masks in the fused forward
    (1, 1, 1024, 32, 64, 64, torch.float32, 1, True, None),  # and the block-top pass without masks (even)
    (2, 1, 300, 32, 16, 32, torch.float16, 1, True, (300, 140)),  # padding: the masked forms
    (1, 2, 130, 64, 40, 9, torch.bfloat16, 2, True, None),  # S = 2: the shared slot mask
    (1, 1, 600, 32, 8, 40, torch.float32, 1, False, None),  # routing-only, long-row top-k
]


@pytest.mark.parametrize(
    "B,H,N,d,m,topk,dtype,S,shared,pad_from,growth",
    [
        # The 1024-key case without key growth (80 s under the interpreter) adds no branch the others miss.
        pytest.param(*case, growth, marks=pytest.mark.slow) if case[2] == 1024 and growth == 1.0 else (*case, growth)
        for case in _LAZY_CASES
        for growth in (1.0, 12.0)
    ],
)
def test_general_lazy_softmax_matches_naive(
    monkeypatch, triton_launches, B, H, N, d, m, topk, dtype, S, shared, pad_from, growth
):
    """SCAN_CONFIG lv_lazy 1 (the block-top pass unmasked, its landmark values rescaled lazily) with the fused
    forward's softmax, forward and backward; key norms growing 12x along N make later blocks raise the maxima, so
    the rescaling branch runs. Rows of 1024 keys take the long-row path here (MEDIUM_N 0), whose block-top pass this
    is about."""
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    monkeypatch.setattr(ttk, "MEDIUM_N", 0)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "lv_lazy", 1)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "lv_div", 4)
    _check(B, H, N, d, m, topk, dtype, S, shared, pad_from, key_growth=growth)
    fwd = [kw for name, kw in triton_launches.kwargs if name == "_mita_fwd_kernel"]
    assert len(fwd) == 1
    # The unmasked forms where the shape allows them (first two cases), else the masked ones.
    assert fwd[0]["FULL"] == (pad_from is None and S == 1 and shared and m % 16 == 0 and topk % 32 == 0)
    scans = [kw for name, kw in triton_launches.kwargs if name == "_topk_scan_kernel" and kw["MODE"] == 0]
    assert any(kw["EVEN"] and kw["LAZY"] for kw in scans) == (N == 1024)


@pytest.mark.parametrize(
    "B,H,N,d,m,topk,dtype,S,shared,pad_from",
    [
        (1, 2, 200, 32, 16, 32, torch.bfloat16, 1, True, None),  # FULL
        (2, 1, 300, 32, 16, 32, torch.float16, 1, True, (300, 140)),  # padding: the masked forms
        (1, 2, 130, 64, 40, 9, torch.bfloat16, 2, True, None),  # S = 2: the shared slot mask
    ],
)
def test_fma_softmax_matches_naive(monkeypatch, triton_launches, B, H, N, d, m, topk, dtype, S, shared, pad_from):
    """The fused forward's softmax (the scale in the exponent's FMA, every block rescaled), forward and backward,
    with key norms growing along N (later blocks raise the maxima)."""
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    _check(B, H, N, d, m, topk, dtype, S, shared, pad_from, key_growth=12.0)
    fwd = [kw for name, kw in triton_launches.kwargs if name == "_mita_fwd_kernel"]
    assert len(fwd) == 1


def test_forward_launch_settings(monkeypatch):
    """The fused forward's launch options: 2 stages and a 96-register cap for 64-row tiles of 64-key blocks at d 64
    (measured on the H200), the compiler's choice elsewhere; FWD_CONFIG overrides both, 0 meaning none."""
    assert afwd._fwd_launch(64, 64, 64) == dict(num_warps=4, maxnreg=96, num_stages=2)
    assert afwd._fwd_launch(64, 32, 128) == dict(num_warps=8)
    assert afwd._fwd_launch(32, 64, 64) == dict(num_warps=4)
    monkeypatch.setitem(afwd.FWD_CONFIG, "maxnreg", 0)
    monkeypatch.setitem(afwd.FWD_CONFIG, "num_stages", 3)
    assert afwd._fwd_launch(64, 64, 64) == dict(num_warps=4, num_stages=3)
    monkeypatch.setitem(afwd.FWD_CONFIG, "maxnreg", 128)
    monkeypatch.setitem(afwd.FWD_CONFIG, "num_stages", 0)
    assert afwd._fwd_launch(16, 16, 32) == dict(num_warps=4, maxnreg=128)


@pytest.mark.parametrize("dtype,S,pad_from", [(torch.float32, 1, None), (torch.bfloat16, 2, (300, 120))])
def test_inference_plan_tile(monkeypatch, dtype, S, pad_from):
    """FWD_CONFIG bm_infer: a forward no backward follows (grad mode off, or no input needing a gradient) builds its
    plan with bm_infer-row tiles; a forward that may be differentiated keeps bm_max's, and both match the
    reference."""
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    monkeypatch.setitem(afwd.FWD_CONFIG, "bm_max", 16)
    monkeypatch.setitem(afwd.FWD_CONFIG, "bm_infer", 64)
    tiles = []
    real_fwd = tmop.mita_fwd

    def spy(*a, **kw):
        tiles.append(a[5].bm)
        return real_fwd(*a, **kw)

    monkeypatch.setattr(tmop, "mita_fwd", spy)
    (q, k, v, r), mask = _inputs(2, 1, 300, 32, 2, dtype, pad_from, seed=4)
    kw = dict(experts_per_query=S, key_padding_mask=mask)
    ref = naive_mita(q, k, v, r, 40, **kw)
    with torch.no_grad():
        out = tmop.triton_mita(q, k, v, r, 40, **kw)
    assert tiles == [64]
    assert _rel(out, ref) < TOL[dtype]
    detached = [t.detach() for t in (q, k, v, r)]
    out = tmop.triton_mita(*detached, 40, **kw)
    assert tiles == [64, 64]
    assert _rel(out, ref) < TOL[dtype]
    _check(2, 1, 300, 32, 2, 40, dtype, S, True, pad_from, seed=4)
    assert tiles[2:] == [16]


@pytest.mark.parametrize(
    "B,H,N,d,m,topk,dtype,S,shared,pad_from",
    [
        (2, 2, 197, 64, 25, 25, torch.bfloat16, 1, True, None),
        (2, 1, 100, 64, 7, 30, torch.float32, 2, True, (100, 3)),
        (1, 1, 50, 32, 3, 8, torch.float16, 1, True, (0,)),
        (1, 1, 17, 32, 20, 3, torch.float32, 3, False, None),
    ],
)
def test_short_path_matches_naive(B, H, N, d, m, topk, dtype, S, shared, pad_from):
    """The short-sequence kernels at DeiT-S's shape, with S = 2 and padding, an all-padding row, and m > N."""
    assert ts.small_supported(N, m, d)
    _check(B, H, N, d, m, topk, dtype, S, shared, pad_from)


def test_short_path_limits():
    assert ts.small_supported(197, 25, 64) and ts.small_supported(256, 32, 64)
    assert not ts.small_supported(257, 25, 64)
    assert not ts.small_supported(197, 49, 64)
    assert not ts.small_supported(197, 25, 128) and ts.small_supported(128, 16, 128)


def test_short_path_last_block_size():
    """The separate last key / query block of the short kernels: N % block rounded up to a power of two (at least
    16) with ``tail`` on; none (0: the last block is a whole one, masked) with it off, when the block divides N or
    when the rounding reaches the block."""
    assert (ts.CONFIG["attn"]["tail"], ts.CONFIG["bwd"]["tail"]) == (1, 0)
    assert [ts._tail(n, 64, "attn") for n in (197, 150, 100, 128, 64, 65, 81)] == [16, 32, 0, 0, 0, 16, 32]
    assert ts._tail(17, 32, "attn") == 0
    assert [ts._tail(n, 64, "bwd") for n in (197, 150, 128)] == [0, 0, 0]


def test_short_path_launch_settings(monkeypatch):
    """short.CONFIG to launch keywords: block sizes capped at the padded length, ``tail`` left to ``_tail``, a
    ``maxnreg`` cap passed only when set (the interpreter takes and ignores it)."""
    assert ts._cfg("attn", 32)["BM"] == 32 and "tail" not in ts._cfg("attn", 256)
    assert ts._cfg("attn", 256)["maxnreg"] == ts._cfg("route", 256)["maxnreg"] == 168
    assert "maxnreg" not in ts._cfg("bwd", 256)
    monkeypatch.setitem(ts.CONFIG["route"], "maxnreg", None)
    assert "maxnreg" not in ts._cfg("route", 256)
    monkeypatch.setitem(ts.CONFIG["route"], "maxnreg", 128)
    assert ts._cfg("route", 256)["maxnreg"] == 128
    _check(1, 2, 197, 64, 25, 25, torch.bfloat16)


@pytest.mark.parametrize(
    "N,m,topk,S,pad_from", [(197, 25, 25, 1, None), (150, 30, 20, 2, (150, 131)), (100, 9, 12, 1, (100, 40))]
)
def test_short_route_one_program_per_head(monkeypatch, N, m, topk, S, pad_from):
    """The route kernel with 32 landmark rows per program (one program per head where m <= 32; what the speed
    survey times against 16) against naive_mita, forward and backward, with padding and S = 2."""
    monkeypatch.setitem(ts.CONFIG["route"], "BS", 32)
    monkeypatch.setitem(ts.CONFIG["route"], "num_warps", 8)
    # Capped at the padded landmark count (16 for m <= 16): never more rows per program than there are.
    assert ts._cfg("route", 16)["BS"] == 16 and ts._cfg("route", 32)["BS"] == 32
    _check(2, 2, N, 64, m, topk, torch.bfloat16, S, True, pad_from)


@pytest.mark.parametrize("N,m,topk,S,pad_from", [(197, 25, 25, 1, None), (150, 30, 20, 2, (150, 131))])
def test_short_attention_128_query_rows(monkeypatch, N, m, topk, S, pad_from):
    """The short attention kernel with 128-query blocks at 8 warps (two programs per head at N = 197, one form the
    speed survey times), against naive_mita."""
    monkeypatch.setitem(ts.CONFIG["attn"], "BM", 128)
    monkeypatch.setitem(ts.CONFIG["attn"], "num_warps", 8)
    _check(2, 2, N, 64, m, topk, torch.bfloat16, S, True, pad_from)


@pytest.mark.parametrize("bm,bn", [(32, 64), (32, 32)])
@pytest.mark.parametrize("N,m,topk,S,pad_from", [(197, 25, 25, 1, None), (150, 30, 20, 2, (150, 131))])
def test_short_backward_tiles(monkeypatch, bm, bn, N, m, topk, S, pad_from):
    """The short backward with 32-row query blocks (and 32-key blocks) at 8 warps, the forms the speed survey times
    against 64 x 64 at 4 warps (two programs per SM under a 128-register cap), against naive_mita."""
    monkeypatch.setitem(ts.CONFIG["bwd"], "BM", bm)
    monkeypatch.setitem(ts.CONFIG["bwd"], "BN", bn)
    monkeypatch.setitem(ts.CONFIG["bwd"], "num_warps", 8)
    _check(2, 2, N, 64, m, topk, torch.bfloat16, S, True, pad_from)


@pytest.mark.parametrize("tail", [0, 1])
@pytest.mark.parametrize(
    "B,N,m,topk,dtype,S,shared,pad_from",
    [
        (2, 150, 9, 20, torch.bfloat16, 2, True, (150, 131)),  # 2 x 64 + 22: a 32-row last block
        (1, 197, 25, 25, torch.float32, 1, False, None),  # 3 x 64 + 5: a 16-row last block, routing only
        (1, 81, 6, 12, torch.float16, 1, True, None),  # 64 + 17: a 32-row last block
    ],
)
def test_short_path_last_block(monkeypatch, tail, B, N, m, topk, dtype, S, shared, pad_from):
    """Both last-block forms of the short kernels (``tail``) against naive_mita, forward and backward."""
    monkeypatch.setitem(ts.CONFIG["attn"], "tail", tail)
    monkeypatch.setitem(ts.CONFIG["bwd"], "tail", tail)
    assert ts.small_supported(N, m, 64)
    _check(B, 2, N, 64, m, topk, dtype, S, shared, pad_from)


def test_imbalanced_routing(path):
    (q, k, v, r), _ = _inputs(1, 1, 96, 32, 6, torch.float32, imbalanced=True)
    route = torch.argmax(q.detach() @ r.detach().transpose(-1, -2), dim=-1)
    assert (route == 0).float().mean() > 0.8, "the test input is meant to send most queries to one expert"
    _check(1, 1, 96, 32, 6, 12, torch.float32, imbalanced=True)


def test_padding_appended_does_not_change_valid_outputs():
    (q, k, v, r), _ = _inputs(1, 1, 48, 32, 4, torch.float32, seed=3)
    extra = [torch.randn(1, 1, 17, 32, device=DEV) for _ in range(3)]
    q2, k2, v2 = (torch.cat([t.detach(), e], dim=2) for t, e in zip((q, k, v), extra))
    mask2 = torch.zeros(1, 65, dtype=torch.bool, device=DEV)
    mask2[:, 48:] = True
    o1 = tmop.triton_mita(q, k, v, r, 60)
    o2 = tmop.triton_mita(q2, k2, v2, r.detach(), 60, key_padding_mask=mask2)
    assert _rel(o2[:, :, :48], o1) < 1e-5


def test_ties_go_to_lower_index():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -0.0, 0.0, float("-inf")]])
    assert sorted(tplan.topk_lowest_index(scores, 2).tolist()[0]) == [1, 2]
    assert sorted(tplan.topk_lowest_index(scores, 4).tolist()[0]) == [1, 2, 3, 4]
    assert sorted(tplan.topk_lowest_index(scores, 6).tolist()[0]) == [0, 1, 2, 3, 4, 5]
    ref = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :6]
    assert sorted(ref.tolist()[0]) == [0, 1, 2, 3, 4, 5]


def test_duplicate_keys_tie_break_matches_naive(path):
    (q, k, v, r), _ = _inputs(1, 1, 64, 32, 4, torch.float32, seed=5)
    with torch.no_grad():
        # Every key appears twice: top-k must take the lower copy of each tied pair, as naive_mita does.
        k[:, :, 32:] = k[:, :, :32]
    out = tmop.triton_mita(q, k, v, r, 5)
    assert _rel(out, naive_mita(q, k, v, r, 5)) < 1e-4


def test_backward_is_deterministic(path):
    (q, k, v, r), _ = _inputs(1, 2, 80, 32, 4, torch.float32, seed=7)
    do = torch.randn_like(q)
    g1 = torch.autograd.grad(tmop.triton_mita(q, k, v, r, 30, experts_per_query=2), (q, k, v, r), do)
    g2 = torch.autograd.grad(tmop.triton_mita(q, k, v, r, 30, experts_per_query=2), (q, k, v, r), do)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_supports_and_dispatch():
    x = torch.randn(1, 1, 8, 100, device=DEV)
    assert "head dim 100" in backend.supports(x, x, x, x[:, :, :2], 4)
    y = torch.randn(1, 1, 8, 32, dtype=torch.float64, device=DEV)
    assert "dtype" in backend.supports(y, y, y, y[:, :, :2], 4)
    from mita.ops.mita.api import register_triton

    register_triton(backend)
    (q, k, v, r), _ = _inputs(1, 1, 32, 32, 4, torch.float32, seed=9)
    with torch.no_grad():
        out = mita_attention(q, k, v, r, 8, backend="triton")
        assert _rel(out, naive_mita(q, k, v, r, 8)) < 1e-4


@pytest.mark.parametrize(
    "N,S,pad_from,dtype",
    [(600, 1, None, torch.float32), (600, 2, (600, 450), torch.bfloat16), (520, 1, (300, 520), torch.float16),
     (100, 1, (60, 100), torch.float32)],
)  # fmt: skip
def test_strided_qkv_match_naive(monkeypatch, N, S, pad_from, dtype):
    """q, k, v as views of one [B, N, 3, H, d] projection: the kernels read them in place (no copy reaches mita_fwd
    and mita_bwd, or small_fwd and small_bwd at N = 100, the short path) and write the output in [B, N, H, d] order;
    forward and backward match naive_mita."""
    seen = []

    def spy(module, name, pos):
        real = getattr(module, name)

        def fn(*a, **kw):
            seen.append((name, a[pos].stride()))  # q's strides
            return real(*a, **kw)

        monkeypatch.setattr(module, name, fn)

    # op calls them (the autograd functions live there).
    for name, pos in (("mita_fwd", 0), ("mita_bwd", 1), ("small_fwd", 0), ("small_bwd", 1)):
        spy(tmop, name, pos)
    B, H, d = 2, 3, 32
    out, _ = _check(B, H, N, d, 6, 20, dtype, S, True, pad_from, strided=True)
    qkv = (N * 3 * H * d, d, 3 * H * d, 1)
    assert seen == ([("mita_fwd", qkv), ("mita_bwd", qkv)] if N > 256 else [("small_fwd", qkv), ("small_bwd", qkv)])
    assert out.transpose(1, 2).is_contiguous()


def test_kernel_layout_copies_only_mixed_layouts():
    x = torch.randn(2, 50, 3, 4, 16)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    assert all(a is b for a, b in zip(tmop.kernel_layout(q, k, v), (q, k, v)))
    assert tc.heads_layout(q, k) == (4, 50 * 3 * 4 * 16, 16, 3 * 4 * 16)
    assert tc.heads_layout(q.reshape(8, 50, 16)) == (1, 50 * 16, 0, 16)
    with pytest.raises(ValueError, match="share shape and strides"):
        tc.heads_layout(q.contiguous(), k)
    mixed = tmop.kernel_layout(q.contiguous(), k, v)
    assert all(t.is_contiguous() for t in mixed) and all(torch.equal(a, b) for a, b in zip(mixed, (q, k, v)))


GPU_SHAPES = [(63, 4, 8), (197, 25, 25), (1025, 49, 49), (4097, 32, 32), (65536, 64, 64)]


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N,m,topk,S,pad", [(197, 25, 25, 1, True), (4097, 32, 32, 2, True), (65536, 64, 64, 1, False)])
def test_gpu_strided_matches_naive(N, m, topk, S, pad):
    """The head split of one fused projection (q, k, v read in place, output in [B, N, H, d] order) at GPU sizes:
    the short path (N = 197), the long path with S = 2 and padding, and 64K; forward and backward."""
    _check(2, 3, N, 64, m, topk, torch.bfloat16, S, True, (N, N - 100) if pad else None, strided=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize(
    "N,m,topk,short", [(*s, short) for s in GPU_SHAPES for short in (True, False)[: 1 + (s[0] <= 256)]]
)
def test_gpu_matches_naive(monkeypatch, N, m, topk, short, d):
    monkeypatch.setattr(tmop, "SHORT_PATH", short)
    H = 2 if N <= 4097 else 1
    _check(1, H, N, d, m, topk, torch.bfloat16)


@pytest.mark.parametrize("mode", [0, 3])
def test_route_stream_setting_on_cpu(monkeypatch, mode):
    """FWD_CONFIG route_stream needs CUDA streams; off CUDA the routing runs in order as before (same result)."""
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    monkeypatch.setitem(afwd.FWD_CONFIG, "route_stream", mode)
    _check(1, 2, 200, 32, 16, 32, torch.float32)


def test_route_stream_rejects_unknown_mode(monkeypatch):
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    monkeypatch.setitem(afwd.FWD_CONFIG, "route_stream", 4)
    (q, k, v, r), _ = _inputs(1, 1, 200, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="route_stream"):
        tmop.triton_mita(q, k, v, r, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("mode", [3])
@pytest.mark.parametrize("N,m,topk,S", [(4097, 64, 64, 1), (65536, 128, 128, 1), (4097, 32, 32, 2), (300, 16, 16, 1)])
def test_gpu_route_stream_same_output(monkeypatch, N, m, topk, S, mode):
    """FWD_CONFIG route_stream (routing on a second stream): bitwise the output of the in-order forward, eagerly,
    with a backward, and replayed from a CUDA graph (the fork and join captured). Below ROUTE_STREAM_MIN_N too
    (the threshold set to 0), where the default runs in order."""
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    monkeypatch.setattr(afwd, "ROUTE_STREAM_MIN_N", 0)
    (q, k, v, r), _ = _inputs(1, 2, N, 64, m, torch.bfloat16)
    kw = dict(experts_per_query=S)
    do = torch.randn_like(q)
    monkeypatch.setitem(afwd.FWD_CONFIG, "route_stream", 0)
    ref = tmop.triton_mita(q, k, v, r, topk, **kw)
    ref_g = torch.autograd.grad(ref, (q, k, v, r), do)
    monkeypatch.setitem(afwd.FWD_CONFIG, "route_stream", mode)
    out = tmop.triton_mita(q, k, v, r, topk, **kw)
    assert torch.equal(out, ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v, r), do), ref_g):
        assert torch.equal(a, b)
    qd, kd, vd, rd = (t.detach() for t in (q, k, v, r))
    with torch.no_grad():
        tmop.triton_mita(qd, kd, vd, rd, topk, **kw)  # warm-up (compiles) outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = tmop.triton_mita(qd, kd, vd, rd, topk, **kw)
        got.zero_()
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, ref.detach())


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("route_stream", [3, 0])
@pytest.mark.parametrize("N,m,topk", [(200, 16, 25), (336, 32, 64), (1500, 32, 64)])
def test_gpu_graph_replay_with_padding_and_backward(monkeypatch, N, m, topk, route_stream):
    """Forward and backward of padded rows (the LRA steps' form: the short path, the general path with the on-chip
    top-k, the long-row top-k), captured once in a CUDA graph and replayed on new values copied into the captured
    inputs: bitwise what eager calls give for the same values (both FWD_CONFIG route_stream forms, the second stream
    also below ROUTE_STREAM_MIN_N)."""
    monkeypatch.setitem(afwd.FWD_CONFIG, "route_stream", route_stream)
    monkeypatch.setattr(afwd, "ROUTE_STREAM_MIN_N", 0)
    B, H, d = 4, 2, 32
    pad = tuple(N - 7 * b for b in range(B))
    (q, k, v, r), mask = _inputs(B, H, N, d, m, torch.bfloat16, pad_from=pad)
    (q2, k2, v2, r2), _ = _inputs(B, H, N, d, m, torch.bfloat16, pad_from=pad, seed=1)
    do = torch.randn_like(q)

    def call():
        o = mita_attention(q, k, v, r, topk, key_padding_mask=mask, backend="triton")
        return (o, *torch.autograd.grad(o, (q, k, v, r), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call()
    with torch.no_grad():
        for dst, src in zip((q, k, v, r), (q2, k2, v2, r2)):
            dst.copy_(src)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    want = call()
    for name, a, b in zip(("o", "dq", "dk", "dv", "dR"), got, want):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "N,m,topk,pad_from", [(4097, 64, 64, None), (65536, 128, 128, None), (4097, 64, 64, (4097, 3000))]
)
@pytest.mark.parametrize("growth", [1.0, 12.0])
def test_gpu_lazy_softmax_matches_naive(monkeypatch, N, m, topk, pad_from, growth):
    """SCAN_CONFIG lv_lazy 1 with the fused forward's softmax on the GPU (unmasked and masked forms)."""
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "lv_lazy", 1)
    _check(1 if pad_from is None else 2, 2, N, 64, m, topk, torch.bfloat16, pad_from=pad_from, key_growth=growth)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "N,m,topk,dtype,S,shared,pad_from,imbalanced",
    [
        (197, 25, 300, torch.float16, 1, True, (197, 120), False),
        (197, 25, 25, torch.bfloat16, 2, True, (197, 150), True),
        (197, 16, 40, torch.float32, 1, False, None, False),
        (1025, 49, 24, torch.bfloat16, 2, True, (1025, 700), False),
        (1025, 49, 98, torch.bfloat16, 1, False, (900, 1025), False),
        (4097, 32, 64, torch.float16, 1, True, None, True),
        (4097, 64, 32, torch.float32, 2, False, None, False),
    ],
)
def test_gpu_variants(N, m, topk, dtype, S, shared, pad_from, imbalanced):
    _check(2, 2, N, 64, m, topk, dtype, S, shared, pad_from, imbalanced)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("S,pad", [(1, False), (2, True)])
def test_gpu_short_backward_modes(monkeypatch, S, pad):
    """The short-path backward kernel at DeiT-S's shape (bf16) against naive_mita, and bitwise repeatable."""
    monkeypatch.setattr(tmop, "SHORT_PATH", True)
    _, grads = _check(2, 6, 197, 64, 25, 25, torch.bfloat16, S, True, (197, 150) if pad else None)
    _, again = _check(2, 6, 197, 64, 25, 25, torch.bfloat16, S, True, (197, 150) if pad else None)
    for a, b in zip(grads, again):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "settings",
    [
        {"attn.tail": 0, "bwd.tail": 0, "route.maxnreg": None, "attn.maxnreg": None},
        {"attn.tail": 1, "bwd.tail": 1, "route.maxnreg": 168, "attn.maxnreg": 168},
        {"route.maxnreg": 128, "bwd.maxnreg": 168},
        {"bwd.BM": 32, "bwd.BN": 32, "bwd.maxnreg": 168},
    ],
    ids=["tail0-uncapped", "tail1-capped", "route128-bwd168", "bwd32x32-168"],
)
@pytest.mark.parametrize("S,pad", [(1, False), (2, True)])
def test_gpu_short_path_settings(monkeypatch, settings, S, pad):
    """The short kernels' launch settings that a benchmark chooses between (``short.CONFIG``: the last-block forms,
    register caps, the backward's tiles) at DeiT-S's shape (bf16) against naive_mita, forward and backward."""
    monkeypatch.setattr(tmop, "SHORT_PATH", True)
    for key, value in settings.items():
        kernel, name = key.split(".")
        monkeypatch.setitem(ts.CONFIG[kernel], name, value)
    _check(2, 6, 197, 64, 25, 25, torch.bfloat16, S, True, (197, 150) if pad else None)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
def test_gpu_backward_is_deterministic():
    (q, k, v, r), _ = _inputs(2, 2, 8192, 64, 32, torch.bfloat16, seed=11)
    do = torch.randn_like(q)
    g1 = torch.autograd.grad(tmop.triton_mita(q, k, v, r, 256), (q, k, v, r), do)
    g2 = torch.autograd.grad(tmop.triton_mita(q, k, v, r, 256), (q, k, v, r), do)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    assert math.isfinite(sum(float(a.float().norm()) for a in g1))


def _reference_plan(route: torch.Tensor, m: int, bm: int, T: int):
    """The routing plan written out with a stable sort and a loop over experts (CPU)."""
    route = route.cpu().long()
    BH = route.shape[0]
    rows = torch.sort(route, dim=-1, stable=True).indices.int()
    starts = torch.zeros(BH, m + 1, dtype=torch.int32)
    tile_e = torch.full((BH, T), -1, dtype=torch.int32)
    tile_rs = torch.zeros(BH, T, dtype=torch.int32)
    tile_re = torch.zeros(BH, T, dtype=torch.int32)
    for b in range(BH):
        cnt = torch.bincount(route[b], minlength=m)
        starts[b, 1:] = torch.cumsum(cnt, 0)
        t = 0
        for e in range(m):
            for r0 in range(int(starts[b, e]), int(starts[b, e + 1]), bm):
                tile_e[b, t], tile_rs[b, t], tile_re[b, t] = e, r0, int(starts[b, e + 1])
                t += 1
    return rows, starts, tile_e, tile_rs, tile_re


# Plan settings of the plan tests (module constants). Chunked: steps of 16 rows; about 64 programs over the (batch,
# head) pairs (1 .. 4 steps per chunk here); "rows": chunks capped at 3 steps (21 .. 63 chunks), offsets in steps
# of 2 chunks over blocks of 16 experts; "few": two chunks of 7 or 8 steps per (batch, head). "local": the
# one-launch plan with 16-row chunks and histograms of 64 rows (several of each per head).
_CHUNKED = {"LOCAL_MAX": 0, "STEP": 16, "PROGRAMS": 64}
_PLAN_SETTINGS = {
    None: {},
    "chunked": _CHUNKED,
    "rows": dict(_CHUNKED, PROGRAMS=3, ROWS=48, EXPERTS=16, OFFSETS_BLOCK=32),
    "few": dict(_CHUNKED, PROGRAMS=6),
    "local": {"LOCAL_ROWS": 16, "COUNT_STEP": 64},
}


@pytest.mark.parametrize(
    "N,m,S,dist,chunked",
    [(197, 25, 1, "uniform", None), (70, 5, 2, "imbalanced", None), (300, 40, 3, "uniform", None),
     (197, 25, 1, "uniform", "chunked"), (70, 5, 2, "imbalanced", "chunked"), (1100, 5, 1, "imbalanced", "chunked"),
     (300, 40, 3, "uniform", "chunked"), (300, 300, 3, "uniform", "chunked"), (1001, 70, 1, "imbalanced", "rows"),
     (999, 40, 1, "one", "rows"), (733, 1, 1, "uniform", "rows"), (230, 33, 1, "uniform", "few"),
     (200, 3, 1, "one", "few"), (197, 25, 1, "uniform", "local"), (110, 40, 3, "imbalanced", "local"),
     (70, 5, 2, "one", "local")],
)  # fmt: skip
def test_plan_matches_reference(monkeypatch, N, m, S, dist, chunked):
    """Both plan builders (the one-launch plan, default here and "local"; the chunked three-kernel counting sort
    with several steps per chunk, partial last steps and chunks, many chunks, offsets over several blocks of
    chunks and of experts, an expert spanning many chunks, every row on one expert) against a stable sort and a
    loop over experts."""
    g = torch.Generator().manual_seed(N + m)
    BH = 3
    route = torch.randint(0, m, (BH, N * S), generator=g, dtype=torch.int32)
    if dist == "imbalanced":
        route[:, : N * S * 3 // 4] = 1
    elif dist == "one":
        route[:] = m - 1
    route = route.to(DEV)
    idx = torch.zeros(BH, m, 4, dtype=torch.int32, device=DEV)
    for name, value in _PLAN_SETTINGS[chunked].items():
        monkeypatch.setattr(tplan, f"_PLAN_{name}", value)
    plan = tplan.build_plan(idx, route, m)
    T = plan.tile_e.shape[1]
    rows, starts, tile_e, tile_rs, tile_re = _reference_plan(route, m, plan.bm, T)
    assert torch.equal(plan.rows.cpu(), rows)
    assert torch.equal(plan.starts.cpu(), starts)
    assert torch.equal(plan.tile_e.cpu(), tile_e)
    live = tile_e >= 0
    assert torch.equal(plan.tile_rs.cpu()[live], tile_rs[live])
    assert torch.equal(plan.tile_re.cpu()[live], tile_re[live])


@pytest.mark.parametrize("BH,nrows,m,local", [(3, 197, 25, True), (2, 1100, 250, False)])
@pytest.mark.parametrize("dist", ["uniform", "one"])
def test_plan_rows_and_starts_are_a_stable_sort_of_the_routes(monkeypatch, BH, nrows, m, local, dist):
    """build_plan on each plan path (the one-launch plan at 3 x 197 rows; the chunked one at 2 x 1100), on uniform
    routes and with every row on one expert: rows equal a stable torch.sort of the routes, starts the running count
    per expert."""
    if not local:
        monkeypatch.setattr(tplan, "_PLAN_LOCAL_MAX", 0)
    g = torch.Generator().manual_seed(nrows + m)
    if dist == "uniform":
        route = torch.randint(0, m, (BH, nrows), generator=g)
    else:
        route = torch.full((BH, nrows), m // 2)
    route = route.to(dtype=torch.int32)
    plan = tplan.build_plan(torch.zeros(BH, m, 1, dtype=torch.int32, device=DEV), route.to(DEV), m)
    rows = torch.sort(route.long(), dim=-1, stable=True).indices.int()
    cnt = torch.zeros(BH, m, dtype=torch.long)
    cnt.scatter_add_(1, route.long(), torch.ones_like(route, dtype=torch.long))
    starts = torch.cat([torch.zeros_like(cnt[:, :1]), cnt.cumsum(1)], 1).int()
    assert torch.equal(plan.rows.cpu(), rows)
    assert torch.equal(plan.starts.cpu(), starts)


@pytest.mark.parametrize(
    "BH,N,m,topk,pad", [(2, 70, 5, 9, 0), (3, 130, 49, 12, 3), (1, 40, 32, 8, 0), (2, 90, 100, 5, 2)]
)
def test_key_lists_kernels_match_stable_sort(monkeypatch, BH, N, m, topk, pad):
    """The backward's per-key lists from the mask / prefix / place kernels equal a stable sort's:
    one or several 32-bit words of experts (m 5, 32, 49, 100), rows with fewer valid keys than topk (-1 slots)."""
    g = torch.Generator().manual_seed(N + m)
    idx = torch.sort(torch.rand(BH, m, N, generator=g).argsort(-1)[..., :topk].int(), -1).values
    if pad:
        idx[:, :pad, topk - 2 :] = -1
    idx = idx.to(DEV).contiguous()
    monkeypatch.setattr(tkl, "_MATCH_MAX", 0)
    csr, ptr_t, pos_t, _ = tkl._key_lists(idx, N)
    # The lists as a stable sort of the keys gives them (padding slots last).
    flat_s = torch.where(idx.view(BH, -1) < 0, N, idx.view(BH, -1)).long().cpu()
    sorted_s, perm_s = torch.sort(flat_s, dim=-1, stable=True)
    ptr_s = torch.searchsorted(sorted_s, torch.arange(N + 1).expand(BH, N + 1).contiguous()).int()
    pos_s = torch.empty_like(perm_s)
    pos_s.scatter_(1, perm_s, torch.arange(perm_s.shape[1]).expand(BH, -1))
    assert csr
    assert torch.equal(ptr_t.cpu(), ptr_s)
    valid = idx.view(BH, -1).cpu() >= 0
    assert torch.equal(pos_t.cpu()[valid].long(), pos_s[valid])
    # Each key's slots sit at its own rows, in ascending expert order.
    flat = idx.view(BH, -1).cpu().long()
    for b in range(BH):
        for j in range(N):
            at = pos_t[b].cpu()[valid[b] & (flat[b] == j)]
            assert torch.equal(at, torch.arange(int(ptr_t[b, j]), int(ptr_t[b, j + 1]), dtype=at.dtype))


@pytest.mark.parametrize("S,shared,pad", [(1, True, False), (2, True, True), (1, False, False)])
def test_backward_match_and_csr_reductions_agree(monkeypatch, S, shared, pad):
    """The per-key reduction by matching and through the CSR lists (from the lists' kernels, and from the stable sort
    that long rows and more than 128 experts take) give the same gradients to the bit."""
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    (q, k, v, r), mask = _inputs(2, 1, 90, 32, 6, torch.float32, pad_from=(90, 50) if pad else None, seed=13)
    do = torch.randn_like(q)
    kw = dict(experts_per_query=S, shared=shared, key_padding_mask=mask)
    g_match = torch.autograd.grad(tmop.triton_mita(q, k, v, r, 20, **kw), (q, k, v, r), do)
    monkeypatch.setattr(tkl, "_MATCH_MAX", 0)
    monkeypatch.setattr(tplan, "_PLAN_LOCAL_MAX", 0)
    g_csr = torch.autograd.grad(tmop.triton_mita(q, k, v, r, 20, **kw), (q, k, v, r), do)
    monkeypatch.setattr(tkl, "_LISTS_MAX_N", 0)
    g_sort = torch.autograd.grad(tmop.triton_mita(q, k, v, r, 20, **kw), (q, k, v, r), do)
    # All sum a key's routed rows in ascending expert order, so the results are bitwise equal.
    for a, b, c in zip(g_match, g_csr, g_sort):
        assert torch.equal(a, b) and torch.equal(a, c)


def _compute_ops(fn, launches) -> list[str]:
    """The PyTorch ops ``fn()`` runs outside its Triton launches (``launches``: the triton_launches fixture) other
    than allocations, views and detaches (``mita.utils.kernel_ops``): each is a kernel launch on a GPU."""
    from mita.utils.kernel_ops import KernelOps

    with KernelOps(lambda: launches.inside) as mode:
        fn()
    return mode.ops


@pytest.mark.no_poison
def test_launch_count_small_shape(monkeypatch, triton_launches):
    """General path at small N (no padding, S = 1): five Triton launches (top-k, landmark values, routing, plan,
    attention); the backward seven (dq, routed dk / dv, shared expert, its merge, per-key dk / dv, the landmark
    values' dR, the dR merge); neither runs a PyTorch kernel. The short path: two and one."""
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    launches = triton_launches
    (q, k, v, r), _ = _inputs(2, 2, 197, 32, 25, torch.float32, seed=17)
    res = {}
    assert _compute_ops(lambda: res.setdefault("out", tmop.triton_mita(q, k, v, r, 25)), launches) == []
    n_fwd = len(launches)
    assert n_fwd == 5, launches
    do = torch.randn_like(res["out"])
    assert _compute_ops(lambda: torch.autograd.grad(res["out"], (q, k, v, r), do), launches) == []
    assert launches[n_fwd:] == [
        "_mita_bwd_dq_kernel",
        "_mita_bwd_dkdv_routed_kernel",
        "_mita_bwd_shared_kernel",
        "_shared_merge_kernel",
        "_dkdv_final_kernel",
        "_lv_bwd_dr_kernel",
        "_dr_merge_kernel",
    ], launches[n_fwd:]
    monkeypatch.setattr(tmop, "SHORT_PATH", True)
    launches.clear()
    out = tmop.triton_mita(q, k, v, r, 25)
    assert launches == ["_small_route_kernel", "_small_attn_kernel"], launches
    torch.autograd.grad(out, (q, k, v, r), torch.randn_like(out))
    assert launches[2:] == ["_small_bwd_kernel"], launches


@pytest.mark.no_poison
def test_padding_mask_costs_few_pytorch_kernels(monkeypatch, triton_launches):
    """With a padding mask the general path turns it into the kernels' int8 form once per call (not, bool to int8
    cast, head broadcast; valid-key counts: sum, clamp) and the backward converts nothing."""
    monkeypatch.setattr(tmop, "SHORT_PATH", False)
    (q, k, v, r), mask = _inputs(2, 2, 300, 32, 8, torch.float32, pad_from=(300, 140), seed=3)
    res = {}
    ops = _compute_ops(lambda: res.setdefault("out", tmop.triton_mita(q, k, v, r, 16, key_padding_mask=mask)),
                       triton_launches)  # fmt: skip
    assert sorted(ops) == ["_to_copy", "bitwise_not", "clamp_", "clone", "sum"], ops
    do = torch.randn_like(res["out"])
    assert _compute_ops(lambda: torch.autograd.grad(res["out"], (q, k, v, r), do), triton_launches) == []


@pytest.mark.parametrize(
    "heads,N,start,grid,bins,kb",
    [
        (3, 197, 0, (14, 14), (5, 5), 4),
        (0, 50, 1, (7, 7), (2, 3), 4),
        (2, 1025, 1, (32, 32), (7, 7), 4),
        pytest.param(6, 1025, 1, (32, 32), (7, 7), 4, marks=pytest.mark.gpu, id="gpu-seg_1025"),
    ],
)
def test_triton_pooling_matches_pytorch(heads, N, start, grid, bins, kb):
    """The Triton landmark pooling (triton/pool.py: bf16 forward with float32 sums, float32 backward over each
    token's own landmarks, at most kb of them where adaptive bins overlap) against the PyTorch formulation's float32
    arithmetic: forward within one bf16 ulp (both round a float32 sum once, summed in different orders), backward to
    float32 rounding; written in the landmarks' layout."""
    from mita.ops import landmarks as lm

    g = torch.Generator().manual_seed(N)
    G, d = 2, 32
    C = (heads or 1) * d
    tables = lm._pool_tables(N, start, *grid, *bins, torch.device(DEV), torch.bfloat16)
    m = bins[0] * bins[1]
    # The per-token table holds exactly the operator's nonzero weights, in ascending landmark order.
    bidx, bw = tables.token_bins
    assert bidx.shape == bw.shape == (N, kb) and bidx.dtype == torch.int32
    dense = torch.zeros(N, m, device=DEV).scatter_add_(1, bidx.long(), bw)
    assert torch.equal(dense, tables.weights_t)
    assert ((bidx.diff(dim=1) > 0) | (bw[:, 1:] == 0)).all()
    # x3 as a [G, N, C] view with a row stride larger than C (the head split of a fused qkv projection).
    x3 = torch.randn(G, N, 3 * C, generator=g).to(DEV, torch.bfloat16)[:, :, :C]
    out = tp.pool_fwd(x3, tables.member, tables.counts, heads)
    want = torch.bmm(tables.member.float().expand(G, m, N), x3.float()) / tables.counts
    want = want.view(G, m, heads, d).transpose(1, 2) if heads else want
    assert out.shape == want.shape and out.is_contiguous() and out.dtype == torch.bfloat16
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    assert ((out.double() - want.double()).abs() <= ulp).all()
    if _CUDA:
        # (The CPU interpreter truncates float32 to bf16 instead of rounding to nearest: one ulp is all it gets.)
        assert (out == want.to(torch.bfloat16)).float().mean() > 0.95
    # The upstream gradient in the landmarks' layout, strided (a transposed view).
    if heads:
        cot = torch.randn(G, m, heads, d, generator=g).to(DEV, torch.bfloat16).transpose(1, 2)
    else:
        cot = torch.randn(G, C, m, generator=g).to(DEV, torch.bfloat16).transpose(1, 2)
    dx = tp.pool_bwd(cot, tables.token_bins, heads, torch.float32)
    gt = (cot.transpose(1, 2) if heads else cot).reshape(G, m, C).float()
    dx_want = torch.bmm(tables.weights_t.expand(G, N, m), gt)
    assert dx.shape == (G, N, C) and _rel(dx, dx_want) < 1e-6
    assert torch.equal(dx[:, :start], torch.zeros_like(dx[:, :start]))
    dx16 = tp.pool_bwd(cot, tables.token_bins, heads, torch.bfloat16)
    ulp = torch.exp2(torch.floor(torch.log2(dx.abs().clamp_min(1e-30))) - 7)
    assert ((dx16.double() - dx.double()).abs() <= ulp).all()
    if _CUDA:
        assert torch.equal(dx16, dx.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,H,N,d,m", [(2, 3, 96, 32, 3), (1, 2, 1000, 64, 8), (1, 1, 40, 16, 40)])
def test_triton_pooling_1d_matches_pytorch(dtype, B, H, N, d, m):
    """The 1D Triton landmark pooling (segment means, float32 sums rounded once) against float64 means: within
    one ulp of x's dtype, from a strided view (the head split of a fused qkv projection); _Pool1D's backward equals
    the PyTorch formulation's gradient bit for bit."""
    from mita.ops import landmarks as lm

    g = torch.Generator().manual_seed(N)
    qkv = torch.randn(B, N, 3, H, d, generator=g).to(DEV, dtype)
    x = qkv[:, :, 0].transpose(1, 2)  # [B, H, N, d], not contiguous
    assert tp.pool1d_supported(x, m)
    out = tp.pool1d_fwd(x, m)
    want = x.double().reshape(B, H, m, N // m, d).mean(3)
    assert out.shape == (B, H, m, d) and out.is_contiguous() and out.dtype == dtype
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - (7 if dtype == torch.bfloat16 else 10))
    assert ((out.double() - want).abs() <= ulp).all()
    xg = x.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    cot = torch.randn(B, H, m, d, generator=g).to(DEV, dtype)
    (dx,) = torch.autograd.grad(lm._Pool1D.apply(xg, m), xg, cot)
    (dx_ref,) = torch.autograd.grad(
        (xr.reshape(B, H, m, N // m, d).sum(3, dtype=torch.float32) / (N // m)).to(dtype), xr, cot
    )
    assert torch.equal(dx, dx_ref)
    assert not tp.pool1d_supported(x.float(), m) and not tp.pool1d_supported(x, 7)
    with pytest.raises(ValueError, match="unsupported"):
        tp.pool1d_fwd(x, 7)


def _padding_masks(B, N, g):
    """Padding masks of B rows: a padded tail, padding scattered through the row, no valid token at all, then
    (row 3 on) random padding with a few valid tokens left."""
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0, N // 2 :] = True
    mask[1, ::3] = True
    mask[1, -5:] = True
    if B > 2:
        mask[2] = True
    for b in range(3, B):
        mask[b] = torch.rand(N, generator=g) < 0.9
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B,H,N,d,m",
    [(4, 2, 150, 32, 8), (3, 1, 70, 16, 40), (2, 2, 1500, 16, 33), (4, 1, 64, 64, 64)],
)
def test_triton_pooling_1d_masked_matches_float64(dtype, B, H, N, d, m):
    """1D landmarks over the valid tokens (padding anywhere, an all-padding row, more landmarks than valid tokens,
    rows longer than one count block): the Triton kernels against the PyTorch form in float64, forward and
    backward, within one ulp of x's dtype (float32: 1e-6 of the largest value), from a strided view (the head split
    of a fused qkv projection) whose padding holds NaN; the gradient is 0 at padding."""
    from mita.ops import landmarks as lm

    g = torch.Generator().manual_seed(N + m)
    qkv = torch.randn(B, N, 3, H, d, generator=g).to(DEV, dtype)
    mask = _padding_masks(B, N, g).to(DEV)
    qkv[:, :, 0].masked_fill_(mask[:, :, None, None], float("nan"))
    x = qkv[:, :, 0].transpose(1, 2)  # [B, H, N, d], not contiguous
    assert tp.pool1d_masked_supported(x, m, mask)
    xr = x.detach().double().nan_to_num(0.0).requires_grad_()
    want = lm._pool_1d(xr, m, mask)
    out = tp.pool1d_masked_fwd(x, m, mask)
    assert out.shape == (B, H, m, d) and out.is_contiguous() and out.dtype == dtype
    assert torch.isfinite(out).all()
    if B > 2:
        assert (out[2] == 0).all()  # no valid token: every landmark 0

    def within(a, ref):
        # One ulp of x's dtype (the CPU interpreter truncates float32 -> bf16 / fp16), plus 1e-12 of the largest
        # value: the float64 reference's own prefix-sum differences are that far from exact zeros.
        slack = 1e-12 * ref.abs().max()
        if dtype == torch.float32:
            return ((a.double() - ref).abs() <= 1e-6 * ref.abs().max()).all()
        bits = 7 if dtype == torch.bfloat16 else 10
        # (fp16 below 2^-14 is subnormal: its spacing stays 2^-24.)
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - bits).clamp_min(
            torch.finfo(dtype).tiny * 2**-bits
        )
        return ((a.double() - ref).abs() <= ulp + slack).all()

    assert within(out, want.detach())
    cot = torch.randn(B, H, m, d, generator=g).to(DEV, dtype)
    (dx_want,) = torch.autograd.grad(want, xr, cot.double())
    dx = tp.pool1d_masked_bwd(cot, mask, N, dtype)
    assert dx.shape == (B, H, N, d) and dx.dtype == dtype and torch.isfinite(dx).all()
    assert (dx.transpose(1, 2)[mask] == 0).all()
    assert within(dx, dx_want)
    # Through the autograd function (what pool_landmarks takes on CUDA).
    xg = x.detach().clone().requires_grad_()
    (dx2,) = torch.autograd.grad(lm._Pool1DMasked.apply(xg, m, mask), xg, cot)
    assert torch.equal(dx2, dx)


def test_triton_pooling_1d_masked_rejects_what_it_cannot_take():
    x = torch.randn(2, 1, 40, 32, device=DEV)
    mask = torch.zeros(2, 40, dtype=torch.bool, device=DEV)
    assert tp.pool1d_masked_supported(x, 8, mask)
    assert not tp.pool1d_masked_supported(x.double(), 8, mask)
    assert not tp.pool1d_masked_supported(x[..., :24], 8, mask)  # head dim not a power of 2
    assert not tp.pool1d_masked_supported(x, 41, mask)  # more landmarks than tokens
    assert not tp.pool1d_masked_supported(x, 8, mask.int())
    assert not tp.pool1d_masked_supported(x, 8, mask[:, :39])
    with pytest.raises(ValueError, match="unsupported"):
        tp.pool1d_masked_fwd(x, 41, mask)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
def test_gpu_pool_landmarks_1d_masked_uses_triton(monkeypatch):
    """On CUDA, pool_landmarks(layout="1d", key_padding_mask=...) takes the Triton kernels (at the ListOps layer's
    shape): output and gradient within one bf16 ulp of the float64 PyTorch form (which cannot take the kernels)."""
    from mita.ops import landmarks as lm

    g = torch.Generator().manual_seed(5)
    B, H, N, d, m = 32, 2, 2000, 32, 32
    x = torch.randn(B, H, N, d, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    mask = _padding_masks(B, N, g).to(DEV)
    cot = torch.randn(B, H, m, d, generator=g).to(DEV, torch.bfloat16)
    calls = []
    real = lm._Pool1DMasked.apply
    monkeypatch.setattr(lm._Pool1DMasked, "apply", lambda *a: calls.append(1) or real(*a))
    out = lm.pool_landmarks(x, m, layout="1d", key_padding_mask=mask)
    (dx,) = torch.autograd.grad(out, x, cot)
    assert len(calls) == 1
    xr = x.detach().double().requires_grad_()
    ref = lm.pool_landmarks(xr, m, layout="1d", key_padding_mask=mask)
    (dx_ref,) = torch.autograd.grad(ref, xr, cot.double())
    assert len(calls) == 1  # float64 takes the PyTorch form
    for a, b in ((out, ref), (dx, dx_ref)):
        b = b.detach()
        ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)
        assert ((a.detach().double() - b).abs() <= ulp + 1e-12 * b.abs().max()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
def test_gpu_pool_landmarks_1d_uses_triton(monkeypatch):
    """On CUDA, pool_landmarks(layout="1d") takes the Triton kernel: output within one bf16 ulp of the PyTorch
    formulation's (TRITON_POOL off), the same gradient."""
    from mita.ops import landmarks as lm

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 65536, 64, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    cot = torch.randn(2, 2, 128, 64, generator=g).to(DEV, torch.bfloat16)
    calls = []
    real = lm._Pool1D.apply
    monkeypatch.setattr(lm._Pool1D, "apply", lambda *a: calls.append(1) or real(*a))
    out = lm.pool_landmarks(x, 128, layout="1d")
    (dx,) = torch.autograd.grad(out, x, cot)
    assert calls
    monkeypatch.setattr(lm, "TRITON_POOL", False)
    ref = lm.pool_landmarks(x, 128, layout="1d")
    (dx_ref,) = torch.autograd.grad(ref, x, cot)
    ulp = torch.exp2(torch.floor(torch.log2(ref.detach().double().abs().clamp_min(1e-30))) - 7)
    assert ((out.detach().double() - ref.detach().double()).abs() <= ulp).all()
    assert torch.equal(dx, dx_ref)


def _quantized_qkv(B, H, N, d, seed):
    """bf16 q, k, v whose 2D pooled means are exact in bf16 (multiples of 1/4 in [-1, 1], 16-token cells), so the
    landmarks of the folded and the two-step forms are equal whatever the rounding of the pooling kernel."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = ((torch.randint(-4, 5, (B, H, N, d), generator=g) / 4).to(DEV, torch.bfloat16) for _ in range(3))
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("S,shared,layout", [(1, True, "official"), (2, True, "patches"), (1, False, "official")])
def test_folded_pooling_matches_two_step(monkeypatch, S, shared, layout):
    """triton_mita_pooled (pooling inside the attention's autograd node, its gradient added in the backward
    kernel) against triton_mita on pool_landmarks(q): same output, and q, k, v gradients equal up to the two-step
    form's extra roundings (dR and the pooling gradient rounded to bf16 before the sum)."""
    from mita.ops.landmarks import pool_landmarks, pool_operator_2d

    B, H, N, d = 2, 2, 65, 32  # an 8 x 8 patch grid after one prefix token; 2 x 2 landmarks of 16 tokens
    kw = dict(experts_per_query=S, shared=shared)
    pool = pool_operator_2d(N, 4, layout=layout, num_prefix_tokens=1, device=DEV)
    if layout == "official":
        # The CLS-shifted grid takes the first 64 tokens; cells still hold 16 tokens each.
        assert pool.counts.flatten().tolist() == [16.0] * 4
    assert tmop.pooled_short_supported(torch.empty(B, H, N, d, dtype=torch.bfloat16), 4)
    do = torch.randn(B, H, N, d, generator=torch.Generator().manual_seed(5)).to(DEV, torch.bfloat16)
    bwd = "fused"
    q, k, v = _quantized_qkv(B, H, N, d, seed=9)
    out = tmop.triton_mita_pooled(q, k, v, pool, 10, **kw)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q2, k2, v2 = _quantized_qkv(B, H, N, d, seed=9)
    r = pool_landmarks(q2, 4, layout=layout, num_prefix_tokens=1)
    ref = tmop.triton_mita(q2, k2, v2, r, 10, **kw)
    ref_grads = torch.autograd.grad(ref, (q2, k2, v2), do)
    assert torch.equal(out, ref), bwd
    for name, a, b in zip("qkv", grads, ref_grads):
        assert torch.isfinite(a).all()
        # (Without the pooling gradient dq is off by 1.4e-2 here; the roundings alone give ~3e-3.)
        assert _rel(a, b) < (6e-3 if name == "q" and shared else 1e-5), f"{bwd} d{name}: {_rel(a, b):.2e}"


def test_layer_takes_folded_pooling(monkeypatch):
    """MiTAAttention with 2D landmarks on the Triton backend takes triton_mita_pooled through mita_attention_pooled
    (bf16, short sequence); not with a selection record, float32, or fold=False."""
    import mita.ops.mita.triton as mita_triton
    from mita.layers import mita as layer_mod

    calls = []
    real = mita_triton.triton_mita_pooled
    # The operator calls the package's public name.
    monkeypatch.setattr(mita_triton, "triton_mita_pooled", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    layer = layer_mod.MiTAAttention(dim=64, num_heads=2, m=4, k=10, backend="triton").to(DEV, torch.bfloat16)
    x = torch.randn(2, 65, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().sum().backward()
    assert calls == [1] and y.shape == x.shape and torch.isfinite(x.grad).all()
    assert torch.isfinite(layer.qkv.weight.grad).all() and layer.qkv.weight.grad.abs().sum() > 0
    layer.record_selection = True
    assert layer(x).shape == y.shape  # the two-step form (compared with the folded one below, on exact inputs)
    layer.record_selection = False
    layer.float()(x.detach().float())
    assert calls == [1]
    # Quantised inputs: both forms pool them exactly, so their outputs are equal.
    q, k, v = (t.detach() for t in _quantized_qkv(1, 2, 65, 32, seed=4))
    kw = dict(layout="official", num_prefix_tokens=1, backend="triton")
    folded = mita_attention_pooled(q, k, v, 4, 10, **kw)
    assert calls == [1, 1]
    assert torch.equal(folded, mita_attention_pooled(q, k, v, 4, 10, **kw, fold=False)) and calls == [1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("S", [1, 2])
def test_gpu_layer_folded_pooling_matches_two_step(monkeypatch, S):
    """A DeiT-S-shaped MiTA layer (N 197, 6 heads of 64, m = k = 25) on the GPU: the folded pooling against the
    two-step form, output and the gradients of x and the projections."""
    from mita.layers import mita as layer_mod

    torch.manual_seed(0)
    layer = layer_mod.MiTAAttention(dim=384, num_heads=6, m=25, k=25, experts_per_query=S).to(DEV, torch.bfloat16)
    x = torch.randn(8, 197, 384, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    cot = torch.randn_like(x)
    res = {}
    for fold in (True, False):
        monkeypatch.setattr(layer_mod, "mita_attention_pooled", functools.partial(mita_attention_pooled, fold=fold))
        x.grad = None
        layer.zero_grad()
        y = layer(x)
        y.backward(cot)
        res[fold] = (y.detach(), x.grad.clone(), layer.qkv.weight.grad.clone())
    assert torch.equal(res[True][0], res[False][0])
    for a, b in zip(res[True][1:], res[False][1:]):
        assert _rel(a, b) < 1e-2
