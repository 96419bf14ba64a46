"""The MiTA operator: reference, PyTorch backend, fused Triton kernels and the dispatching public function."""

from mita.ops.mita.api import list_backends, mita_attention, register_backend
from mita.ops.mita.naive import naive_mita

__all__ = ["list_backends", "mita_attention", "naive_mita", "register_backend"]
