"""The MiTA operator: reference, PyTorch backend and the dispatching public function; the fused Triton kernels are
the subpackage ``mita.ops.mita.triton``."""

from mita.ops.mita.api import list_backends, mita_attention, mita_attention_pooled, register_backend
from mita.ops.mita.naive import naive_mita, stable_topk_indices

__all__ = [
    "list_backends",
    "mita_attention",
    "mita_attention_pooled",
    "naive_mita",
    "register_backend",
    "stable_topk_indices",
]
