"""Functions on tensors: the MiTA operator, landmark pooling and per-row top-k selection."""

from mita.ops.landmarks import pool_landmarks
from mita.ops.mita import list_backends, mita_attention, mita_attention_pooled, naive_mita, register_backend
from mita.ops.row_topk import row_topk_bias

__all__ = [
    "list_backends",
    "mita_attention",
    "mita_attention_pooled",
    "naive_mita",
    "pool_landmarks",
    "register_backend",
    "row_topk_bias",
]
