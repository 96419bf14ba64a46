"""Generic tests over the whole attention registry, plus MiTA-layer specifics."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models.vision_transformer import Attention, Block

import mita
from mita.layers.base import AttentionBase
from mita.selfcheck import SMALL_OPTIONS, check_attention

NAMES = mita.list_attentions()
# Options for 1D sequences (no grid, no prefix tokens).
SEQ_OPTIONS = {
    "mita": dict(m=4, k=6, landmark_layout="1d"),
    "mita_routing": dict(m=4, k=12, landmark_layout="1d"),
    "agent": dict(agent_num=4),
    "agent_minus": dict(agent_num=4),
    "moba": dict(block_size=8, topk_blocks=2),
    "topk": dict(k=6),
}

# Options for a 4 x 4 grid.
TINY_GRID_OPTIONS = {
    "mita": dict(m=4, k=5),
    "mita_routing": dict(m=4, k=10),
    "agent": dict(agent_num=4),
    "agent_minus": dict(agent_num=4),
    "moba": dict(window_size=2),
    "topk": dict(k=5),
}


def test_registry_lists_the_paper_baselines():
    for name in ("mita", "mita_routing", "full", "agent", "agent_minus", "moba", "topk", "linear"):
        assert name in NAMES


def test_unknown_attention_lists_known_names():
    with pytest.raises(ValueError, match="unknown attention 'flash'.*known attentions: .*mita"):
        mita.create_attention("flash", 64, 4)


@pytest.mark.parametrize("name", NAMES)
def test_image_forward_backward_and_reference(name):
    row = check_attention(name, dim=32, heads=2, grid=6, batch=2)
    assert row["shape"] == (2, 37, 32)
    assert row["finite"], "output has NaN/Inf"
    assert row["grads"], "some parameter received no gradient"
    if row["max_err"] is not None:
        assert row["max_err"] < 1e-4, row


def _seq_layer(name, dim=32, heads=2):
    torch.manual_seed(0)
    layer = mita.create_attention(name, dim, heads, **SEQ_OPTIONS.get(name, {}))
    layer.grid_size = None
    layer.num_prefix_tokens = 0
    return layer.eval()


@pytest.mark.parametrize("name", NAMES)
def test_padding_is_honoured(name):
    layer = _seq_layer(name)
    B, N, extra = 2, 40, 24
    x = torch.randn(B, N, 32)
    lengths = torch.tensor([40, 29])
    mask = torch.arange(N)[None] >= lengths[:, None]
    out = layer(x, key_padding_mask=mask)
    x2 = torch.cat([x, 50 * torch.randn(B, extra, 32)], dim=1)
    x2[:, :N] = torch.where(mask[..., None], 50 * torch.randn_like(x), x)
    mask2 = torch.cat([mask, torch.ones(B, extra, dtype=torch.bool)], dim=1)
    out2 = layer(x2, key_padding_mask=mask2)
    valid = ~mask
    assert torch.isfinite(out2[:, :N][valid]).all()
    torch.testing.assert_close(out2[:, :N][valid], out[valid], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_loads_timm_attention_state_dict(name):
    timm_attn = Attention(32, num_heads=2, qkv_bias=True)
    layer = mita.create_attention(name, 32, 2, qkv_bias=True, **SMALL_OPTIONS.get(name, {}))
    result = layer.load_state_dict(timm_attn.state_dict(), strict=False)
    assert not result.unexpected_keys
    own = set(dict(layer.named_parameters())) - set(timm_attn.state_dict())
    assert set(result.missing_keys) <= own | {k for k, _ in layer.named_buffers()}
    for key, value in timm_attn.state_dict().items():
        torch.testing.assert_close(layer.state_dict()[key], value)


@pytest.mark.parametrize("name", NAMES)
def test_drops_into_timm_block_and_vit(name):
    options = {**SMALL_OPTIONS.get(name, {}), **TINY_GRID_OPTIONS.get(name, {})}
    block = Block(32, 2, qkv_bias=True, attn_layer=mita.bind_attention(name, **options))
    assert isinstance(block.attn, AttentionBase)
    block.attn.grid_size = (4, 4)
    out = block(torch.randn(2, 17, 32))
    assert out.shape == (2, 17, 32) and torch.isfinite(out).all()


def test_timm_only_arguments_are_checked():
    with pytest.raises(ValueError, match="attn_mask"):
        mita.create_attention("mita", 32, 2, m=4, k=4)(torch.randn(1, 17, 32), attn_mask=torch.ones(1, 17).bool())
    with pytest.raises(ValueError, match="scale_norm"):
        mita.create_attention("full", 32, 2, scale_norm=True)
    layer = mita.create_attention("mita", 32, 2, m=4, k=4, depth=3, dtype=torch.float64)
    assert layer.qkv.weight.dtype == torch.float64


def test_vit_with_mita_runs():
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=64, num_classes=5, attn_layer=mita.bind_attention("mita", m=4, k=4)
    )
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 5)


# MiTA layer specifics


def test_mita_variants_parameter_counts():
    C = 48
    base = sum(p.numel() for p in mita.create_attention("mita", C, 4).parameters())
    full = sum(p.numel() for p in mita.create_attention("full", C, 4).parameters())
    dwc = sum(p.numel() for p in mita.create_attention("mita", C, 4, dwc=True).parameters())
    gate = sum(p.numel() for p in mita.create_attention("mita", C, 4, dwc=True, gate=True).parameters())
    assert base == full
    assert dwc - base == 10 * C
    assert gate - dwc == C * C + C


def test_mita_budget_changes_at_eval_time():
    layer = mita.create_attention("mita", 32, 2, m=4, k=4).eval()
    x = torch.randn(2, 1 + 64, 32)
    a = layer(x)
    layer.set_budget(m=16, k=20)
    b = layer(x)
    assert not torch.allclose(a, b)
    # k >= N and the routing-only layer equals full attention with the same weights.
    routing = mita.create_attention("mita_routing", 32, 2, m=4, k=65).eval()
    full = mita.create_attention("full", 32, 2).eval()
    full.load_state_dict(routing.state_dict())
    torch.testing.assert_close(routing(x), full(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="k must be"):
        layer.set_budget(k=0)


def test_mita_routing_doubles_k_and_s2():
    assert mita.create_attention("mita_routing", 32, 2).topk == 50
    layer = mita.create_attention("mita", 32, 2, m=4, k=6, experts_per_query=2)
    assert layer(torch.randn(1, 17, 32)).shape == (1, 17, 32)


def test_mita_layer_errors_name_the_argument():
    with pytest.raises(ValueError, match="attn_drop"):
        mita.create_attention("mita", 32, 2, attn_drop=0.1)
    with pytest.raises(ValueError, match="landmark_layout"):
        mita.create_attention("mita", 32, 2, landmark_layout="3d")
    with pytest.raises(ValueError, match="shared_scale"):
        mita.create_attention("mita", 32, 2, shared_scale="odd")
    with pytest.raises(ValueError, match="experts_per_query"):
        mita.create_attention("mita", 32, 2, m=4, experts_per_query=5)
    with pytest.raises(ValueError, match="num_heads"):
        mita.create_attention("mita", 32, 3)
    layer = mita.create_attention("mita", 32, 2, m=49, k=4)
    with pytest.raises(ValueError, match="m: a 7x7 landmark grid does not fit the 4x4"):
        layer(torch.randn(1, 17, 32))
    with pytest.raises(ValueError, match="grid"):
        layer(torch.randn(1, 18, 32))


def test_mita_landmark_geometry_is_checked_at_construction():
    with pytest.raises(ValueError, match="perfect square m"):
        mita.create_attention("mita", dim=384, num_heads=6, m=7)
    with pytest.raises(ValueError, match="perfect square m"):
        mita.create_attention("mita", dim=384, num_heads=6).set_budget(m=10)
    assert mita.create_attention("mita", dim=384, num_heads=6, m=7, landmark_layout="1d").m == 7
    assert mita.create_attention("mita", dim=384, num_heads=6, m=(2, 3)).m == (2, 3)


def test_mita_patches_layout_with_registers_and_non_square_grid():
    layer = mita.create_attention("mita", 32, 2, m=(2, 3), k=5, landmark_layout="patches", dwc=True)
    layer.num_prefix_tokens = 5
    out = layer(torch.randn(2, 5 + 4 * 6, 32), grid=(4, 6))
    assert out.shape == (2, 29, 32) and torch.isfinite(out).all()


def test_selfcheck_catches_a_layer_bug_that_its_own_naive_backend_would_share(monkeypatch):
    import mita.layers.mita as mita_layer

    assert check_attention("mita", dim=32, heads=2, grid=6, batch=2)["ok"]
    from mita.ops.landmarks import pool_landmarks

    def wrong_pooling(q, k, v, m, topk, *, layout, grid, num_prefix_tokens, key_padding_mask, backend, **kw):
        # The layer's landmarks scaled by 1.5: a pooling bug that a backend fed these landmarks cannot see.
        landmarks = pool_landmarks(q, m, layout=layout, grid=grid, num_prefix_tokens=num_prefix_tokens) * 1.5
        return mita.mita_attention(q, k, v, landmarks, topk, key_padding_mask=key_padding_mask, backend=backend, **kw)

    monkeypatch.setattr(mita_layer, "mita_attention_pooled", wrong_pooling)
    row = check_attention("mita", dim=32, heads=2, grid=6, batch=2)
    assert not row["ok"] and row["max_err"] > 1e-3


@pytest.mark.parametrize("name", ["agent", "agent_minus", "linear"])
def test_selfcheck_has_a_reference_for_every_baseline(name):
    row = check_attention(name, dim=32, heads=2, grid=6, batch=2)
    assert row["max_err"] is not None and row["max_err"] < 1e-6 and row["ok"], row


@pytest.mark.parametrize("name", NAMES)
def test_geometry_is_a_constructor_argument(name):
    layer = mita.create_attention(name, 32, 2, grid_size=(3, 4), num_prefix_tokens=5, **TINY_GRID_OPTIONS.get(name, {}))
    assert layer.grid_size == (3, 4) and layer.num_prefix_tokens == 5
    seq = mita.create_attention(name, 32, 2, grid_size=None, num_prefix_tokens=0, **SEQ_OPTIONS.get(name, {}))
    assert seq.grid_size is None and seq.num_prefix_tokens == 0
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        mita.create_attention(name, 32, 2, num_prefix_tokens=-1, **TINY_GRID_OPTIONS.get(name, {}))


def test_lra_builder_uses_the_class_sequence_options():
    from mita.models.lra import build_attention

    layer = build_attention("mita", 32, 2, m=4, k=6, landmark_layout="official")
    assert layer.landmark_layout == "1d" and layer.grid_size is None and layer.num_prefix_tokens == 0
    agent = build_attention("agent_minus", 32, 2, agent_num=4)
    assert agent.grid_size is None and agent.num_prefix_tokens == 0
    x = torch.randn(2, 23, 32)
    assert agent(x).shape == x.shape and layer(x).shape == x.shape
