"""DeiT / ViT backbones with any registered attention, as timm entrypoints.

``timm.create_model("mita_deit_small_patch16_224", attention="mita", attention_kwargs={"m": 25, "k": 25})``
builds timm's ``VisionTransformer`` with every block's attention taken from :mod:`mita.registry`. Parameter names
are timm's, so a plain DeiT state dict loads (``strict=True`` when the attention adds no parameters, e.g. ``full``,
``mita``, ``topk``; ``strict=False`` reports exactly the extra parameters of DWC or Gate as missing).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import register_model
from timm.models.vision_transformer import Block, VisionTransformer

from mita.registry import create_attention
from mita.utils.tensor_cache import outside_inference_mode

# DeiT's evaluation settings (facebookresearch/deit: crop 0.875, bicubic), used by timm.data.resolve_data_config.
DEIT_PRETRAINED_CFG = {
    "num_classes": 1000,
    "input_size": (3, 224, 224),
    "pool_size": None,
    "crop_pct": 0.875,
    "interpolation": "bicubic",
    "fixed_input_size": True,
    "mean": IMAGENET_DEFAULT_MEAN,
    "std": IMAGENET_DEFAULT_STD,
    "first_conv": "patch_embed.proj",
    "classifier": "head",
}

DEIT_SIZES = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    "large": dict(embed_dim=1024, depth=24, num_heads=16),
}


def split_attention_spec(
    attention: str | Mapping[str, Any], attention_kwargs: Mapping[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """Normalise an attention spec to ``(name, kwargs)``.

    Args:
        attention: a registered name (``"mita"``) or a mapping ``{"name": "mita", "m": 25, ...}`` (the form the
            Hydra configs use).
        attention_kwargs: extra keyword arguments; they override keys of the mapping.

    Returns:
        (name, kwargs) with kwargs a plain dict.
    """
    if isinstance(attention, Mapping):
        spec = dict(attention)
        if "name" not in spec:
            raise ValueError(f"attention: a mapping needs a 'name' key, got keys {sorted(spec)}")
        name = str(spec.pop("name"))
    else:
        name, spec = str(attention), {}
    spec.update(dict(attention_kwargs or {}))
    return name, spec


class AttentionBlock(Block):
    """timm's pre-norm ``Block`` whose attention comes from the registry.

    Args:
        attention: registered attention name.
        attention_kwargs: the attention's own options (for MiTA: ``m``, ``k``, ``dwc``, ``gate``, ...).
        **kwargs: timm ``Block`` arguments (``dim``, ``num_heads``, ``qkv_bias``, ``drop_path``, ...).
    """

    def __init__(self, *, attention: str, attention_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        dim, num_heads = kwargs["dim"], kwargs["num_heads"]
        layer_kwargs: dict[str, Any] = dict(
            qkv_bias=kwargs.get("qkv_bias", False),
            qk_norm=kwargs.get("qk_norm", False),
            attn_drop=kwargs.get("attn_drop", 0.0),
            proj_drop=kwargs.get("proj_drop", 0.0),
        )
        if not kwargs.get("proj_bias", True):
            layer_kwargs["proj_bias"] = False
        if layer_kwargs["qk_norm"] and kwargs.get("norm_layer") is not None:
            layer_kwargs["norm_layer"] = kwargs["norm_layer"]
        layer_kwargs.update(attention_kwargs or {})
        self.attn = create_attention(attention, dim, num_heads, **layer_kwargs)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args:
            x: [B, N, C] tokens.
            attn_mask, is_causal: timm's arguments; not supported by the registry's layers (use key_padding_mask).
            key_padding_mask: [B, N] bool, True = padding.

        Returns:
            [B, N, C].
        """
        if attn_mask is not None or is_causal:
            raise ValueError("AttentionBlock: attn_mask / is_causal are not supported; pass key_padding_mask")
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), key_padding_mask=key_padding_mask)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class AttentionVisionTransformer(VisionTransformer):
    """timm ``VisionTransformer`` whose blocks use a registered attention.

    Every attention layer gets ``grid_size`` (the patch grid) and ``num_prefix_tokens`` (CLS, registers) from the
    patch embedding, and again after :meth:`set_input_size`.

    Args:
        attention: registered name or ``{"name": ..., **options}``.
        attention_kwargs: the attention's own options.
        **kwargs: ``VisionTransformer`` arguments.
    """

    def __init__(
        self,
        attention: str | Mapping[str, Any] = "full",
        attention_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        name, options = split_attention_spec(attention, attention_kwargs)
        if kwargs.get("dynamic_img_size"):
            raise ValueError("dynamic_img_size is not supported: attention layers need a fixed patch grid")
        kwargs["block_fn"] = partial(AttentionBlock, attention=name, attention_kwargs=options)
        super().__init__(**kwargs)
        self.attention_name = name
        self.attention_kwargs = options
        self.sync_attention_layout()

    def sync_attention_layout(self) -> None:
        """Write the patch grid and the number of prefix tokens into every attention layer."""
        grid = tuple(int(g) for g in self.patch_embed.grid_size)
        for block in self.blocks:
            block.attn.grid_size = grid
            block.attn.num_prefix_tokens = self.num_prefix_tokens

    def set_input_size(self, *args: Any, **kwargs: Any) -> None:
        """timm's ``set_input_size`` (new image or patch size), then the attention layers follow the new grid."""
        super().set_input_size(*args, **kwargs)
        self.sync_attention_layout()


def _create(
    size: str, pretrained: bool, attention: str | Mapping[str, Any], **kwargs: Any
) -> AttentionVisionTransformer:
    if pretrained:
        raise ValueError(
            "pretrained: no MiTA weights are published; build the model and load a timm DeiT state dict "
            "(model.load_state_dict(timm.create_model('deit_small_patch16_224', pretrained=True).state_dict()))"
        )
    # timm.create_model passes these; a VisionTransformer does not take them.
    for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
        kwargs.pop(key, None)
    args = dict(patch_size=16, **DEIT_SIZES[size])
    args.update(kwargs)
    model = AttentionVisionTransformer(attention=attention, **args)
    cfg = dict(DEIT_PRETRAINED_CFG, input_size=(3, *model.patch_embed.img_size), num_classes=model.num_classes)
    model.pretrained_cfg = cfg
    model.default_cfg = cfg
    return model


@register_model
def mita_deit_tiny_patch16_224(
    pretrained: bool = False, attention: str | Mapping[str, Any] = "mita", **kwargs: Any
) -> AttentionVisionTransformer:
    """DeiT-T (dim 192, depth 12, 3 heads) with a registered attention (default ``"mita"``)."""
    return _create("tiny", pretrained, attention, **kwargs)


@register_model
def mita_deit_small_patch16_224(
    pretrained: bool = False, attention: str | Mapping[str, Any] = "mita", **kwargs: Any
) -> AttentionVisionTransformer:
    """DeiT-S (dim 384, depth 12, 6 heads) with a registered attention (default ``"mita"``)."""
    return _create("small", pretrained, attention, **kwargs)


@register_model
def mita_deit_base_patch16_224(
    pretrained: bool = False, attention: str | Mapping[str, Any] = "mita", **kwargs: Any
) -> AttentionVisionTransformer:
    """DeiT-B (dim 768, depth 12, 12 heads) with a registered attention (default ``"mita"``)."""
    return _create("base", pretrained, attention, **kwargs)


@register_model
def mita_vit_large_patch16_224(
    pretrained: bool = False, attention: str | Mapping[str, Any] = "mita", **kwargs: Any
) -> AttentionVisionTransformer:
    """ViT-L/16 (dim 1024, depth 24, 16 heads, qkv bias) with a registered attention (default ``"mita"``).

    Parameter names are timm's ``vit_large_patch16_224``, so its AugReg weights load; those weights expect
    mean = std = 0.5 and crop 0.9 (the pretrained cfg below; the data config sets the loader's values).
    """
    model = _create("large", pretrained, attention, **kwargs)
    cfg = dict(model.pretrained_cfg, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=0.9)
    model.pretrained_cfg = model.default_cfg = cfg
    return model


class Rope2D(nn.Module):
    """Rotary position embedding for ViT-5 style token sequences ``[prefix tokens, h x w patches]``.

    Patches get axial 2D RoPE: the first half of each head's channels rotates with the row index, the second half
    with the column index (pairs of channels, frequencies ``theta^(-2i / (d/2))``). The prefix tokens (CLS and
    registers) get their own 1D RoPE over their index ``0 .. P-1`` with ``prefix_theta``. ASSUMPTION: the spec
    gives theta 100 for the registers; the patches' theta is not stated and is 100 here too (a config value).

    Args:
        head_dim: d (a multiple of 4).
        theta: base of the patch frequencies.
        prefix_theta: base of the prefix tokens' frequencies.
    """

    def __init__(self, head_dim: int, theta: float = 100.0, prefix_theta: float = 100.0) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"head_dim must be a multiple of 4 for 2D RoPE, got {head_dim}")
        self.head_dim, self.theta, self.prefix_theta = head_dim, float(theta), float(prefix_theta)
        self.grid_size: tuple[int, int] = (1, 1)
        self.num_prefix_tokens = 0
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def angles(self, device: torch.device) -> torch.Tensor:
        """[N, d/2] rotation angles of every token for the current grid and prefix."""
        d, (h, w), p = self.head_dim, self.grid_size, self.num_prefix_tokens
        quarter = torch.arange(d // 4, device=device, dtype=torch.float32)
        freqs = self.theta ** (-quarter / (d // 4))
        rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w)
        cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h)
        patches = torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], dim=-1)
        half = torch.arange(d // 2, device=device, dtype=torch.float32)
        prefix_freqs = self.prefix_theta ** (-half / (d // 2))
        prefix = torch.arange(p, device=device, dtype=torch.float32)[:, None] * prefix_freqs
        return torch.cat([prefix, patches], dim=0)

    @outside_inference_mode
    def _cos_sin(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.angles(device)
        return a.cos(), a.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [B, H, N, d] (N = prefix + h w); computed in float32."""
        key = (x.device, self.grid_size, self.num_prefix_tokens)
        if key not in self._cache:
            self._cache = {key: self._cos_sin(x.device)}
        cos, sin = self._cache[key]
        if x.shape[-2] != cos.shape[0]:
            raise ValueError(f"rope: {x.shape[-2]} tokens, expected {cos.shape[0]} (prefix + grid {self.grid_size})")
        x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return out.flatten(-2)


class ViT5(AttentionVisionTransformer):
    """ViT-5 (arXiv 2602.08071) as the MiTA reference uses it: RMSNorm (eps 1e-6), QK-norm, LayerScale 1e-4, no
    qkv bias, GELU MLP, CLS + 4 registers, a learned absolute position embedding on the patches plus RoPE on q
    and k (:class:`Rope2D`), with any registered attention.

    Args:
        attention: registered name or ``{"name": ..., **options}``.
        attention_kwargs: the attention's own options.
        rope_theta, prefix_rope_theta: RoPE bases (patches; CLS and registers).
        **kwargs: ``VisionTransformer`` arguments.
    """

    def __init__(
        self,
        attention: str | Mapping[str, Any] = "full",
        attention_kwargs: Mapping[str, Any] | None = None,
        rope_theta: float = 100.0,
        prefix_rope_theta: float = 100.0,
        **kwargs: Any,
    ) -> None:
        from timm.layers import RmsNorm

        args = dict(
            norm_layer=partial(RmsNorm, eps=1e-6),
            qkv_bias=False,
            qk_norm=True,
            init_values=1e-4,
            reg_tokens=4,
            no_embed_class=True,
        )
        args.update(kwargs)
        super().__init__(attention=attention, attention_kwargs=attention_kwargs, **args)
        self.rope = Rope2D(self.embed_dim // self.blocks[0].attn.num_heads, rope_theta, prefix_rope_theta)
        self.sync_attention_layout()

    def sync_attention_layout(self) -> None:
        """Grid and prefix for every attention layer and the shared rotary embedding."""
        super().sync_attention_layout()
        rope = getattr(self, "rope", None)
        if rope is None:
            return
        rope.grid_size = tuple(int(g) for g in self.patch_embed.grid_size)
        rope.num_prefix_tokens = self.num_prefix_tokens
        for block in self.blocks:
            # Shared, parameter-free; bypass Module registration so the state dict stays timm's.
            object.__setattr__(block.attn, "rope", rope)


@register_model
def mita_vit5_small_patch16_224(
    pretrained: bool = False, attention: str | Mapping[str, Any] = "mita", **kwargs: Any
) -> ViT5:
    """ViT-5-S (dim 384, depth 12, 6 heads, CLS + 4 registers, N = 201) with a registered attention.

    For MiTA the reference pools landmarks from the patch queries only (``landmark_layout="patches"``), m = 25,
    k = 30.
    """
    if pretrained:
        raise ValueError("pretrained: no ViT-5 weights are available here")
    for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
        kwargs.pop(key, None)
    args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0)
    args.update(kwargs)
    model = ViT5(attention=attention, **args)
    cfg = dict(
        DEIT_PRETRAINED_CFG, crop_pct=1.0, input_size=(3, *model.patch_embed.img_size), num_classes=model.num_classes
    )
    model.pretrained_cfg = model.default_cfg = cfg
    return model


def create_vit(model_name: str, attention: str | Mapping[str, Any] = "full", **kwargs: Any) -> nn.Module:
    """``timm.create_model`` for the entrypoints above, taking the attention as a name or a mapping.

    Args:
        model_name: ``"mita_deit_{tiny,small,base}_patch16_224"``.
        attention: ``"mita"`` or ``{"name": "mita", "m": 25, "k": 25, ...}``.
        **kwargs: ``VisionTransformer`` arguments (``num_classes``, ``img_size``, ``depth``, ``drop_path_rate``...).

    Returns:
        The model.
    """
    import timm

    name, options = split_attention_spec(attention)
    return timm.create_model(model_name, attention=name, attention_kwargs=options, **kwargs)
