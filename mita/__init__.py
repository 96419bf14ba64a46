"""MiTA: Mixture-of-Top-k Attention.

ops (functions on tensors) -> layers (nn.Modules, one registry) -> models (backbones).
"""

import mita.models  # noqa: F401  (registers the timm entrypoints mita_deit_*, mita_vit5_*)
from mita.ops import list_backends, mita_attention, mita_attention_pooled, naive_mita, pool_landmarks, register_backend
from mita.registry import bind_attention, create_attention, get_attention_class, list_attentions, register_attention

__version__ = "0.1.0"

__all__ = [
    "bind_attention",
    "create_attention",
    "get_attention_class",
    "list_attentions",
    "list_backends",
    "mita_attention",
    "mita_attention_pooled",
    "naive_mita",
    "pool_landmarks",
    "register_attention",
    "register_backend",
]
