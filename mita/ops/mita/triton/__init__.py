"""The Triton backend of the MiTA operator, one module per kernel family (see README.md in this folder).

Public names: :func:`triton_mita` (the operator on the fused kernels, same contract as ``naive_mita``),
:func:`triton_mita_pooled` and :func:`pooled_short_supported` (2D landmarks pooled inside the short path's autograd
node), :func:`supports` (whether the backend can run a call), :func:`triton_entry` (the backend function
``mita_attention`` registers as "triton") and :func:`interpreting` (whether ``TRITON_INTERPRET`` is set). The bf16
landmark pooling kernels are the public functions of :mod:`mita.ops.mita.triton.pool`.

Importing this package needs no Triton (``supports`` then says so): the kernel modules load on the first use of a
name that needs them (an ``ImportError`` there when Triton is missing).
"""

from __future__ import annotations

from mita.ops.mita.triton.backend import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, supports, triton_entry
from mita.ops.mita.triton.launch import interpreting

_OP_NAMES = ("pooled_short_supported", "triton_mita", "triton_mita_pooled")

__all__ = ["SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS", "interpreting", "supports", "triton_entry", *_OP_NAMES]


def __getattr__(name: str):
    # The kernels (and Triton) load on first use of an operator name.
    if name in _OP_NAMES:
        from mita.ops.mita.triton import op

        value = globals()[name] = getattr(op, name)  # later lookups are plain attributes
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
