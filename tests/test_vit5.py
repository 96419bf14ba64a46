"""ViT-5 backbone: layout, rotary embedding, MiTA landmarks from patches, FLOPs against the paper's column."""

from __future__ import annotations

import pytest
import timm
import torch

import mita.models.vit5  # noqa: F401  (registers the entrypoints)
from mita.models.vit5 import Rope2D
from mita.utils.flops import count_params, model_gmacs


def test_rope_is_a_rotation_with_relative_positions():
    rope = Rope2D(head_dim=8, grid=(4, 5), num_prefix_tokens=5)
    x = torch.randn(1, 1, 25, 8)
    torch.testing.assert_close(rope(x).norm(dim=-1), x.norm(dim=-1))
    # The same q and k vectors at every position: q_i . k_j depends only on the patch offset (i - j).
    q = torch.randn(8).expand(1, 1, 25, 8)
    k = torch.randn(8).expand(1, 1, 25, 8)
    scores = (rope(q) @ rope(k).transpose(-1, -2))[0, 0]
    patch = lambda r, c: 5 + r * 5 + c  # noqa: E731
    torch.testing.assert_close(scores[patch(0, 0), patch(1, 2)], scores[patch(2, 1), patch(3, 3)])
    assert not torch.allclose(scores[patch(0, 0), patch(1, 2)], scores[patch(0, 0), patch(2, 1)])
    with pytest.raises(ValueError, match="N=25"):
        rope(torch.randn(1, 1, 24, 8))


@pytest.mark.parametrize("attention", ["full", "mita"])
def test_vit5_small_layout_and_backward(attention):
    model = timm.create_model("mita_vit5_small_patch16_224", attention=attention, img_size=64, num_classes=4, depth=2)
    assert model.num_prefix_tokens == 5
    attn = model.blocks[0].attn
    assert attn.num_prefix_tokens == 5 and attn.grid_size == (4, 4) and attn.rope is not None
    if attention == "mita":
        assert attn.landmark_layout == "patches" and attn.k == 30
        attn.set_budget(m=4)
        for block in model.blocks[1:]:
            block.attn.set_budget(m=4)
    out = model(torch.randn(2, 3, 64, 64))
    out.sum().backward()
    assert out.shape == (2, 4)
    assert all(p.grad is not None for p in model.parameters())
    # RoPE buffers are not part of the checkpoint.
    assert not any("rope" in key for key in model.state_dict())


@pytest.mark.slow
def test_vit5_small_flops_and_params_match_the_paper_column():
    full = timm.create_model("mita_vit5_small_patch16_224", attention="full")
    mita_model = timm.create_model("mita_vit5_small_patch16_224", attention="mita")
    assert round(model_gmacs(full), 1) == 4.7
    assert round(model_gmacs(mita_model), 1) == 4.5
    assert round(count_params(mita_model) / 1e6) == 22
