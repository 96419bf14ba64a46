"""The MiTA backend "triton" (the fused kernels, ``op.triton_mita``): what it supports and its entry; registered by
``mita.ops.mita.api`` when this package imports. Importing this module needs no Triton."""

from __future__ import annotations

import torch

from mita.ops.mita.triton.launch import interpreting

SUPPORTED_HEAD_DIMS = (32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports(q: torch.Tensor, k=None, v=None, landmarks=None, topk=None, **kw) -> str | None:
    """Whether the Triton backend can run this call.

    Args:
        q: ``[B, H, N, d]`` queries (k, v, landmarks are checked by the operator's own argument checks).
        topk: keys per routed expert (unused here).
        **kw: the remaining ``mita_attention`` keywords (unused here).

    Returns:
        None if the call can run, else a short reason.
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return "q is not a 4-D tensor"
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
        return f"device {q.device.type} is not CUDA (and TRITON_INTERPRET is not set)"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head dim {q.shape[-1]} not in {SUPPORTED_HEAD_DIMS}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} not in fp16/bf16/fp32"
    return None


def triton_entry(q, k, v, landmarks, topk, **kw):
    """The backend function: ``triton_mita`` without its argument checks, which ``mita_attention`` has made
    (imported on first call, so that importing this module needs no Triton)."""
    from mita.ops.mita.triton.op import triton_mita_checked

    return triton_mita_checked(q, k, v, landmarks, topk, **kw)
