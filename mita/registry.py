"""One registry for every attention layer: name -> class.

Every registered class takes the timm ``Attention`` constructor arguments (``dim, num_heads, qkv_bias,
qk_norm, attn_drop, proj_drop``, plus its own keywords) and ``forward(x, key_padding_mask=None, grid=None)``
on ``[B, N, C]`` tokens, so any of them drops into a timm VisionTransformer block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

_ATTENTIONS: dict[str, type[nn.Module]] = {}


def register_attention(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator that registers an attention layer under ``name``."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _ATTENTIONS and _ATTENTIONS[name] is not cls:
            raise ValueError(f"attention name {name!r} is already registered to {_ATTENTIONS[name].__name__}")
        _ATTENTIONS[name] = cls
        cls.attention_name = name
        return cls

    return wrap


def _ensure_loaded() -> None:
    # Importing the layers package runs every @register_attention decorator.
    import mita.layers  # noqa: F401


def list_attentions() -> list[str]:
    """Names of every registered attention, sorted."""
    _ensure_loaded()
    return sorted(_ATTENTIONS)


def get_attention_class(name: str) -> type[nn.Module]:
    """The class registered under ``name``; raises ValueError listing the known names otherwise."""
    _ensure_loaded()
    if name not in _ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}; known attentions: {', '.join(sorted(_ATTENTIONS))}")
    return _ATTENTIONS[name]


def create_attention(name: str, dim: int, num_heads: int = 8, **kwargs) -> nn.Module:
    """Build the attention registered under ``name``.

    Args:
        name: a name from :func:`list_attentions` (``"mita"``, ``"full"``, ``"agent"``, ...).
        dim: token width C.
        num_heads: number of heads; must divide ``dim``.
        **kwargs: timm Attention arguments (``qkv_bias``, ``qk_norm``, ``attn_drop``, ``proj_drop``) and the
            layer's own options (for MiTA: ``m``, ``k``, ``experts_per_query``, ``dwc``, ``gate``, ...).
    """
    return get_attention_class(name)(dim, num_heads, **kwargs)


def bind_attention(name: str, **options) -> type[nn.Module]:
    """A subclass of the attention ``name`` with ``options`` as its defaults, for APIs that take a class.

    Example: ``timm.create_model("vit_small_patch16_224", attn_layer=bind_attention("mita", m=25, k=25))``.
    """
    base = get_attention_class(name)

    def __init__(self, dim: int, num_heads: int = 8, **kwargs) -> None:
        base.__init__(self, dim, num_heads, **{**options, **kwargs})

    return type(f"{base.__name__}Bound", (base,), {"__init__": __init__, "bound_options": dict(options)})
