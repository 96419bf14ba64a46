"""ViT-5 backbones (arXiv 2602.08071) with any registered attention, as timm entrypoints.

ViT-5-S: dim 384, depth 12, 6 heads, MLP ratio 4 with GELU, no qkv bias, RMSNorm (eps 1e-6), QK-norm (RMSNorm
per head), LayerScale (init 1e-4), a learned absolute position embedding on the patches plus 2D rotary
embeddings, and CLS + 4 register tokens (N = 201 at 224 x 224). MiTA pools its landmarks from the 196 patch
queries only (``landmark_layout="patches"``), after QK-norm and RoPE, with m = 25 and k = 30.

ASSUMPTION (the ViT-5 code is not available to us): axial 2D RoPE on patches (the first half of each head's
channels rotates with the row index, the second half with the column index) and 1D RoPE over the prefix
tokens (positions 0..4), both with theta 100; the absolute position embedding covers the patches only
(timm's ``no_embed_class=True``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from timm.layers import RmsNorm
from timm.models import register_model

from mita.models.vit import AttentionVisionTransformer

VIT5_SIZES = {
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
}


def _rope_angles(positions: torch.Tensor, n_channels: int, theta: float) -> torch.Tensor:
    """Rotation angles [len(positions), n_channels // 2] for rotating channel pairs of a band of n_channels."""
    freqs = theta ** (-torch.arange(0, n_channels, 2, dtype=torch.float64) / n_channels)
    return positions.double()[:, None] * freqs[None, :]


class Rope2D(nn.Module):
    """Rotary position embedding for ``[prefix tokens, h x w patches]`` (see the module docstring).

    Args:
        head_dim: channels per head; must be divisible by 4.
        grid: patch grid (h, w).
        num_prefix_tokens: CLS and register tokens before the patches.
        theta: RoPE base of the patch and prefix frequencies.
    """

    def __init__(self, head_dim: int, grid: tuple[int, int], num_prefix_tokens: int, theta: float = 100.0) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"head_dim must be divisible by 4 for 2D RoPE, got {head_dim}")
        h, w = grid
        half = head_dim // 2
        rows = torch.arange(h).repeat_interleave(w)
        cols = torch.arange(w).repeat(h)
        patch = torch.cat([_rope_angles(rows, half, theta), _rope_angles(cols, half, theta)], dim=1)
        prefix = _rope_angles(torch.arange(num_prefix_tokens), head_dim, theta)
        angles = torch.cat([prefix, patch], dim=0)  # [N, head_dim / 2]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, H, N, d] -> x with channel pairs (2i, 2i + 1) rotated per token, in float32."""
        if x.shape[-2] != self.cos.shape[0]:
            raise ValueError(f"RoPE: built for N={self.cos.shape[0]} tokens, got N={x.shape[-2]}")
        x = x.float()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack([x1 * self.cos - x2 * self.sin, x1 * self.sin + x2 * self.cos], dim=-1)
        return rotated.flatten(-2)


class ViT5(AttentionVisionTransformer):
    """ViT-5 with a registered attention in every block. Arguments as :class:`AttentionVisionTransformer`,
    plus ``rope_theta``."""

    def __init__(self, rope_theta: float = 100.0, **kwargs: Any) -> None:
        self.rope_theta = rope_theta
        super().__init__(**kwargs)

    def sync_attention_layout(self) -> None:
        """Grid, prefix tokens and one shared rotary embedding for every attention layer."""
        super().sync_attention_layout()
        grid = tuple(int(g) for g in self.patch_embed.grid_size)
        rope = Rope2D(self.blocks[0].attn.head_dim, grid, self.num_prefix_tokens, self.rope_theta)
        rope = rope.to(self.pos_embed.device)
        for block in self.blocks:
            block.attn.rope = rope


def _create(size: str, pretrained: bool, attention: str | Mapping[str, Any], **kwargs: Any) -> ViT5:
    if pretrained:
        raise ValueError("pretrained: no ViT-5 weights can be downloaded here; load a local state dict instead")
    for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
        kwargs.pop(key, None)
    args: dict[str, Any] = dict(
        patch_size=16,
        mlp_ratio=4.0,
        qkv_bias=False,
        qk_norm=True,
        norm_layer=partial(RmsNorm, eps=1e-6),
        init_values=1e-4,
        reg_tokens=4,
        class_token=True,
        no_embed_class=True,
        **VIT5_SIZES[size],
    )
    args.update(kwargs)
    return ViT5(attention=attention, **args)


def _default_attention(attention: str | Mapping[str, Any]) -> str | Mapping[str, Any]:
    # MiTA in ViT-5 pools landmarks from the patch queries only.
    if attention == "mita":
        return {"name": "mita", "m": 25, "k": 30, "landmark_layout": "patches"}
    return attention


@register_model
def mita_vit5_small_patch16_224(
    pretrained: bool = False, attention: str | Mapping[str, Any] = "mita", **kwargs: Any
) -> ViT5:
    """ViT-5-S (dim 384, depth 12, 6 heads, CLS + 4 registers) with a registered attention (default MiTA with
    m = 25, k = 30, landmarks from the patches)."""
    return _create("small", pretrained, _default_attention(attention), **kwargs)


@register_model
def mita_vit5_base_patch16_224(
    pretrained: bool = False, attention: str | Mapping[str, Any] = "mita", **kwargs: Any
) -> ViT5:
    """ViT-5-B (dim 768, depth 12, 12 heads, CLS + 4 registers) with a registered attention."""
    return _create("base", pretrained, _default_attention(attention), **kwargs)
