"""Shared base of every attention layer: timm-compatible projections, heads and input checks."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mita.ops.landmarks import resolve_patch_grid

# Keywords timm's Block passes to its attention layer that this project's layers take care of centrally.
_TIMM_ONLY_KWARGS = ("scale_norm", "depth", "device", "dtype", "attn_head_dim", "dim_out", "gated")


class AttentionBase(nn.Module):
    """The parts every attention shares with ``timm.models.vision_transformer.Attention``.

    Parameter names match timm (``qkv``, ``q_norm``, ``k_norm``, ``proj``), so a timm full-attention state dict
    loads into any subclass whose extra parameters (if any) are left at their initial values
    (``load_state_dict(strict=False)`` reports exactly those extras as missing).

    Args:
        dim: token width C.
        num_heads: heads H; ``dim`` must be divisible by it.
        qkv_bias: bias on the qkv projection.
        qk_norm: normalise q and k per head (``norm_layer`` over the head dim), as timm does.
        attn_drop: dropout on attention probabilities (layers that cannot honour it raise).
        proj_drop: dropout after the output projection.
        proj_bias: bias on the output projection.
        norm_layer: the qk-norm layer class (None: LayerNorm).
        qkv_mult: width multiple of the qkv projection (3 for q, k, v; 4 when a layer adds a gate).
        grid_size: the patch grid (h, w) of the tokens after the prefix; None: a square inferred from N at each
            call (images), or no grid at all for sequences (with ``num_prefix_tokens=0``).
        num_prefix_tokens: tokens before the patches (CLS, registers); 0 for sequences. Every registered
            attention takes these two keywords.
    """

    # Constructor options a layer needs on 1D sequences (no image grid), e.g. MiTA's 1D landmarks.
    sequence_options: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        """Make every subclass accept what timm's ``Block`` passes (see ``_timm_compatible``)."""
        super().__init_subclass__(**kwargs)
        for name in ("__init__", "forward"):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_timm_compatible", False):
                setattr(cls, name, _timm_compatible(fn, name))

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        proj_bias: bool = True,
        norm_layer: type[nn.Module] | None = None,
        qkv_mult: int = 3,
        *,
        grid_size: tuple[int, int] | None = None,
        num_prefix_tokens: int = 1,
    ) -> None:
        super().__init__()
        if num_heads < 1 or dim % num_heads != 0:
            raise ValueError(f"num_heads must divide dim, got dim={dim}, num_heads={num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * qkv_mult, bias=qkv_bias)
        norm_layer = norm_layer or nn.LayerNorm
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.attn_drop_p = float(attn_drop)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        # Token layout: the patch grid (None: a square inferred from N at each call, or no grid for sequences) and
        # the tokens before the patches (CLS, registers; 0 for sequences). Models that change the input size may
        # set them again later (timm's set_input_size).
        if grid_size is not None and (len(grid_size) != 2 or min(grid_size) < 1):
            raise ValueError(f"grid_size must be None or (h, w) with h, w >= 1, got {grid_size!r}")
        if num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
        self.grid_size: tuple[int, int] | None = None if grid_size is None else (int(grid_size[0]), int(grid_size[1]))
        self.num_prefix_tokens: int = int(num_prefix_tokens)
        # Rotary position embedding applied to q and k after their norms, set by models that use one (ViT-5).
        self.rope: nn.Module | None = None

    def split_qkv(self, x: torch.Tensor, n_parts: int = 3) -> list[torch.Tensor]:
        """[B, N, C] -> n_parts tensors [B, H, N, d]; q and k pass through their norms, then the rotary
        embedding if the layer has one (cast back to v's dtype: a float32 RoPE would promote them)."""
        B, N, _ = x.shape
        parts = self.qkv(x).reshape(B, N, n_parts, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        parts = list(parts)
        parts[0] = self.q_norm(parts[0])
        parts[1] = self.k_norm(parts[1])
        if self.rope is not None:
            parts[0] = self.rope(parts[0]).to(parts[2].dtype)
            parts[1] = self.rope(parts[1]).to(parts[2].dtype)
        return parts

    def merge_heads(self, o: torch.Tensor) -> torch.Tensor:
        """[B, H, N, d] -> [B, N, C]."""
        B, H, N, d = o.shape
        return o.transpose(1, 2).reshape(B, N, H * d)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Output projection and dropout on merged [B, N, C] features."""
        return self.proj_drop(self.proj(o))

    def check_input(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> None:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be [B, N, {self.dim}], got shape {tuple(x.shape)}")
        if key_padding_mask is not None:
            if key_padding_mask.shape != x.shape[:2] or key_padding_mask.dtype != torch.bool:
                raise ValueError(
                    f"key_padding_mask must be a bool tensor of shape {tuple(x.shape[:2])} (True = padding), "
                    f"got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
                )

    def resolve_grid(self, n_tokens: int, grid: tuple[int, int] | None) -> tuple[int, int]:
        """The patch grid (h, w): the argument, else the layer's ``grid_size``, else a square inferred from N."""
        return resolve_patch_grid(n_tokens, self.num_prefix_tokens, grid if grid is not None else self.grid_size)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}"


def _timm_compatible(fn, name: str):
    """Wrap a subclass's ``__init__`` or ``forward`` so it takes timm's extra arguments.

    ``__init__``: ``scale_norm`` (only False), ``depth`` (ignored), ``device`` / ``dtype`` (applied after
    construction), ``attn_head_dim`` / ``dim_out`` (only None) and ``gated`` (only False).
    ``forward``: ``attn_mask`` (only None; use ``key_padding_mask``) and ``is_causal`` (only False).
    """
    if name == "__init__":

        @functools.wraps(fn)
        def init(self, *args, **kwargs):
            extra = {key: kwargs.pop(key) for key in _TIMM_ONLY_KWARGS if key in kwargs}
            for key in ("scale_norm", "gated"):
                if extra.get(key):
                    raise ValueError(f"{key}=True is not supported by {type(self).__name__}")
            for key in ("attn_head_dim", "dim_out"):
                if extra.get(key) is not None:
                    raise ValueError(f"{key} must be None for {type(self).__name__}, got {extra[key]!r}")
            fn(self, *args, **kwargs)
            if type(self).__init__ is init and (extra.get("device") is not None or extra.get("dtype") is not None):
                self.to(device=extra.get("device"), dtype=extra.get("dtype"))

        init._timm_compatible = True
        return init

    @functools.wraps(fn)
    def forward(self, x, *args, attn_mask=None, is_causal=False, **kwargs):
        if attn_mask is not None:
            raise ValueError(
                f"attn_mask is not supported by {type(self).__name__}; pass key_padding_mask [B, N] (True = padding)"
            )
        if is_causal:
            raise ValueError(f"is_causal=True is not supported by {type(self).__name__} (encoder attention)")
        return fn(self, x, *args, **kwargs)

    forward._timm_compatible = True
    return forward
