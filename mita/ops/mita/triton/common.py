"""Pieces every kernel family shares: tensor layouts (``heads_layout``, ``out_layout``, ``grad_layouts``), host
helpers (``_cdiv``, ``_next_pow2``, ``regs_cap``, ``_prec`` / ``_upcast``, ``_sm_count``) and the ``triton.jit``
building blocks of the kernels (``_head_ptr`` / ``_out_ptr`` addressing, ``_dot`` / ``_dot_acc``, ``_score`` and the
online-softmax steps ``_softmax_step``, ``_softmax_lazy`` and ``_softmax_fma``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mita.ops.mita.triton.launch import interpreting

LOG2E = 1.4426950408889634


def _sm_count(dev: torch.device) -> int:
    # Streaming multiprocessors of a CUDA device (cached): the persistent fallback kernel's program count.
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(i)
    if n is None:
        n = _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return n


_SM_COUNT: dict = {}


def regs_cap(maxnreg) -> dict:
    """Launch option capping a kernel's registers per thread (``maxnreg``), or none when the setting is None / 0."""
    return {"maxnreg": int(maxnreg)} if maxnreg else {}


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    # Host-side ceil division: triton.cdiv is a constexpr function in recent Triton, ~5 us per host call.
    return -(-a // b)


def heads_layout(*xs: torch.Tensor) -> tuple[int, int, int, int]:
    """``(H, sb, sh, sn)``: how the kernels find row n of head ``bh`` in tensors of one layout: at
    ``(bh // H) * sb + (bh % H) * sh + n * sn`` (elements; the feature dim is contiguous). Takes flattened heads
    ``[BH, N, d]`` (H = 1) or ``[B, H, N, d]`` with any batch, head and row strides, e.g. the q, k, v slices of a
    ``[B, N, 3, H, d]`` projection; every tensor given must have the same shape and strides."""
    x = xs[0]
    if any(y.shape != x.shape or y.stride() != x.stride() for y in xs[1:]) or x.stride(-1) != 1:
        raise ValueError("tensors of one layout must share shape and strides, with a contiguous last dim")
    if x.dim() == 3:
        return 1, x.stride(0), 0, x.stride(1)
    return x.shape[1], x.stride(0), x.stride(1), x.stride(2)


@triton.jit
def _head_ptr(X, i_bh, H, SB, SH):
    # First row of head i_bh (int64) in a tensor laid out as heads_layout describes.
    return X + (i_bh // H) * SB + (i_bh % H) * SH


@triton.jit
def _valid_keys(KV, i_bh, N, o_n, n1, HAS_KV: tl.constexpr):
    # Keys o_n of head i_bh below n1 and, with padding (HAS_KV), not padded (KV [BH, N], 1 = valid).
    m_n = o_n < n1
    if HAS_KV:
        m_n = m_n & (tl.load(KV + i_bh * N + o_n, mask=m_n, other=0) != 0)
    return m_n


@triton.jit
def _out_ptr(X, i_bh, H, N, D: tl.constexpr):
    # First row of head i_bh (int64) in an output stored in [B, N, H, D] order (rows H * D apart; flattened heads,
    # H = 1: [BH, N, D]).
    return X + (i_bh // H) * N * H * D + (i_bh % H) * D


def out_strides(q: torch.Tensor) -> tuple[int, ...]:
    """Strides of :func:`out_layout` for q's shape."""
    if q.dim() == 3:
        return (q.shape[1] * q.shape[2], q.shape[2], 1)
    B, H, N, D = q.shape
    return (N * H * D, D, H * D, 1)


def out_layout(q: torch.Tensor) -> torch.Tensor:
    """An empty output for queries q (``[BH, N, d]`` or ``[B, H, N, d]``) stored in ``[B, N, H, d]`` order, shaped
    as q: what _out_ptr addresses."""
    return q.new_empty_strided(q.shape, out_strides(q))


def grad_layouts(o: torch.Tensor, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """``(o, do, (sb, sh, sn))`` for the backward kernels: o in :func:`out_layout` (as the forward wrote it; a copy
    only if a caller changed its layout) and the upstream gradient read in place with its own batch, head and row
    strides (``_head_ptr``), copied only when its feature dim is not contiguous (e.g. an expanded scalar grad)."""
    if o.stride() != out_strides(o):
        o = out_layout(o).copy_(o)
    if do.stride(-1) != 1:
        do = do.contiguous()
    _, sb, sh, sn = heads_layout(do)
    return o, do, (sb, sh, sn)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UP: tl.constexpr):
    # UP: the CPU interpreter multiplies bf16 tiles as their raw uint16 bits, so upcast there first.
    if UP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _softmax_step(b_s, b_v, b_m, b_l, b_acc, PREC: tl.constexpr, UP: tl.constexpr):
    # One key block of an online softmax in log2 units: logits b_s [X, Y] (-inf where masked), values b_v [Y, D],
    # running maximum b_m and sum b_l [X] and accumulator b_acc [X, D] -> (b_m, b_l, b_acc) after the block.
    b_mn = tl.maximum(b_m, tl.max(b_s, 1))
    b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    b_p = tl.exp2(b_s - b_ms[:, None])
    b_alpha = tl.exp2(b_m - b_ms)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v, PREC, UP)
    return b_mn, b_l, b_acc


@triton.jit
def _dot_acc(a, b, acc, PREC: tl.constexpr, UP: tl.constexpr):
    # acc + a @ b with the sum in the dot's accumulator.
    if UP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


# Lazy rescaling (_softmax_lazy): the reference maximum is raised only when a block's maximum passes it by more than
# this (log2 units), so unnormalised weights stay below 2^8.
_LAZY_TAU = tl.constexpr(8.0)


@triton.jit
def _softmax_lazy(b_s, scale, b_v, b_m, b_l, b_acc, PREC: tl.constexpr, UP: tl.constexpr):
    return _softmax_lazy_max(b_s, tl.max(b_s, 1), scale, b_v, b_m, b_l, b_acc, PREC, UP)


@triton.jit
def _softmax_lazy_max(b_s, b_smax, scale, b_v, b_m, b_l, b_acc, PREC: tl.constexpr, UP: tl.constexpr):
    # One key block of an online softmax in log2 units from raw scores b_s [X, Y] (-inf where masked) and a scale > 0
    # (logits b_s * scale: one FMA with the reference subtracted). The reference b_m [X] is raised, and b_l, b_acc
    # rescaled, only when some row's block maximum passes its reference by more than _LAZY_TAU: then every row takes
    # its running maximum. Otherwise the weights stay below 2^_LAZY_TAU and the [X, D] rescale is skipped. b_l and
    # b_acc are always relative to b_m, so (b_m, b_l, b_acc) is an exact state for any reference: output b_acc / b_l,
    # log-sum-exp b_m + log2(b_l), as _softmax_step's. b_smax: the row maxima of b_s (_softmax_lazy_max: from a
    # caller that has them).
    b_mx = b_smax * scale
    if tl.max((b_mx > b_m + _LAZY_TAU).to(tl.int32), 0) > 0:
        b_mn = tl.maximum(b_m, b_mx)
        b_alpha = tl.exp2(b_m - tl.where(b_mn == float("-inf"), 0.0, b_mn))
        b_l = b_l * b_alpha
        b_acc = b_acc * b_alpha[:, None]
        b_m = b_mn
    b_p = tl.exp2(b_s * scale - tl.where(b_m == float("-inf"), 0.0, b_m)[:, None])
    b_l = b_l + tl.sum(b_p, 1)
    b_acc = _dot_acc(b_p.to(b_v.dtype), b_v, b_acc, PREC, UP)
    return b_m, b_l, b_acc


@triton.jit
def _softmax_fma(b_s, scale, b_v, b_m, b_l, b_acc, PREC: tl.constexpr, UP: tl.constexpr):
    return _softmax_fma_max(b_s, tl.max(b_s, 1), scale, b_v, b_m, b_l, b_acc, PREC, UP)


@triton.jit
def _softmax_fma_max(b_s, b_smax, scale, b_v, b_m, b_l, b_acc, PREC: tl.constexpr, UP: tl.constexpr):
    # _softmax_step from raw scores b_s (-inf where masked) and a scale > 0: the running maximum is kept in logit
    # units (the raw row maximum times scale: the same value as the maximum of the scaled scores, as rounding is
    # monotone) and the scale goes into the exponent's FMA, so no per-score multiply; every block rescales. b_smax:
    # the row maxima of b_s (_softmax_fma_max: from a caller that has them).
    b_mn = tl.maximum(b_m, b_smax * scale)
    b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    b_p = tl.exp2(b_s * scale - b_ms[:, None])
    b_alpha = tl.exp2(b_m - b_ms)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v, PREC, UP)
    return b_mn, b_l, b_acc


@triton.jit
def _score(a, b, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr):
    # a [X, D] . b [Y, D] -> [X, Y] float32. EXACT (CPU interpreter): an elementwise product and sum, so equal
    # columns give bitwise-equal scores (a BLAS matmul need not); exact ties decide the top-k.
    if EXACT:
        return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], 2)
    else:
        return _dot(a, tl.trans(b), PREC, UP)
