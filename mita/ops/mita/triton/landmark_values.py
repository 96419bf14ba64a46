"""Landmark values ``softmax(R k^T s) v`` as a split-key (flash-decoding style) attention of m queries over N keys:
each program takes a key chunk for a tile of landmarks and writes a partial (max, sum, accumulator); a merge kernel
combines them (``landmark_values_fwd``; ``topk.exact_topk(lv=...)`` computes the partials in its block-top pass
instead, from the scores it already has). Its backward (``landmark_values_bwd``): one kernel for dk, dv (each key
block loops over the landmarks), one for dR partials over key chunks, summed in a fixed order (deterministic).
``LandmarkValuesFn`` is the autograd wrapper. Settings: ``LV_CONFIG``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mita.ops.mita.triton.common import (
    LOG2E,
    _cdiv,
    _dot,
    _head_ptr,
    _next_pow2,
    _prec,
    _softmax_step,
    _upcast,
    _valid_keys,
    heads_layout,
)
from mita.ops.mita.triton.launch import fast

# Landmark-value forward kernel: warps (None: 8 for 128-landmark tiles, else 4); no register cap (80 was slower).
LV_CONFIG = dict(num_warps=None)


# ----------------------------------------------------------------------------------------------------------------
# landmark values softmax(R k^T s) v: split-key forward, merge, backward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _lv_fwd_kernel(
    R,
    K,
    V,
    KV,
    PM,
    PL,
    PACC,
    VT,
    LSE,
    N,
    M,
    CH,
    H,
    SB,
    SH,
    SN,
    scale_log2,
    HAS_KV: tl.constexpr,
    DIRECT: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
):
    i_s = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    n_c = tl.num_programs(1)
    o_d = tl.arange(0, D)
    o_j = i_s * BS + tl.arange(0, BS)
    m_j = o_j < M
    b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
    b_m = tl.full([BS], float("-inf"), tl.float32)
    b_l = tl.zeros([BS], tl.float32)
    b_acc = tl.zeros([BS, D], tl.float32)
    n0 = i_c * CH
    n1 = tl.minimum(n0 + CH, N)
    K_h = _head_ptr(K, i_bh, H, SB, SH)
    V_h = _head_ptr(V, i_bh, H, SB, SH)
    for n_b in range(n0, n1, BN):
        o_n = n_b + tl.arange(0, BN)
        m_n = _valid_keys(KV, i_bh, N, o_n, n1, HAS_KV)
        o_kv = o_n.to(tl.int64)[:, None] * SN + o_d[None, :]
        b_k = tl.load(K_h + o_kv, mask=m_n[:, None], other=0.0)
        b_v = tl.load(V_h + o_kv, mask=m_n[:, None], other=0.0)
        b_s = _dot(b_r, tl.trans(b_k), PREC, UP) * scale_log2
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m, b_l, b_acc = _softmax_step(b_s, b_v, b_m, b_l, b_acc, PREC, UP)
    _lv_store(b_m, b_l, b_acc, PM, PL, PACC, VT, LSE, i_bh, i_c, n_c, M, o_j, m_j, o_d, D, DIRECT)


@triton.jit
def _lv_store(b_m, b_l, b_acc, PM, PL, PACC, VT, LSE, i_bh, i_c, n_c, M, o_j, m_j, o_d, D: tl.constexpr,
              DIRECT: tl.constexpr):  # fmt: skip
    # A split-key pass's end for landmarks o_j of head i_bh over key chunk i_c of n_c: with one chunk (DIRECT) the
    # landmark values and their LSE (zeros, -inf for a row with no valid key), else the chunk's partials (maximum,
    # sum, accumulator) for the merge.
    if DIRECT:
        m_nz = b_l > 0
        b_o = b_acc / tl.where(m_nz, b_l, 1.0)[:, None]
        tl.store(VT + i_bh * M * D + o_j[:, None] * D + o_d[None, :], b_o.to(VT.dtype.element_ty), mask=m_j[:, None])
        tl.store(LSE + i_bh * M + o_j, tl.where(m_nz, b_m + tl.log2(tl.where(m_nz, b_l, 1.0)), float("-inf")), mask=m_j)
    else:
        o_w = (i_bh * n_c + i_c) * M + o_j
        tl.store(PM + o_w, b_m, mask=m_j)
        tl.store(PL + o_w, b_l, mask=m_j)
        tl.store(PACC + o_w[:, None] * D + o_d[None, :], b_acc, mask=m_j[:, None])


@triton.jit
def _lv_merge_kernel(PM, PL, PACC, VT, LSE, M, NC, D: tl.constexpr, BC: tl.constexpr):
    # One landmark per program.
    _lv_merge_row(PM, PL, PACC, VT, LSE, tl.program_id(0), tl.program_id(1).to(tl.int64), M, NC, D, BC)


@triton.jit
def _lv_merge_row(PM, PL, PACC, VT, LSE, i_j, i_bh, M, NC, D: tl.constexpr, BC: tl.constexpr):
    # Landmark i_j of head i_bh from its NC split-key partials, BC key chunks per step: the global maximum first,
    # then the rescaled sums.
    o_d = tl.arange(0, D)
    b_m = tl.full([BC], float("-inf"), tl.float32)
    for c0 in range(0, NC, BC):
        o_c = c0 + tl.arange(0, BC)
        b_m = tl.maximum(b_m, tl.load(PM + (i_bh * NC + o_c) * M + i_j, mask=o_c < NC, other=float("-inf")))
    g_m = tl.max(b_m, 0)
    g_ms = tl.where(g_m == float("-inf"), 0.0, g_m)
    b_l = tl.zeros([BC], tl.float32)
    b_acc = tl.zeros([BC, D], tl.float32)
    for c0 in range(0, NC, BC):
        o_c = c0 + tl.arange(0, BC)
        m_c = o_c < NC
        o_w = (i_bh * NC + o_c) * M + i_j
        a = tl.exp2(tl.load(PM + o_w, mask=m_c, other=float("-inf")) - g_ms)
        b_l += tl.load(PL + o_w, mask=m_c, other=0.0) * a
        b_acc += tl.load(PACC + o_w[:, None] * D + o_d[None, :], mask=m_c[:, None], other=0.0) * a[:, None]
    l_sum = tl.sum(b_l, 0)
    acc = tl.sum(b_acc, 0)
    nz = l_sum > 0
    tl.store(VT + (i_bh * M + i_j) * D + o_d, (acc / tl.where(nz, l_sum, 1.0)).to(VT.dtype.element_ty))
    tl.store(LSE + i_bh * M + i_j, tl.where(nz, g_m + tl.log2(tl.where(nz, l_sum, 1.0)), float("-inf")))


@triton.jit
def _lv_dkdv_block(
    R,
    DVT,
    LSE,
    DELTA,
    b_k,
    b_v,
    m_n,
    i_bh,
    M,
    scale_log2,
    D: tl.constexpr,
    BS: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
):
    """The landmark-value attention's (dk / scale, dv) of one block of keys b_k, b_v [BN, D] (valid rows m_n),
    from the landmarks R, the upstream gradient DVT of the landmark values, and their LSE / DELTA rows."""
    o_d = tl.arange(0, D)
    b_dk = tl.zeros([BN, D], tl.float32)
    b_dv = tl.zeros([BN, D], tl.float32)
    for j0 in range(0, M, BS):
        o_j = j0 + tl.arange(0, BS)
        m_j = o_j < M
        b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
        b_dvt = tl.load(DVT + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
        b_lse = tl.load(LSE + i_bh * M + o_j, mask=m_j, other=float("inf"))
        b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)
        b_delta = tl.load(DELTA + i_bh * M + o_j, mask=m_j, other=0.0)
        # [BN, BS]
        b_pt = tl.exp2(_dot(b_k, tl.trans(b_r), PREC, UP) * scale_log2 - b_lse[None, :])
        b_pt = tl.where(m_n[:, None] & m_j[None, :], b_pt, 0.0)
        b_dv += _dot(b_pt.to(b_dvt.dtype), b_dvt, PREC, UP)
        b_dpt = _dot(b_v, tl.trans(b_dvt), PREC, UP)
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        b_dk += _dot(b_dst.to(b_r.dtype), b_r, PREC, UP)
    return b_dk, b_dv


@triton.jit
def _lv_bwd_dkdv_kernel(
    R,
    K,
    V,
    KV,
    DVT,
    LSE,
    DELTA,
    DK,
    DV,
    N,
    M,
    scale,
    scale_log2,
    HAS_KV: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, D)
    o_n = i_n * BN + tl.arange(0, BN)
    m_in = o_n < N
    m_n = _valid_keys(KV, i_bh, N, o_n, N, HAS_KV)
    o_n64 = o_n.to(tl.int64)
    b_k = tl.load(K + i_bh * N * D + o_n64[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)
    b_v = tl.load(V + i_bh * N * D + o_n64[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)
    b_dk, b_dv = _lv_dkdv_block(
        R, DVT, LSE, DELTA, b_k, b_v, m_n, i_bh, M, scale_log2, D=D, BS=BS, BN=BN, PREC=PREC, UP=UP
    )
    tl.store(DK + i_bh * N * D + o_n64[:, None] * D + o_d[None, :], b_dk * scale, mask=m_in[:, None])
    tl.store(DV + i_bh * N * D + o_n64[:, None] * D + o_d[None, :], b_dv, mask=m_in[:, None])


@triton.jit
def _lv_bwd_dr_kernel(
    R,
    K,
    V,
    KV,
    DVT,
    LSE,
    DELTA,
    DR,
    N,
    M,
    CH,
    H,
    SB,
    SH,
    SN,
    scale,
    scale_log2,
    HAS_KV: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
):
    i_s = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    n_c = tl.num_programs(1)
    o_d = tl.arange(0, D)
    o_j = i_s * BS + tl.arange(0, BS)
    m_j = o_j < M
    b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
    b_dvt = tl.load(DVT + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
    b_lse = tl.load(LSE + i_bh * M + o_j, mask=m_j, other=float("inf"))
    b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)
    b_delta = tl.load(DELTA + i_bh * M + o_j, mask=m_j, other=0.0)
    b_dr = tl.zeros([BS, D], tl.float32)
    n0 = i_c * CH
    n1 = tl.minimum(n0 + CH, N)
    for n_b in range(n0, n1, BN):
        o_n = n_b + tl.arange(0, BN)
        m_n = _valid_keys(KV, i_bh, N, o_n, n1, HAS_KV)
        o_n64 = o_n.to(tl.int64)
        o_kv = o_n64[:, None] * SN + o_d[None, :]
        b_k = tl.load(_head_ptr(K, i_bh, H, SB, SH) + o_kv, mask=m_n[:, None], other=0.0)
        b_v = tl.load(_head_ptr(V, i_bh, H, SB, SH) + o_kv, mask=m_n[:, None], other=0.0)
        # [BS, BN]
        b_p = tl.exp2(_dot(b_r, tl.trans(b_k), PREC, UP) * scale_log2 - b_lse[:, None])
        b_p = tl.where(m_j[:, None] & m_n[None, :], b_p, 0.0)
        b_dp = _dot(b_dvt, tl.trans(b_v), PREC, UP)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dr += _dot(b_ds.to(b_k.dtype), b_k, PREC, UP)
    o_w = ((i_bh * n_c + i_c) * M + o_j).to(tl.int64)
    tl.store(DR + o_w[:, None] * D + o_d[None, :], b_dr * scale, mask=m_j[:, None])


def _lv_blocks(M: int, D: int) -> tuple[int, int]:
    bs = int(min(64 if D <= 64 else 32, max(16, _next_pow2(M))))
    return bs, 64


def _n_chunks(N: int, M: int, n_s: int, BH: int, bn: int, target: int = 1024) -> tuple[int, int]:
    """``(chunks, keys per chunk)`` of a split-key pass over N keys with float32 partials of [M, d] per chunk:
    about ``target`` programs, at least 4 key blocks per chunk, and at most N / (8 M) chunks, so the partials
    take at most a quarter of the memory of k (two bytes per element) and never decide the call's peak."""
    nc = max(1, min(_cdiv(N, 4 * bn), _cdiv(target, n_s * BH), N // (8 * M)))
    ch = _cdiv(_cdiv(N, nc), bn) * bn
    return _cdiv(N, ch), ch


def lv_partials(BH: int, nc: int, M: int, D: int, dev, direct: bool, dummy: torch.Tensor):
    """The float32 split-key partials of ``nc`` key chunks (maxima, sums ``[BH, nc, M]``, accumulators
    ``[BH, nc, M, D]``), or ``dummy`` for each when one chunk writes the values directly."""
    if direct:
        return dummy, dummy, dummy
    return (
        torch.empty(BH, nc, M, device=dev, dtype=torch.float32),
        torch.empty(BH, nc, M, device=dev, dtype=torch.float32),
        torch.empty(BH, nc, M, D, device=dev, dtype=torch.float32),
    )


def landmark_values_fwd(r, k, v, key_valid, scale: float):
    """Forward of ``softmax(R k^T scale) v`` over valid keys. r ``[BH, m, d]``; k, v ``[BH, N, d]`` or
    ``[B, H, N, d]``, one layout (:func:`heads_layout`).

    Returns:
        ``(vt [BH, m, d] in r's dtype, lse [BH, m] float32 in log2 units; -inf for a row with no valid key)``.
    """
    BH, M, D = r.shape
    N = k.shape[-2]
    dev = r.device
    bs, bn = _lv_blocks(M, D)
    # 128 landmarks per program when there are that many (d <= 64): half the key/value reloads of 64.
    bs = 128 if M >= 128 and D <= 64 else bs
    n_s = _cdiv(M, bs)
    nc, ch = _n_chunks(N, M, n_s, BH, bn)
    kv = key_valid.to(torch.int8).contiguous() if key_valid is not None else r
    vt = torch.empty(BH, M, D, device=dev, dtype=r.dtype)
    lse = torch.empty(BH, M, device=dev, dtype=torch.float32)
    direct = nc == 1
    pm, pl, pacc = lv_partials(BH, nc, M, D, dev, direct, lse)
    fast(_lv_fwd_kernel)[(n_s, nc, BH)](
        r,
        k,
        v,
        kv,
        pm,
        pl,
        pacc,
        vt,
        lse,
        N,
        M,
        ch,
        *heads_layout(k, v),
        scale * LOG2E,
        HAS_KV=key_valid is not None,
        DIRECT=direct,
        D=D,
        BS=bs,
        BN=bn,
        PREC=_prec(r.dtype),
        UP=_upcast(r.dtype),
        num_warps=LV_CONFIG["num_warps"] or (8 if bs >= 128 else 4),
    )
    if not direct:
        fast(_lv_merge_kernel)[(M, BH)](pm, pl, pacc, vt, lse, M, nc, D=D, BC=min(64, _next_pow2(nc)), num_warps=4)
    return vt, lse


def landmark_values_bwd(dvt, r, k, v, key_valid, vt, lse, scale: float):
    """Backward of :func:`landmark_values_fwd`. Returns ``(dr, dk, dv)`` float32, shapes of r, k, v."""
    BH, M, D = r.shape
    N = k.shape[1]
    dev = r.device
    bs, bn = _lv_blocks(M, D)
    n_s = _cdiv(M, bs)
    dvt = dvt.to(r.dtype).contiguous()
    delta = (dvt.float() * vt.float()).sum(-1).contiguous()
    kv = key_valid.to(torch.int8).contiguous() if key_valid is not None else r
    prec, up = _prec(r.dtype), _upcast(r.dtype)
    has_kv = key_valid is not None
    dk = torch.empty(BH, N, D, device=dev, dtype=torch.float32)
    dv = torch.empty(BH, N, D, device=dev, dtype=torch.float32)
    fast(_lv_bwd_dkdv_kernel)[(_cdiv(N, bn), BH)](
        r,
        k,
        v,
        kv,
        dvt,
        lse,
        delta,
        dk,
        dv,
        N,
        M,
        scale,
        scale * LOG2E,
        HAS_KV=has_kv,
        D=D,
        BS=bs,
        BN=bn,
        PREC=prec,
        UP=up,
        num_warps=4,
    )
    nc, ch = _n_chunks(N, M, n_s, BH, bn)
    dr = torch.empty(BH, nc, M, D, device=dev, dtype=torch.float32)
    fast(_lv_bwd_dr_kernel)[(n_s, nc, BH)](
        r,
        k,
        v,
        kv,
        dvt,
        lse,
        delta,
        dr,
        N,
        M,
        ch,
        *heads_layout(k, v),
        scale,
        scale * LOG2E,
        HAS_KV=has_kv,
        D=D,
        BS=bs,
        BN=bn,
        PREC=prec,
        UP=up,
        num_warps=4,
    )
    return (dr[:, 0] if nc == 1 else dr.sum(1)), dk, dv


class LandmarkValuesFn(torch.autograd.Function):
    """Autograd wrapper of the split-key landmark values (``key_valid`` and ``scale`` carry no gradient)."""

    @staticmethod
    def forward(ctx, r, k, v, key_valid, scale):
        vt, lse = landmark_values_fwd(r, k, v, key_valid, scale)
        ctx.save_for_backward(r, k, v, vt, lse)
        ctx.key_valid, ctx.scale = key_valid, scale
        return vt

    @staticmethod
    def backward(ctx, dvt):
        r, k, v, vt, lse = ctx.saved_tensors
        dr, dk, dv = landmark_values_bwd(dvt, r, k, v, ctx.key_valid, vt, lse, ctx.scale)
        return dr.to(r.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _compile_cases() -> list:
    """Kernels and constexpr settings (bf16, d 64) for scripts/bench/compile_check.py beyond its own list: the
    landmark-value kernels."""
    common = dict(D=64, PREC="tf32", UP=False)
    return [
        ("lv_fwd BS=128", _lv_fwd_kernel, dict(HAS_KV=False, DIRECT=False, BS=128, BN=64, **common), 8,
         dict(PM="*fp32", PL="*fp32", PACC="*fp32", VT="*bf16", LSE="*fp32")),
        ("lv_fwd BS=64 direct", _lv_fwd_kernel, dict(HAS_KV=True, DIRECT=True, BS=64, BN=64, **common), 4,
         dict(PM="*fp32", PL="*fp32", PACC="*fp32", VT="*bf16", LSE="*fp32")),
        ("lv_merge", _lv_merge_kernel, dict(D=64, BC=64), 4, dict(VT="*bf16")),
    ]  # fmt: skip
