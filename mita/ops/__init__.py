"""Functions on tensors: the MiTA operator and landmark pooling."""

from mita.ops.landmarks import pool_landmarks
from mita.ops.mita import list_backends, mita_attention, mita_attention_pooled, naive_mita, register_backend

__all__ = [
    "list_backends",
    "mita_attention",
    "mita_attention_pooled",
    "naive_mita",
    "pool_landmarks",
    "register_backend",
]
