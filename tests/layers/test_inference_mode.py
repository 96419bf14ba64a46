"""A first call under torch.inference_mode() must not break training later in the process (cached tables)."""

from __future__ import annotations

import pytest
import timm
import torch

# Small-grid options of every attention (the layers' defaults are for 197 tokens).
from test_registry import TINY_GRID_OPTIONS as GRID_OPTIONS

import mita
from mita.models.vit import Rope2D
from mita.ops import landmarks


@pytest.fixture(autouse=True)
def fresh_caches():
    # Each case must build its tables inside inference mode first, not find them from an earlier test.
    landmarks.adaptive_pool_matrix.cache_clear()
    landmarks._pool_tables.cache_clear()
    yield


@pytest.mark.parametrize("name", mita.list_attentions())
def test_layer_trains_after_a_first_call_in_inference_mode(name):
    torch.manual_seed(0)
    layer = mita.create_attention(name, 32, 2, **GRID_OPTIONS.get(name, {}))
    layer.grid_size, layer.num_prefix_tokens = (6, 6), 1
    x = torch.randn(2, 37, 32)
    with torch.inference_mode():
        expected = layer(x)
    out = layer(x)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), expected)
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)


@pytest.mark.parametrize("layout,n,m", [("official", 197, 25), ("patches", 16 + 1, 4), ("1d", 50, 7)])
def test_pool_landmarks_trains_after_inference_mode(layout, n, m):
    q = torch.randn(2, 3, n, 8)
    with torch.inference_mode():
        expected = mita.pool_landmarks(q, m, layout=layout)
    q.requires_grad_(True)
    out = mita.pool_landmarks(q, m, layout=layout)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out.detach(), expected)
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_rope_tables_built_in_inference_mode_are_normal_tensors():
    rope = Rope2D(16, theta=100.0, prefix_theta=100.0)
    rope.grid_size, rope.num_prefix_tokens = (3, 4), 2
    x = torch.randn(1, 2, 14, 16)
    with torch.inference_mode():
        expected = rope(x)
    x.requires_grad_(True)
    out = rope(x)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), expected)
    assert x.grad is not None


def test_timm_vit_with_mita_trains_after_an_inference_call():
    net = timm.create_model(
        "vit_tiny_patch16_224", img_size=64, num_classes=3, attn_layer=mita.bind_attention("mita", m=4, k=4)
    )
    x = torch.randn(2, 3, 64, 64)
    net.eval()
    with torch.inference_mode():
        net(x)
    net.train()
    net(x).sum().backward()
    assert net.head.weight.grad is not None
