"""The MiTA operator: naive reference against an independent dense formulation, the PyTorch backend against
the reference (forward and backward, per dtype), properties, landmark pooling and argument errors."""

from __future__ import annotations

import pytest
import torch

from mita import mita_attention, mita_attention_pooled, naive_mita, pool_landmarks
from mita.ops.landmarks import adaptive_pool_matrix
from mita.ops.mita.dense_ref import dense_mita

# Every test here runs with poisoned allocations (tests/conftest.py: NaN floats, integers no kernel writes).
pytestmark = pytest.mark.usefixtures("poison")

# (B, H, N, d, m, topk): awkward sizes, k above N, one token, m = 1.
SHAPES = [
    (2, 3, 63, 16, 9, 7),
    (1, 2, 50, 8, 4, 60),
    (2, 1, 33, 32, 5, 33),
    (1, 1, 1, 4, 1, 3),
    (3, 2, 20, 12, 6, 1),
]


def _inputs(B, H, N, d, m, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, generator=g, dtype=dtype) for _ in range(3))
    R = torch.randn(B, H, m, d, generator=g, dtype=dtype)
    return q, k, v, R


def _padding(B, N, seed=0):
    """Right padding with a different valid length per sequence (at least one valid token)."""
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(1, N + 1, (B,), generator=g)
    lengths[0] = N
    return torch.arange(N)[None, :] >= lengths[:, None]


@pytest.mark.parametrize("shape,S", [(s, S) for s in SHAPES for S in (1, 2) if S <= s[4]])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_naive_matches_dense_formulation(shape, S, shared, padded):
    B, H, N, d, m, topk = shape
    q, k, v, R = _inputs(B, H, N, d, m)
    mask = _padding(B, N) if padded else None
    for shared_scale in (None, d**-0.5):
        kw = dict(experts_per_query=S, shared=shared, shared_scale=shared_scale, key_padding_mask=mask)
        out = naive_mita(q, k, v, R, topk, **kw)
        ref = dense_mita(q, k, v, R, topk, **kw)
        valid = torch.ones(B, N, dtype=torch.bool) if mask is None else ~mask
        assert out.dtype == torch.float64
        torch.testing.assert_close(out[valid[:, None, :].expand(B, H, N)], ref[valid[:, None, :].expand(B, H, N)])


def test_naive_gradcheck():
    q, k, v, R = _inputs(1, 2, 11, 4, 3)
    mask = torch.zeros(1, 11, dtype=torch.bool)
    mask[0, 9:] = True
    for S, shared in ((1, True), (2, True), (1, False)):

        def f(q, k, v, R, S=S, shared=shared):
            return naive_mita(q, k, v, R, 4, experts_per_query=S, shared=shared, key_padding_mask=mask)[:, :, :9]

        inputs = tuple(t.clone().requires_grad_() for t in (q, k, v, R))
        assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5)


TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:3] + [(2, 2, 197, 16, 25, 25)])
@pytest.mark.parametrize("S,shared", [(1, True), (2, True), (1, False)])
def test_torch_backend_matches_naive(dtype, shape, S, shared):
    B, H, N, d, m, topk = shape
    q, k, v, R = (t.to(dtype) for t in _inputs(B, H, N, d, m, dtype=torch.float32, seed=3))
    mask = _padding(B, N, seed=3)
    valid = (~mask)[:, None, :, None].expand(B, H, N, d)
    kw = dict(experts_per_query=S, shared=shared, key_padding_mask=mask)

    def run(fn, inputs):
        inputs = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*inputs, topk, **kw)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype) * valid
        out.backward(grad_out)
        return out, [t.grad for t in inputs]

    # Reference: fp32 naive on the same (rounded) inputs. "Plain PyTorch in this dtype": the same naive
    # function run on the inputs, then its output rounded to the dtype.
    ref_out, ref_grads = run(naive_mita, [t.float() for t in (q, k, v, R)])
    out, grads = run(lambda *a, **kw_: mita_attention(*a, backend="torch", **kw_), [q, k, v, R])
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    err = _rel_err(out[valid], ref_out[valid])
    rounding = _rel_err(ref_out[valid].to(dtype), ref_out[valid])
    assert err <= max(2 * rounding, TOL[dtype]), (err, rounding)
    for name, g, rg in zip("qkvR", grads, ref_grads):
        if rg is None:
            # Routing-only: the landmarks only route, and routing carries no gradient.
            assert name == "R" and not shared and g is None
            continue
        assert g is not None and torch.isfinite(g).all(), name
        if name in "kv":
            # Padded keys enter no logit and no value: their gradients are exactly zero.
            assert (g.transpose(1, 2)[mask] == 0).all(), f"d{name} of padded keys"
        g_err = _rel_err(g, rg)
        assert g_err <= max(2 * _rel_err(rg.to(dtype), rg), 2 * TOL[dtype]), (name, g_err)


