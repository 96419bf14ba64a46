"""Per-row top-k as an additive attention bias: 0 on each row's k largest entries, -inf elsewhere.

``row_topk_bias(scores, k)`` is the selection step of per-query top-k attention (mita.layers.topk): each score row
keeps its ``k`` largest finite entries (ties at the k-th value go to the lower column index), so exactly
``min(k, finite entries)`` columns get 0 and the rest -inf. On CUDA (or the CPU under ``TRITON_INTERPRET=1``) rows
of up to ``MAX_COLS`` columns take one Triton kernel that holds a block of rows on chip, finds each row's k-th
largest value on order-preserving int32 keys (MiTA's exact top-k search, ``topk_scan._topk_select``) and writes the
bias directly; other calls take
``torch.sort`` (stable, so the same ties). Both read the scores once and allocate only the output.
"""

from __future__ import annotations

import torch

from mita.ops.mita.triton.launch import interpreting
from mita.ops.mita.triton.topk_scan import _topk_select

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None

# Longest rows the kernel holds on chip (elements per program: rows x padded columns).
MAX_COLS = 8192
_ELEMENTS = 8192


def kernel_supported(scores: torch.Tensor) -> bool:
    """Whether :func:`row_topk_bias` runs its Triton kernel on ``scores`` (CUDA, or the CPU when interpreting)."""
    if triton is None or scores.dim() < 1 or scores.shape[-1] > MAX_COLS or scores.numel() == 0:
        return False
    if scores.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return scores.is_cuda or (scores.device.type == "cpu" and interpreting())


def row_topk_bias(
    scores: torch.Tensor,
    k: int,
    dtype: torch.dtype | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive bias selecting each row's ``k`` largest finite scores.

    Args:
        scores: ``[..., M]`` float scores; -inf (and NaN) entries are never selected.
        k: entries kept per row (>= 1); a row with fewer finite entries keeps all of them.
        dtype: the bias dtype (default: the scores' dtype).
        key_padding_mask: ``[B, M]`` bool, True = padding (never selected), for scores ``[B, ..., M]``: the
            same as filling the padded columns of the scores with -inf, without the pass over them.

    Returns:
        ``[..., M]`` tensor of 0 (selected) and -inf, in ``dtype``. Ties at the k-th largest value are kept
        in column order (the lower index first). No gradient, no host synchronisation.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    dtype = scores.dtype if dtype is None else dtype
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    if key_padding_mask is not None:
        B, M = scores.shape[0], scores.shape[-1]
        if scores.dim() < 2 or key_padding_mask.shape != (B, M) or key_padding_mask.dtype != torch.bool:
            raise ValueError(
                f"key_padding_mask must be a bool [B, M] = [{B}, {M}] tensor for scores of shape "
                f"{tuple(scores.shape)}, got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
            )
    with torch.no_grad():
        if kernel_supported(scores):
            return _kernel_bias(scores, k, dtype, key_padding_mask)
        if key_padding_mask is not None:
            view = key_padding_mask.view(scores.shape[0], *([1] * (scores.dim() - 2)), scores.shape[-1])
            scores = scores.masked_fill(view, float("-inf"))
        return _sort_bias(scores, k, dtype)


def _sort_bias(scores: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The reference: a stable descending sort (ties in column order), the first k finite entries kept."""
    s = scores.float()
    s = s.masked_fill(s.isnan(), float("-inf"))
    kk = min(k, s.shape[-1])
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :kk]
    keep = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, order, True) & (s > float("-inf"))
    return torch.zeros(s.shape, dtype=dtype, device=s.device).masked_fill_(~keep, float("-inf"))


def _kernel_bias(
    scores: torch.Tensor, k: int, dtype: torch.dtype, key_padding_mask: torch.Tensor | None
) -> torch.Tensor:
    shape = scores.shape
    cols = shape[-1]
    rows = scores.reshape(-1, cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=dtype, device=scores.device)
    block_c = triton.next_power_of_2(cols)
    block_r = max(1, min(16, _ELEMENTS // block_c))
    grid = (triton.cdiv(rows.shape[0], block_r),)
    # Row i of the flattened scores belongs to batch i // rows_per_batch.
    rows_per_batch = rows.shape[0] // max(1, shape[0]) if key_padding_mask is not None else 1
    pad = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else out
    _row_topk_bias_kernel[grid](
        rows,
        out,
        pad,
        rows_per_batch,
        rows.shape[0],
        cols,
        min(k, cols),
        rows.stride(0),
        out.stride(0),
        HAS_PAD=key_padding_mask is not None,
        # 16-bit scores (bf16, fp16) have 16-bit keys: a search over 2^16 keys instead of 2^32.
        BITS=16 if rows.element_size() == 2 else 32,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=4 if block_r * block_c <= 4096 else 8,
    )
    return out.view(shape)


if triton is not None:

    @triton.jit
    def _row_topk_bias_kernel(
        S,
        OUT,
        PAD,
        rows_per_batch,
        R,
        C,
        K,
        s_stride,
        o_stride,
        HAS_PAD: tl.constexpr,
        BITS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """Rows [pid * BLOCK_R, +BLOCK_R): bias 0 on each row's K largest finite scores (ties: lower column),
        -inf elsewhere."""
        pid = tl.program_id(0)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_C)
        inside = (r[:, None] < R) & (c[None, :] < C)
        raw = tl.load(S + r[:, None].to(tl.int64) * s_stride + c[None, :], mask=inside, other=0.0)
        valid = inside & (raw.to(tl.float32) > float("-inf"))  # NaN compares False: never selected
        if HAS_PAD:
            b = (r // rows_per_batch).to(tl.int64)
            padded = tl.load(PAD + b[:, None] * C + c[None, :], mask=inside, other=1)
            valid = valid & (padded == 0)
        # Order-preserving key from the score's own bits (no float arithmetic, so no flushed subnormals):
        # non-negative floats keep their bits, negative ones flip all but the sign; -0.0 is folded onto +0.0.
        if BITS == 16:
            x = raw.to(tl.int16, bitcast=True).to(tl.int32)
            x = tl.where(x == -32768, 0, x)
            key = tl.where(x >= 0, x, x ^ 0x7FFF)
        else:
            x = raw.to(tl.int32, bitcast=True)
            x = tl.where(x == -2147483648, 0, x)
            key = tl.where(x >= 0, x, x ^ 0x7FFFFFFF)
        keep = _topk_select(key, valid, r < R, K)
        bias = tl.where(keep, 0.0, float("-inf"))
        tl.store(OUT + r[:, None].to(tl.int64) * o_stride + c[None, :], bias.to(OUT.dtype.element_ty), mask=inside)
