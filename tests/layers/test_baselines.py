"""Semantics of the baseline attention layers: full, agent, agent_minus, moba, topk, linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import Attention as TimmAttention

from mita.layers.moba import block_ids_1d, block_ids_2d, moba_attention
from mita.layers.topk import topk_attention
from mita.registry import create_attention

BASELINES = ["full", "agent", "agent_minus", "moba", "topk", "linear"]
DIM, HEADS = 32, 4
# Small settings so that the sparse layers really are sparse at the test sizes.
OPTIONS = {
    "full": {},
    "agent": {"agent_num": 4},
    "agent_minus": {"agent_num": 4},
    "moba": {"block_size": 4, "window_size": 2, "topk_blocks": 2},
    "topk": {"k": 5, "chunk_size": 7},
    "linear": {},
}
AGENT_EXTRAS = {"an_bias", "na_bias", "ac_bias", "ca_bias", "dwc.weight", "dwc.bias"}


def make(name: str, layout: str = "2d", **kw) -> nn.Module:
    """A baseline in eval mode; layout "2d" = CLS + square patch grid (the default), "1d" = plain sequence."""
    torch.manual_seed(0)
    layer = create_attention(name, DIM, HEADS, **{**OPTIONS[name], **kw}).eval()
    if layout == "1d":
        layer.grid_size = None
        layer.num_prefix_tokens = 0
    return layer


def tokens(b: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, n, DIM, generator=torch.Generator().manual_seed(seed))


def dense_attention(q, k, v, allowed):
    """Reference: softmax over the allowed keys only. q, k, v [B, H, N, d]; allowed [B, H, N, N] bool."""
    scores = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.double()).to(q.dtype)


@pytest.mark.parametrize("layout", ["2d", "1d"])
@pytest.mark.parametrize("name", BASELINES)
def test_forward_backward(name, layout):
    layer = make(name, layout, qkv_bias=True, qk_norm=True).train()
    x = tokens(2, 17).requires_grad_()
    y = layer(x)
    assert y.shape == x.shape
    assert torch.isfinite(y).all()
    y.square().mean().backward()
    assert torch.isfinite(x.grad).all()
    # Prefix-token biases of the agent act only on prefix tokens, which a 1D sequence does not have.
    idle = {"ac_bias", "ca_bias"} if (name == "agent" and layout == "1d") else set()
    for pname, p in layer.named_parameters():
        if pname in idle:
            continue
        assert p.grad is not None, f"{name}: no gradient reaches {pname}"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"{name}: bad gradient on {pname}"


@pytest.mark.parametrize("name", BASELINES)
def test_appending_padding_leaves_valid_outputs_unchanged_1d(name):
    layer = make(name, "1d")
    lengths = [13, 9]
    n_pad = 20
    x = tokens(2, n_pad, seed=2)
    mask = torch.arange(n_pad)[None, :] >= torch.tensor(lengths)[:, None]
    with torch.no_grad():
        y = layer(x, key_padding_mask=mask)
        for b, length in enumerate(lengths):
            alone = layer(x[b : b + 1, :length])
            torch.testing.assert_close(y[b, :length], alone[0], atol=1e-5, rtol=1e-4)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", BASELINES)
def test_padded_tokens_get_no_weight_2d(name):
    """Changing the content of padded patches (anywhere on the grid) leaves the valid outputs unchanged."""
    layer = make(name, "2d")
    x = tokens(2, 1 + 25, seed=3)
    mask = torch.zeros(2, 26, dtype=torch.bool)
    mask[0, [3, 7, 8, 20]] = True
    mask[1, 14:] = True
    x2 = torch.where(mask[..., None], 100 * tokens(2, 26, seed=4), x)
    with torch.no_grad():
        y, y2 = layer(x, key_padding_mask=mask), layer(x2, key_padding_mask=mask)
    assert torch.isfinite(y).all() and torch.isfinite(y2).all()
    torch.testing.assert_close(y[~mask], y2[~mask], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", ["2d", "1d"])
@pytest.mark.parametrize("name", BASELINES)
def test_fully_padded_sequence_is_finite(name, layout):
    layer = make(name, layout).train()
    n = 17
    x = tokens(2, n, seed=5).requires_grad_()
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1] = True
    y = layer(x, key_padding_mask=mask)
    assert torch.isfinite(y).all()
    y[0].sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
    with torch.no_grad():
        torch.testing.assert_close(layer(x[:1]), y[:1].detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("with_bias_and_norm", [False, True])
@pytest.mark.parametrize("name", BASELINES)
def test_loads_timm_attention_state_dict(name, with_bias_and_norm):
    torch.manual_seed(0)
    flags = dict(qkv_bias=with_bias_and_norm, qk_norm=with_bias_and_norm)
    timm_attn = TimmAttention(DIM, HEADS, **flags, norm_layer=nn.LayerNorm).eval()
    for p in timm_attn.parameters():
        nn.init.normal_(p, std=0.2)
    layer = make(name, **flags)
    result = layer.load_state_dict(timm_attn.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert set(result.missing_keys) == (AGENT_EXTRAS if name == "agent" else set())
    if name == "full":
        x = tokens(2, 17)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), timm_attn(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", BASELINES)
def test_unknown_keyword_raises(name):
    with pytest.raises(TypeError):
        create_attention(name, DIM, HEADS, no_such_option=1)


def test_agent_minus_has_no_extra_parameters():
    names = {n for n, _ in make("agent_minus").named_parameters()}
    assert names == {n for n, _ in make("full").named_parameters()}
    assert AGENT_EXTRAS <= {n for n, _ in make("agent").named_parameters()}


def test_full_backends_agree_on_cpu():
    x = tokens(2, 19, seed=6)
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[1, 11:] = True
    ref = make("full", sdpa_backend="math")
    with torch.no_grad():
        y_ref, y_ref_masked = ref(x), ref(x, key_padding_mask=mask)
    ran = []
    for backend in ["auto", "flash", "efficient", "cudnn"]:
        layer = make("full", sdpa_backend=backend)
        layer.load_state_dict(ref.state_dict())
        try:
            with torch.no_grad():
                y = layer(x)
        except RuntimeError:
            # A pinned kernel that does not exist on this device refuses to run.
            continue
        ran.append(backend)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
        if backend == "flash":
            with pytest.raises(ValueError, match="key_padding_mask"):
                layer(x, key_padding_mask=mask)
        else:
            with torch.no_grad():
                torch.testing.assert_close(layer(x, key_padding_mask=mask), y_ref_masked, atol=1e-5, rtol=1e-4)
    assert "auto" in ran and len(ran) >= 2, f"only {ran} ran"
    with pytest.raises(ValueError, match="sdpa_backend"):
        create_attention("full", DIM, HEADS, sdpa_backend="fastest")


def test_full_matches_dense_reference_with_padding():
    layer = make("full")
    x = tokens(2, 17, seed=7)
    mask = torch.zeros(2, 17, dtype=torch.bool)
    mask[0, 5:9] = True
    with torch.no_grad():
        q, k, v = layer.split_qkv(x)
        allowed = (~mask)[:, None, None, :].expand(2, HEADS, 17, 17)
        expected = layer.output(layer.merge_heads(dense_attention(q, k, v, allowed)))
        torch.testing.assert_close(layer(x, key_padding_mask=mask), expected, atol=1e-5, rtol=1e-4)


def test_full_attn_drop_only_in_training():
    layer = make("full", attn_drop=0.5)
    x = tokens(1, 17)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer(x))
        layer.train()
        assert not torch.allclose(layer(x), layer.eval()(x))


@pytest.mark.parametrize("layout", ["2d", "1d"])
def test_topk_with_k_at_least_valid_count_equals_full(layout):
    full = make("full", layout)
    x = tokens(2, 17, seed=8)
    mask = torch.zeros(2, 17, dtype=torch.bool)
    mask[1, 10:] = True
    # k = 12 covers every valid key of sequence 1 only; k = 17 and 100 cover both.
    for k in (17, 100):
        topk = make("topk", layout, k=k, chunk_size=5)
        topk.load_state_dict(full.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(topk(x), full(x), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(
                topk(x, key_padding_mask=mask), full(x, key_padding_mask=mask), atol=1e-5, rtol=1e-4
            )
    topk = make("topk", layout, k=12)
    topk.load_state_dict(full.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(
            topk(x, key_padding_mask=mask)[1], full(x, key_padding_mask=mask)[1], atol=1e-5, rtol=1e-4
        )
        assert not torch.allclose(topk(x)[0], full(x)[0], atol=1e-4)


def test_topk_selects_the_k_best_keys():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 3, 23, 8, generator=g) for _ in range(3))
    mask = torch.zeros(2, 23, dtype=torch.bool)
    mask[0, ::3] = True
    scores = (q @ k.transpose(-2, -1)).masked_fill(mask[:, None, None, :], float("-inf"))
    for kk in (1, 4, 9):
        kth = scores.sort(dim=-1, descending=True).values[..., kk - 1 : kk]
        allowed = (scores >= kth) & ~mask[:, None, None, :]
        expected = dense_attention(q, k, v, allowed)
        for chunk in (1, 6, 64):
            out = topk_attention(q, k, v, kk, key_padding_mask=mask, chunk_size=chunk)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    # k = 1 returns the value of the best key.
    best = scores.argmax(-1)
    torch.testing.assert_close(
        topk_attention(q, k, v, 1, key_padding_mask=mask), v.gather(2, best[..., None].expand(-1, -1, -1, 8))
    )


@pytest.mark.parametrize("chunk", [None, 5])
def test_topk_gradients_match_dense_attention_over_the_selection(chunk):
    """Gradients of q, k, v flow through the selected keys' attention as through dense attention restricted to
    the selection (float64, padding included); the selection itself is not differentiated."""
    g = torch.Generator().manual_seed(4)
    base = [torch.randn(2, 3, 19, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[1, 12:] = True
    do = torch.randn(2, 3, 19, 8, generator=g, dtype=torch.float64)
    scores = (base[0] @ base[1].transpose(-2, -1)).masked_fill(mask[:, None, None, :], float("-inf"))
    kth = scores.sort(dim=-1, descending=True).values[..., 5:6]
    allowed = (scores >= kth) & ~mask[:, None, None, :]
    results = []
    for form in ("topk", "dense"):
        q, k, v = (t.clone().requires_grad_() for t in base)
        if form == "topk":
            out = topk_attention(q, k, v, 6, key_padding_mask=mask, chunk_size=chunk)
        else:
            out = dense_attention(q, k, v, allowed)
        out.backward(do)
        results.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


def moba_reference(q, k, v, block_ids, num_blocks, topk_blocks, mask):
    """Loop-based bidirectional MoBA: per (b, h, query) block means, top blocks, one softmax over their tokens."""
    B, H, N, _ = q.shape
    allowed = torch.zeros(B, H, N, N, dtype=torch.bool)
    for b in range(B):
        valid = ~mask[b]
        means, ok = [], []
        for j in range(num_blocks):
            sel = (block_ids == j) & valid
            ok.append(bool(sel.any()))
            means.append(k[b, :, sel].mean(dim=1) if sel.any() else torch.zeros(H, q.shape[-1]))
        means = torch.stack(means, dim=1)
        for h in range(H):
            for i in range(N):
                score = [float(q[b, h, i] @ means[h, j]) if ok[j] else float("-inf") for j in range(num_blocks)]
                top = sorted(range(num_blocks), key=lambda j: -score[j])[:topk_blocks]
                chosen = [j for j in top if ok[j]]
                allowed[b, h, i] = (torch.isin(block_ids, torch.tensor(chosen)) | (block_ids < 0)) & valid
    return dense_attention(q, k, v, allowed)


@pytest.mark.parametrize("layout", ["1d", "2d-always", "2d-routed"])
def test_moba_matches_loop_reference(layout):
    g = torch.Generator().manual_seed(10)
    if layout == "1d":
        ids, nb = block_ids_1d(22, 5)
    else:
        ids, nb = block_ids_2d((4, 5), (2, 2), 2, layout.split("-")[1])
    n = ids.numel()
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(3))
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, -7:] = True
    mask[1, 3] = True
    for topk_blocks in (1, 2, 4):
        expected = moba_reference(q, k, v, ids, nb, topk_blocks, mask)
        out = moba_attention(q, k, v, ids, nb, topk_blocks, key_padding_mask=mask, chunk_size=4)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_moba_block_layouts():
    ids, nb = block_ids_1d(10, 4)
    assert nb == 3 and ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    # A 3 x 5 grid in 2 x 2 windows: 2 x 3 windows, the last row and column narrower.
    ids, nb = block_ids_2d((3, 5), (2, 2), 1, "always")
    assert nb == 6
    assert ids.tolist() == [-1, 0, 0, 1, 1, 2, 0, 0, 1, 1, 2, 3, 3, 4, 4, 5]
    ids, nb = block_ids_2d((3, 5), (2, 2), 1, "routed")
    assert nb == 7 and ids[0] == 0 and ids[1:].min() == 1


@pytest.mark.parametrize("layout", ["2d", "1d"])
@pytest.mark.parametrize("prefix_block", ["always", "routed"])
def test_moba_with_all_blocks_equals_full(layout, prefix_block):
    full = make("full", layout)
    moba = make("moba", layout, topk_blocks=100, prefix_block=prefix_block)
    moba.load_state_dict(full.state_dict())
    x = tokens(2, 1 + 6 * 4 if layout == "2d" else 23, seed=11)
    mask = torch.zeros(x.shape[:2], dtype=torch.bool)
    mask[1, 9:] = True
    grid = (6, 4) if layout == "2d" else None
    with torch.no_grad():
        torch.testing.assert_close(moba(x, grid=grid), full(x), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            moba(x, key_padding_mask=mask, grid=grid), full(x, key_padding_mask=mask), atol=1e-5, rtol=1e-4
        )
        assert not torch.allclose(make("moba", layout, topk_blocks=1)(x, grid=grid), full(x), atol=1e-4)


def test_agent_minus_matches_paper_formula_2d():
    """Agents = AdaptiveAvgPool2d of the patch queries; V_A = softmax(A k^T s) v; O = softmax(q A^T s) V_A."""
    layer = make("agent_minus", agent_num=9)
    h, w = 5, 7
    x = tokens(2, 1 + h * w, seed=12)
    with torch.no_grad():
        q, k, v = layer.split_qkv(x)
        B, H, N, d = q.shape
        patches = q[:, :, 1:].reshape(B * H, h, w, d).permute(0, 3, 1, 2)
        agents = F.adaptive_avg_pool2d(patches, 3).reshape(B, H, d, 9).transpose(-2, -1)
        s = layer.scale
        agent_v = ((agents * s) @ k.transpose(-2, -1)).softmax(-1) @ v
        o = ((q * s) @ agents.transpose(-2, -1)).softmax(-1) @ agent_v
        torch.testing.assert_close(layer(x, grid=(h, w)), layer.output(layer.merge_heads(o)), atol=1e-5, rtol=1e-4)


def test_agent_minus_1d_pools_segments_of_valid_tokens():
    layer = make("agent_minus", "1d", agent_num=4)
    length, n = 11, 16
    x = tokens(1, n, seed=13)
    mask = torch.arange(n)[None] >= length
    with torch.no_grad():
        q, k, v = layer.split_qkv(x[:, :length])
        agents = F.adaptive_avg_pool1d(q[0].transpose(-2, -1), 4).transpose(-2, -1)[None]
        s = layer.scale
        agent_v = ((agents * s) @ k.transpose(-2, -1)).softmax(-1) @ v
        o = ((q * s) @ agents.transpose(-2, -1)).softmax(-1) @ agent_v
        expected = layer.output(layer.merge_heads(o))
        torch.testing.assert_close(layer(x, key_padding_mask=mask)[:, :length], expected, atol=1e-5, rtol=1e-4)


def test_agent_bias_and_dwc_change_the_output():
    minus = make("agent_minus")
    x = tokens(2, 17, seed=14)
    for kw in ({"agent_bias": True}, {"dwc": True}):
        layer = make("agent_minus", **kw)
        layer.load_state_dict(minus.state_dict(), strict=False)
        with torch.no_grad():
            assert not torch.allclose(layer(x), minus(x), atol=1e-4)
    # With zero biases and no DWC, the full agent equals agent_minus.
    layer = make("agent", dwc=False)
    layer.load_state_dict(minus.state_dict(), strict=False)
    with torch.no_grad():
        for p in (layer.an_bias, layer.na_bias, layer.ac_bias, layer.ca_bias):
            p.zero_()
        torch.testing.assert_close(layer(x), minus(x))
    with pytest.raises(ValueError, match="agent_num"):
        make("agent_minus", agent_num=5)(x)


def test_linear_matches_dense_formula():
    layer = make("linear")
    x = tokens(2, 17, seed=15)
    mask = torch.zeros(2, 17, dtype=torch.bool)
    mask[1, 4:10] = True
    with torch.no_grad():
        q, k, v = layer.split_qkv(x)
        a = (q.relu() @ k.relu().transpose(-2, -1)).masked_fill(mask[:, None, None, :], 0.0)
        o = (a @ v) / (a.sum(-1, keepdim=True) + layer.eps)
        expected = layer.output(layer.merge_heads(o))
        torch.testing.assert_close(layer(x, key_padding_mask=mask), expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="attn_drop"):
        create_attention("linear", DIM, HEADS, attn_drop=0.1)


@pytest.mark.parametrize("name", BASELINES)
def test_bfloat16_forward_is_finite(name):
    layer = make(name).to(torch.bfloat16)
    x = tokens(2, 17, seed=16).to(torch.bfloat16)
    mask = torch.zeros(2, 17, dtype=torch.bool)
    mask[1, 9:] = True
    with torch.no_grad():
        y = layer(x, key_padding_mask=mask)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


def test_masked_baselines_pin_their_sdpa_kernel(monkeypatch):
    """``sdpa_backend`` pins the masked attention's SDPA kernel for per-query top-k and MoBA (functions and layers):
    "math" runs under exactly that kernel and gives the "auto" result; names outside the masked kernels are
    refused."""
    import mita.layers.topk as topk_module

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 21, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(2, 21, dtype=torch.bool)
    mask[1, 15:] = True
    ids, nb = block_ids_1d(21, 4)
    pinned = []
    real = topk_module.sdpa_kernel

    def spy(backend):
        pinned.append(backend)
        return real(backend)

    monkeypatch.setattr(topk_module, "sdpa_kernel", spy)
    for fn in (
        lambda **kw: topk_attention(q, k, v, 5, key_padding_mask=mask, **kw),
        lambda **kw: moba_attention(q, k, v, ids, nb, 2, key_padding_mask=mask, **kw),
    ):
        pinned.clear()
        auto = fn()
        assert pinned == []
        torch.testing.assert_close(fn(sdpa_backend="math"), auto, atol=1e-12, rtol=1e-10)
        assert pinned == [torch.nn.attention.SDPBackend.MATH]
        for bad in ("flash", "fastest"):
            with pytest.raises(ValueError, match="sdpa_backend must be one of"):
                fn(sdpa_backend=bad)
    for name in ("topk", "moba"):
        layer = make(name, "1d", sdpa_backend="math")
        assert layer.sdpa_backend == "math" and "sdpa_backend='math'" in repr(layer)
        with pytest.raises(ValueError, match="sdpa_backend must be one of"):
            make(name, "1d", sdpa_backend="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_masked_baselines_pinned_kernels_match_auto_on_cuda(backend):
    """On CUDA (bf16, padding) each pinned masked kernel gives what "auto" gives, forward and backward."""
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(2, 2, 300, 64, generator=g).cuda().to(torch.bfloat16) for _ in range(3)]
    mask = torch.zeros(2, 300, dtype=torch.bool, device="cuda")
    mask[1, 200:] = True
    ids, nb = block_ids_1d(300, 32, device="cuda")
    for fn in (
        lambda *t, **kw: topk_attention(*t, 40, key_padding_mask=mask, **kw),
        lambda *t, **kw: moba_attention(*t, ids, nb, 3, key_padding_mask=mask, **kw),
    ):
        results = []
        for kw in ({}, {"sdpa_backend": backend}):
            ins = [t.clone().requires_grad_() for t in base]
            out = fn(*ins, **kw)
            out.float().square().sum().backward()
            results.append((out, *(t.grad for t in ins)))
        for a, b in zip(*results):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