def test_torch_backend_chunks_agree():
    """Processing queries in several chunks gives the single-chunk result (to matmul rounding)."""
    from mita.ops.mita.torch_impl import torch_mita

    q, k, v, R = _inputs(2, 2, 45, 8, 4, dtype=torch.float32)
    kw = dict(experts_per_query=2, shared=True, shared_scale=0.1, scale=0.3, key_padding_mask=_padding(2, 45))
    whole = torch_mita(q, k, v, R, 6, **kw)
    chunked = torch_mita(q, k, v, R, 6, chunk_elements=2 * 2 * 2 * 6 * 8 * 7, **kw)
    assert not torch.equal(whole[:, :, :7], whole[:, :, 7:14])
    torch.testing.assert_close(whole, chunked, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn", [naive_mita, mita_attention])
def test_appending_padding_leaves_valid_outputs_unchanged(fn):
    q, k, v, R = _inputs(2, 2, 30, 8, 4, dtype=torch.float32)
    base_mask = _padding(2, 30)
    out = fn(q, k, v, R, 9, key_padding_mask=base_mask)
    extra = 13
    g = torch.Generator().manual_seed(5)
    # Padded positions hold large random values: they must not leak into valid outputs.
    pad = lambda t: torch.cat([t, 100 * torch.randn(2, 2, extra, 8, generator=g)], dim=2)  # noqa: E731
    mask = torch.cat([base_mask, torch.ones(2, extra, dtype=torch.bool)], dim=1)
    q2, k2, v2 = pad(q), pad(k), pad(v)
    # Padding inside the original length gets garbage too.
    k2 = k2.masked_fill(mask[:, None, :, None], 1e3)
    out2 = fn(q2, k2, v2, R, 9, key_padding_mask=mask)
    valid = ~base_mask
    torch.testing.assert_close(out2[:, :, :30][valid[:, None].expand(2, 2, 30)], out[valid[:, None].expand(2, 2, 30)])


@pytest.mark.parametrize("fn", [naive_mita, mita_attention])
def test_routing_only_with_all_keys_equals_full_attention(fn):
    q, k, v, R = _inputs(2, 3, 40, 16, 5, dtype=torch.float32)
    out = fn(q, k, v, R, 40, shared=False)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    out = fn(q, k, v, R, 1000, shared=False)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [naive_mita, mita_attention])
def test_permuting_keys_does_not_change_output(fn):
    q, k, v, R = _inputs(2, 2, 37, 8, 4, dtype=torch.float64)
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(1))
    for S in (1, 2):
        out = fn(q, k, v, R, 6, experts_per_query=S)
        out_p = fn(q, k[:, :, perm], v[:, :, perm], R, 6, experts_per_query=S)
        torch.testing.assert_close(out, out_p)


@pytest.mark.parametrize("fn", [naive_mita, mita_attention])
def test_ties_and_single_valid_token_are_finite(fn):
    q, k, v, R = _inputs(2, 2, 16, 8, 4, dtype=torch.float32)
    k_same = k[:, :, :1].expand_as(k).contiguous()
    R_same = R[:, :, :1].expand_as(R).contiguous()
    out = fn(q, k_same, v, R_same, 5)
    assert torch.isfinite(out).all()
    # All keys tie: every landmark takes the 5 lowest-index keys, so the routed part sees v[:5] only (the dense
    # reference counts ranks with lower index first, independently of the top-k code).
    ref = dense_mita(q, k_same, v, R_same, 5).to(out.dtype)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    routed = fn(q, k_same, v, R_same, 5, shared=False)
    torch.testing.assert_close(routed, v[:, :, :5].mean(dim=2, keepdim=True).expand_as(v))
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[:, 0] = False
    out = fn(q, k, v, R, 5, key_padding_mask=mask)
    assert torch.isfinite(out).all()
    # One valid key: every query's routed and shared entries average to that key's value.
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0], rtol=1e-5, atol=1e-5)


def test_gradients_match_the_dense_reference_and_reach_q_through_the_landmarks():
    """Gradients of q, k, v and the landmarks equal those of the independent dense formulation; with landmarks
    pooled from q, q's gradient holds the part that comes back through the pooling (it differs from q's gradient
    with the landmarks detached)."""
    q, k, v, _ = _inputs(1, 2, 20, 8, 4, dtype=torch.float64)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.randn(1, 2, 20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    R = pool_landmarks(q, 4, layout="1d")
    grads = torch.autograd.grad((mita_attention(q, k, v, R, 5) * g).sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    R2 = pool_landmarks(q2, 4, layout="1d")
    ref = torch.autograd.grad((dense_mita(q2, k2, v2, R2, 5) * g).sum(), (q2, k2, v2))
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    q3 = q.detach().clone().requires_grad_()
    (detached,) = torch.autograd.grad((mita_attention(q3, k, v, R.detach(), 5) * g).sum(), (q3,))
    assert (grads[0] - detached).abs().max() > 1e-6


# Landmarks


def test_official_and_patches_layouts_match_adaptive_pooling():
    B, H, h, w, d = 2, 3, 7, 5, 4
    x = torch.randn(B, H, 1 + h * w, d, dtype=torch.float64)
    pool = torch.nn.AdaptiveAvgPool2d((3, 2))
    official = pool_landmarks(x, (3, 2), layout="official", grid=(h, w))
    ref = pool(x[:, :, : h * w].reshape(B * H, h, w, d).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).reshape(B, H, 6, d)
    torch.testing.assert_close(official, ref)
    x5 = torch.randn(B, H, 5 + h * w, d, dtype=torch.float64)
    patches = pool_landmarks(x5, (3, 2), layout="patches", grid=(h, w), num_prefix_tokens=5)
    ref = pool(x5[:, :, 5:].reshape(B * H, h, w, d).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).reshape(B, H, 6, d)
    torch.testing.assert_close(patches, ref)
    # Divisible grid takes the reshape path; same numbers as the pooling matrix.
    x = torch.randn(1, 1, 1 + 196, 8, dtype=torch.float64)
    sq = pool_landmarks(x, 49, layout="official")
    ref = torch.nn.functional.adaptive_avg_pool2d(x[0, 0, :196].T.reshape(8, 14, 14), 7).reshape(8, 49).T
    torch.testing.assert_close(sq[0, 0], ref)


def test_1d_landmarks_pool_valid_tokens_only():
    x = torch.randn(3, 2, 50, 4, dtype=torch.float64)
    lengths = [50, 23, 3]
    mask = torch.arange(50)[None, :] >= torch.tensor(lengths)[:, None]
    out = pool_landmarks(x, 5, layout="1d", key_padding_mask=mask)
    for b, n in enumerate(lengths):
        ref = torch.nn.functional.adaptive_avg_pool1d(x[b, :, :n].transpose(1, 2), 5).transpose(1, 2)
        torch.testing.assert_close(out[b], ref)
    # Padding anywhere (left, scattered, everything but one token; a fully padded row gives zeros).
    g = torch.Generator().manual_seed(4)
    masks = [torch.rand(3, 50, generator=g) < p for p in (0.3, 0.7)]
    masks.append(torch.arange(50)[None].expand(3, 50) < torch.tensor([10, 49, 0])[:, None])
    for mask in masks:
        out = pool_landmarks(x, 5, layout="1d", key_padding_mask=mask)
        for b in range(3):
            kept = x[b][:, ~mask[b]]
            if kept.shape[1] == 0:
                continue
            ref = torch.nn.functional.adaptive_avg_pool1d(kept.transpose(1, 2), 5).transpose(1, 2)
            torch.testing.assert_close(out[b], ref)
    empty = pool_landmarks(x, 5, layout="1d", key_padding_mask=torch.ones(3, 50, dtype=torch.bool))
    assert torch.equal(empty, torch.zeros_like(empty))
    no_mask = pool_landmarks(x, 5, layout="1d")
    torch.testing.assert_close(no_mask, pool_landmarks(x, 5, layout="1d", key_padding_mask=torch.zeros(3, 50).bool()))
    odd = pool_landmarks(x[:, :, :47], 5, layout="1d")
    ref = torch.nn.functional.adaptive_avg_pool1d(x[:, :, :47].reshape(6, 47, 4).transpose(1, 2), 5)
    torch.testing.assert_close(odd, ref.transpose(1, 2).reshape(3, 2, 5, 4))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_1d_landmarks_long_segments_two_stage_sums(dtype):
    """Segments longer than two runs are summed in two float32 stages (landmarks._POOL_RUN tokens, then the runs):
    the mean of each segment, rounded once, and the backward spreads g / L over the segment."""
    from mita.ops import landmarks

    L = 4 * landmarks._POOL_RUN
    x = torch.randn(2, 3, 5 * L, 8, dtype=torch.float64)
    xd = x.to(dtype).requires_grad_()
    out = pool_landmarks(xd, 5, layout="1d")
    ref = xd.detach().double().reshape(2, 3, 5, L, 8).mean(dim=3)
    if dtype == torch.float64:
        torch.testing.assert_close(out, ref)
    else:
        # float32 sums of bf16 values, rounded once: within half a bf16 ulp of the exact mean (plus float32 noise).
        assert ((out.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-6).all()
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, xd, g)
    want = (g.double() / L)[:, :, :, None, :].expand(2, 3, 5, L, 8).reshape(x.shape)
    torch.testing.assert_close(gx.double(), want, rtol=2.0**-7 if dtype == torch.bfloat16 else 1e-7, atol=0)


def test_pool_matrix_rows_average():
    P = adaptive_pool_matrix(10, 3)
    torch.testing.assert_close(P.sum(1), torch.ones(3))
    assert (P > 0).sum().item() == 4 + 4 + 4  # overlapping bins [0,4), [3,7), [6,10)


def _cell_means(x: torch.Tensor, h: int, w: int, ph: int, pw: int, start: int) -> torch.Tensor:
    """Independent pooling: explicit loops over the ph x pw cells, each the mean of its tokens (row-major grid of
    h x w tokens from ``start``); cell (i, j) covers rows [floor(i h / ph), ceil((i + 1) h / ph)) and likewise
    columns. ``x``: ``[B, H, N, d]``; returns ``[B, H, ph * pw, d]``."""
    cells = []
    for i in range(ph):
        rows = range(i * h // ph, -(-(i + 1) * h // ph))
        for j in range(pw):
            cols = range(j * w // pw, -(-(j + 1) * w // pw))
            cells.append(x[:, :, [start + r * w + c for r in rows for c in cols]].mean(dim=2))
    return torch.stack(cells, dim=2)


def _layout_input(form: str, B: int, H: int, N: int, d: int, dtype: torch.dtype, g: torch.Generator):
    """x as [B, H, N, d] contiguous, as q split from a fused qkv projection (heads interleaved with channels), or
    as [B, N, H*d]."""
    if form == "qkv":
        return torch.randn(B, N, 3, H, d, generator=g).to(dtype).permute(2, 0, 3, 1, 4)[0]
    if form == "bnc":
        return torch.randn(B, N, H * d, generator=g).to(dtype)
    return torch.randn(B, H, N, d, generator=g).to(dtype)


# (layout kwargs, N, (h, w, ph, pw, start)): non-divisible, non-square grids, prefix tokens, the DeiT-S grid, 1D.
POOL_CASES = [
    (dict(m=(3, 2), layout="official", grid=(7, 5)), 36, (7, 5, 3, 2, 0)),
    (dict(m=(4, 3), layout="patches", grid=(5, 7), num_prefix_tokens=3), 38, (5, 7, 4, 3, 3)),
    (dict(m=(5, 4), layout="patches", grid=(13, 11), num_prefix_tokens=0), 143, (13, 11, 5, 4, 0)),
    (dict(m=25, layout="official"), 197, (14, 14, 5, 5, 0)),
    (dict(m=49, layout="patches"), 197, (14, 14, 7, 7, 1)),
    (dict(m=5, layout="1d"), 47, (1, 47, 1, 5, 0)),
    (dict(m=4, layout="1d"), 48, (1, 48, 1, 4, 0)),
]


@pytest.mark.parametrize("kwargs,N,cell", POOL_CASES)
@pytest.mark.parametrize("form", ["contiguous", "qkv", "bnc"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_pooling_matches_explicit_cell_means(kwargs, N, cell, form, dtype):
    """Forward and backward against float64 loops over the cells. float32: float32 rounding. bfloat16: within
    half a bf16 ulp of the exact value up to float32 rounding, i.e. the float32 result rounded once (no
    rounding of the weights, such as 1/9, to bf16)."""
    g = torch.Generator().manual_seed(N)
    B, H, d = 2, 3, 8
    x = _layout_input(form, B, H, N, d, dtype, g).requires_grad_()
    out = pool_landmarks(x, **kwargs)
    x64 = x.detach().double().requires_grad_()
    as4d = x64.unsqueeze(1) if form == "bnc" else x64
    ref = _cell_means(as4d, *cell)
    ref = ref.squeeze(1) if form == "bnc" else ref
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    cot = torch.randn(ref.shape, generator=g).to(dtype)
    out.backward(cot)
    ref.backward(cot.double())
    # Sums of |terms|, the scale of float32 rounding errors: the same pooling of |x|, and of |cot| backwards.
    x_abs = x64.detach().abs().requires_grad_()
    pooled_abs = _cell_means(x_abs.unsqueeze(1) if form == "bnc" else x_abs, *cell)
    pooled_abs.backward(cot.double().abs().reshape(pooled_abs.shape))
    for got, want, mag in ((out, ref, pooled_abs.reshape(ref.shape)), (x.grad, x64.grad, x_abs.grad)):
        got, want = got.detach().double(), want.detach()
        if dtype == torch.bfloat16:
            # bf16 has 8 significant bits: ulp(v) = 2^(floor(log2 |v|) - 7).
            half_ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 8)
            assert ((got - want).abs() <= half_ulp + 2**-20 * mag.detach() + 1e-30).all()
        else:
            tol = 1e-12 if dtype == torch.float64 else 1e-6
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_pooling_operator_is_built_once_per_size():
    """The [m, N] operator is cached: a second call with the same sizes builds nothing."""
    from mita.ops.landmarks import _pool_tables

    x = torch.randn(2, 2, 197, 8, dtype=torch.bfloat16)
    pool_landmarks(x, 25, layout="official")
    before = _pool_tables.cache_info()
    pool_landmarks(x + 1, 25, layout="official")
    after = _pool_tables.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 1


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["contiguous", "qkv"])
def test_pooling_on_cuda_matches_cpu(form):
    """The CUDA bfloat16 path (bf16 GEMM with a float32 output forward, float32 GEMM backward) gives the CPU
    numbers, forward and backward, at the DeiT-S layer shape. Both round float32 sums once, in different orders:
    they may differ by an ulp or two of the value, and where the terms cancel (gradients of tokens in several
    cells) by float32 rounding of the terms' magnitude, so the bound has both parts."""
    g = torch.Generator().manual_seed(0)
    x = _layout_input(form, 4, 6, 197, 64, torch.bfloat16, g)
    cot = torch.randn(4, 6, 25, 64, generator=g).to(torch.bfloat16)
    res = []
    for dev in ("cpu", "cuda"):
        xd = x.detach().to(dev).requires_grad_()
        out = pool_landmarks(xd, 25, layout="official")
        out.backward(cot.to(dev))
        res.append((out.detach().cpu().double(), xd.grad.cpu().double()))
    # Magnitudes of the summed terms: the same pooling of |x|, and of |cot| backwards, in float64.
    x_abs = x.detach().double().abs().requires_grad_()
    pooled_abs = pool_landmarks(x_abs, 25, layout="official")
    pooled_abs.backward(cot.double().abs())
    for (a, b), mag in zip(zip(*res), (pooled_abs.detach(), x_abs.grad)):
        bound = torch.exp2(torch.floor(torch.log2(a.abs().clamp_min(1e-30))) - 6) + 2**-20 * mag
        assert ((a - b).abs() <= bound).all()
        assert (a != b).double().mean() < 0.01


# Errors


def _good():
    q, k, v, R = _inputs(2, 2, 16, 8, 4, dtype=torch.float32)
    return dict(q=q, k=k, v=v, landmarks=R, topk=4)


@pytest.mark.parametrize(
    "change,argument",
    [
        (lambda a: a.update(topk=0), "topk"),
        (lambda a: a.update(topk=2.5), "topk"),
        (lambda a: a.update(landmarks=a["landmarks"][:, :, :0]), "landmarks"),
        (lambda a: a.update(landmarks=a["landmarks"][:, :, :, :4]), "landmarks"),
        (lambda a: a.update(k=a["k"][:, :, :5]), "same shape"),
        (lambda a: a.update(v=a["v"].double()), "v must have q's dtype"),
        (lambda a: a.update(q=a["q"][0]), "q must be 4-D"),
        (lambda a: a.update(experts_per_query=5), "experts_per_query"),
        (lambda a: a.update(experts_per_query=0), "experts_per_query"),
        (lambda a: a.update(key_padding_mask=torch.zeros(2, 15, dtype=torch.bool)), "key_padding_mask"),
        (lambda a: a.update(key_padding_mask=torch.zeros(2, 16)), "key_padding_mask"),
        (lambda a: a.update(scale=-1.0), "scale"),
        (lambda a: a.update(shared_scale=float("nan")), "shared_scale"),
    ],
)
@pytest.mark.parametrize("fn", [naive_mita, mita_attention])
def test_bad_arguments_raise_naming_the_argument(fn, change, argument):
    args = _good()
    change(args)
    with pytest.raises(ValueError, match=argument):
        fn(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("landmarks"), args.pop("topk"), **args)


def test_bad_backend_and_nonfinite_input():
    args = _good()
    with pytest.raises(ValueError, match="backend"):
        mita_attention(**{"backend": "nope", **args})
    args["q"][0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="q: naive_mita needs finite"):
        naive_mita(**args)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(m=16, layout="official"), "grid"),  # 16 tokens - 1 prefix is not a square
        (dict(m=10, layout="official", grid=(3, 5)), "m: 2D landmarks need a perfect square"),
        (dict(m=36, layout="patches", grid=(3, 5), num_prefix_tokens=1), "does not fit"),
        (dict(m=4, layout="patches", grid=(4, 4), num_prefix_tokens=1), "grid: 4x4"),
        (dict(m=20, layout="1d"), "m > N"),
        (dict(m=4, layout="sideways"), "layout"),
        (dict(m=4, layout="official", grid=(3, 5), key_padding_mask=torch.zeros(1, 16).bool()), "key_padding_mask"),
    ],
)
def test_landmark_errors(kwargs, argument):
    x = torch.randn(1, 1, 16, 4)
    with pytest.raises(ValueError, match=argument):
        pool_landmarks(x, **kwargs)


def test_torch_backend_compiles_as_one_graph():
    """fullgraph=True fails on any graph break, which a host synchronisation (.item(), data-dependent shape)
    would cause: the PyTorch backend stays capturable by torch.compile and CUDA graphs."""
    q, k, v, R = _inputs(2, 2, 30, 8, 4, dtype=torch.float32)
    mask = _padding(2, 30)

    def f(q, k, v, R, mask):
        return mita_attention(q, k, v, R, 5, experts_per_query=2, key_padding_mask=mask, backend="torch")

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    torch.testing.assert_close(
        compiled(q, k, v, R, mask),
        naive_mita(q, k, v, R, 5, experts_per_query=2, key_padding_mask=mask),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", None])
def test_no_host_synchronisation_on_cuda(backend):
    """torch's sync debug mode turns any device-to-host synchronisation into an error."""
    q, k, v, R = (t.cuda().to(torch.bfloat16) for t in _inputs(2, 2, 197, 64, 25, dtype=torch.float32))
    mask = _padding(2, 197).cuda()
    inputs = [t.requires_grad_() for t in (q, k, v, R)]
    mita_attention(*inputs, 25, key_padding_mask=mask, backend=backend).sum().backward()  # warm-up, autotuning
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mita_attention(*inputs, 25, key_padding_mask=mask, backend=backend)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = naive_mita(*(t.detach().float() for t in inputs), 25, key_padding_mask=mask)
    valid = (~mask)[:, None, :, None].expand_as(ref)
    assert _rel_err(out.float()[valid], ref[valid]) < 2e-2


@pytest.mark.parametrize("layout", ["official", "patches", "1d"])
def test_mita_attention_pooled_is_pool_then_attend(layout):
    """mita_attention_pooled = mita_attention on pool_landmarks(q) (CPU: no folded path), padding with 1D."""
    torch.manual_seed(0)
    B, H, N, d = 2, 2, 65, 16
    q, k, v = (torch.randn(B, H, N, d, requires_grad=True) for _ in range(3))
    mask = None
    if layout == "1d":
        mask = torch.zeros(B, N, dtype=torch.bool)
        mask[1, 40:] = True
    kw = dict(experts_per_query=2, shared_scale=0.1, key_padding_mask=mask)
    out = mita_attention_pooled(q, k, v, 4, 7, layout=layout, num_prefix_tokens=1, **kw)
    if layout == "1d":
        landmarks = pool_landmarks(q, 4, layout="1d", key_padding_mask=mask)
    else:
        landmarks = pool_landmarks(q, 4, layout=layout, num_prefix_tokens=1)
    ref = mita_attention(q, k, v, landmarks, 7, **kw)
    assert torch.equal(out, ref)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g, g_ref, strict=True):
        assert torch.equal(a, b)
