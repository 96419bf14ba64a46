"""Backward of the short-sequence path (``short.py``), FlashAttention-2 shaped: ``small_bwd``.

``_small_bwd_kernel``, one program per (batch, head): pass 1 over query blocks (delta, the shared expert's share of
dq, dR and dV~), pass 2 over key blocks (dv, dk and each tile's dq share, then the landmark-value attention's dk, dv
and dR share), pass 3 writes dq and dR. No atomics: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mita.ops.mita.triton.common import (
    LOG2E,
    _dot,
    _head_ptr,
    _out_ptr,
    _prec,
    _upcast,
    _valid_keys,
    grad_layouts,
    heads_layout,
)
from mita.ops.mita.triton.launch import fast
from mita.ops.mita.triton.short import _cfg, _pads, _routed_p_ds, _tail, _whole_blocks_end


@triton.jit
def _load_route_onehot(ROUTE, o_i, m_i, o_j, i_bh, N, S: tl.constexpr, BM: tl.constexpr, MP: tl.constexpr):
    b_oh = tl.zeros([BM, MP], tl.float32)
    for s in tl.static_range(S):
        e = tl.load(ROUTE + (i_bh * N + o_i) * S + s, mask=m_i, other=-1)
        b_oh += (o_j[None, :] == e[:, None]).to(tl.float32)
    return b_oh.to(tl.float16)


@triton.jit
def _query_block_p_ds(
    Q_h, DO_h, LSE, DELTA, ROUTE, b_kb, b_vb, b_mb, o_i, m_i, o_j, o_d, i_bh, N, SN, DSN, scale_log2,
    S: tl.constexpr, BM: tl.constexpr, MP: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
):  # fmt: skip
    """Query rows o_i against one key block (b_kb, b_vb and its membership columns b_mb): ``(q, do, P, dS)``,
    the key counted as often as it is in the rows' routed lists."""
    b_q = tl.load(Q_h + o_i[:, None] * SN + o_d[None, :], mask=m_i[:, None], other=0.0)
    b_do = tl.load(DO_h + o_i[:, None] * DSN + o_d[None, :], mask=m_i[:, None], other=0.0)
    b_lse = tl.load(LSE + i_bh * N + o_i, mask=m_i, other=0.0)
    b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)
    b_delta = tl.load(DELTA + i_bh * N + o_i, mask=m_i, other=0.0)
    b_c = tl.dot(_load_route_onehot(ROUTE, o_i, m_i, o_j, i_bh, N, S, BM, MP), b_mb)
    b_p, b_ds = _routed_p_ds(b_q, b_kb, b_vb, b_do, b_c, b_lse, b_delta, scale_log2, S, PREC, UP)
    return b_q, b_do, b_p, b_ds


@triton.jit
def _lv_bwd_rows(LVLSE, b_dvt, b_vt, i_bh, M, o_j, m_j):
    """Per landmark row of the landmark-value attention's backward, from its upstream gradient b_dvt [MP, D]
    (float32): ``(LSE, delta = rowsum(dV~ * V~), dV~ in V~'s dtype)``."""
    b_lvlse = tl.load(LVLSE + i_bh * M + o_j, mask=m_j, other=float("inf"))
    b_lvlse = tl.where(b_lvlse == float("-inf"), float("inf"), b_lvlse)
    b_lvdelta = tl.sum(b_dvt * b_vt.to(tl.float32), 1)
    return b_lvlse, b_lvdelta, b_dvt.to(b_vt.dtype)


@triton.jit
def _lv_key_block(
    b_r, b_kb, b_vb, b_dvt_c, b_lvlse, b_lvdelta, m_j, m_kn, scale_log2, PREC: tl.constexpr, UP: tl.constexpr
):
    """The landmark-value attention on one key block: its [MP, BN] probabilities L and dL = L (dV~ v^T - delta)."""
    b_l = tl.exp2(_dot(b_r, tl.trans(b_kb), PREC, UP) * scale_log2 - b_lvlse[:, None])
    b_l = tl.where(m_j[:, None] & m_kn[None, :], b_l, 0.0)
    return b_l, b_l * (_dot(b_dvt_c, tl.trans(b_vb), PREC, UP) - b_lvdelta[:, None])


@triton.jit
def _bwd_tile(Q_h, DO_h, LSE, DELTA, ROUTE, ACC_h, b_kb, b_vb, b_mb, b_dk, b_dv, i0, o_j, o_d, i_bh, N, SN, DSN, scale,
              scale_log2, S: tl.constexpr, D: tl.constexpr, MP: tl.constexpr, BM: tl.constexpr,
              PREC: tl.constexpr, UP: tl.constexpr):  # fmt: skip
    """Query rows i0 .. i0 + BM against one key block: (dk, dv) of the key block with this tile's share added, and the
    tile's share of dq added to the rows' float32 accumulator."""
    o_i = i0 + tl.arange(0, BM)
    m_i = o_i < N
    b_q, b_do, b_p, b_ds = _query_block_p_ds(
        Q_h, DO_h, LSE, DELTA, ROUTE, b_kb, b_vb, b_mb, o_i, m_i, o_j, o_d, i_bh, N, SN, DSN, scale_log2,
        S, BM, MP, PREC, UP,
    )  # fmt: skip
    b_dv += _dot(tl.trans(b_p).to(b_do.dtype), b_do, PREC, UP)
    b_dk += _dot(tl.trans(b_ds).to(b_q.dtype), b_q, PREC, UP)
    p_acc = ACC_h + o_i[:, None] * D + o_d[None, :]
    b_acc = tl.load(p_acc, mask=m_i[:, None], other=0.0)
    tl.store(p_acc, b_acc + _dot(b_ds.to(b_kb.dtype), b_kb, PREC, UP) * scale, mask=m_i[:, None])
    return b_dk, b_dv


@triton.jit
def _bwd_query_blocks(Q_h, DO_h, LSE, DELTA, ROUTE, ACC_h, b_kb, b_vb, b_mb, o_j, o_d, i_bh, N, SN, DSN, scale,
                      scale_log2, S: tl.constexpr, D: tl.constexpr, MP: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, TQ: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):  # fmt: skip
    """One key block (b_kb, b_vb, membership columns b_mb) against every query block: its routed (dk / scale, dv), and
    each query block's share of dq added to the rows' float32 accumulator."""
    b_dk = tl.zeros([BN, D], tl.float32)
    b_dv = tl.zeros([BN, D], tl.float32)
    # Whole query blocks of BM, then (TQ > 0) the last TQ rows.
    i_end = _whole_blocks_end(N, BM, TQ)
    for i0 in range(0, i_end, BM):
        b_dk, b_dv = _bwd_tile(
            Q_h, DO_h, LSE, DELTA, ROUTE, ACC_h, b_kb, b_vb, b_mb, b_dk, b_dv, i0, o_j, o_d, i_bh, N, SN, DSN,
            scale, scale_log2, S, D, MP, BM, PREC, UP,
        )  # fmt: skip
    if TQ > 0:
        b_dk, b_dv = _bwd_tile(
            Q_h, DO_h, LSE, DELTA, ROUTE, ACC_h, b_kb, b_vb, b_mb, b_dk, b_dv, i_end, o_j, o_d, i_bh, N, SN, DSN,
            scale, scale_log2, S, D, MP, TQ, PREC, UP,
        )  # fmt: skip
    return b_dk, b_dv


@triton.jit
def _small_bwd_kernel(
    Q,
    K,
    V,
    R,
    VT,
    KV,
    DO,
    O,
    LSE,
    LVLSE,
    MEMB,
    ROUTE,
    DELTA,
    DQACC,
    DQ,
    DK,
    DV,
    DR,
    PMEMB,
    PCNT,
    N,
    M,
    H,
    SB,
    SH,
    SN,
    DSB,
    DSH,
    DSN,
    scale,
    sscale,
    scale_log2,
    sscale_log2,
    S: tl.constexpr,
    SHARED: tl.constexpr,
    HAS_KV: tl.constexpr,
    POOL: tl.constexpr,
    D: tl.constexpr,
    MP: tl.constexpr,
    NP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    TQ: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
):
    """The whole backward of one (batch, head) in one program: each [BM queries, BN keys] tile's probabilities
    are computed once and give dq, dk and dv together.

    dq accumulates in a float32 row block of DQACC owned by this program (read, add, write per key block, in key
    order: deterministic, no atomics); dR and the landmark values' upstream gradient accumulate in registers, so
    dR is written here, not summed from partials. POOL: the landmarks were pooled from q (``SmallMiTAFn`` with ``pool``:
    0/1 membership PMEMB [m, N] in bf16, float32 counts PCNT [m]), so dq also gets the pooling's gradient
    ``PMEMB^T (dR / PCNT)``, added in float32 before dq is rounded. dR / PCNT enters the tensor cores as two bf16
    parts (high and low: 16 significant bits, far below dq's rounding); a float32 dot here took 0.13 ms at DeiT-S
    on the H200."""
    i_bh = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, D)
    o_j = tl.arange(0, MP)
    m_j = o_j < M
    Q_h = _head_ptr(Q, i_bh, H, SB, SH)
    K_h = _head_ptr(K, i_bh, H, SB, SH)
    V_h = _head_ptr(V, i_bh, H, SB, SH)
    DO_h = _head_ptr(DO, i_bh, H, DSB, DSH)
    O_h = _out_ptr(O, i_bh, H, N, D)
    ACC_h = DQACC + i_bh * N * D
    if SHARED:
        b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
        b_vt = tl.load(VT + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
    b_dr = tl.zeros([MP, D], tl.float32)
    b_dvt = tl.zeros([MP, D], tl.float32)
    # Pass 1, query blocks: delta = rowsum(dO * O) and the shared expert's share of dq (the first value of the
    # accumulator), of dR and of the landmark values' upstream gradient.
    for i0 in range(0, N, BM):
        o_i = i0 + tl.arange(0, BM)
        m_i = o_i < N
        b_do = tl.load(DO_h + o_i[:, None] * DSN + o_d[None, :], mask=m_i[:, None], other=0.0)
        b_o = tl.load(O_h + o_i[:, None] * (H * D) + o_d[None, :], mask=m_i[:, None], other=0.0)
        b_delta = tl.sum(b_do.to(tl.float32) * b_o.to(tl.float32), 1)
        tl.store(DELTA + i_bh * N + o_i, b_delta, mask=m_i)
        b_dq = tl.zeros([BM, D], tl.float32)
        if SHARED:
            b_q = tl.load(Q_h + o_i[:, None] * SN + o_d[None, :], mask=m_i[:, None], other=0.0)
            b_lse = tl.load(LSE + i_bh * N + o_i, mask=m_i, other=0.0)
            b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)
            b_a = _dot(b_q, tl.trans(b_r), PREC, UP) * sscale_log2
            b_pa = tl.where(m_j[None, :] & m_i[:, None], tl.exp2(b_a - b_lse[:, None]), 0.0)
            b_dsa = b_pa * (_dot(b_do, tl.trans(b_vt), PREC, UP) - b_delta[:, None])
            b_dq = _dot(b_dsa.to(b_r.dtype), b_r, PREC, UP) * sscale
            b_dr += _dot(tl.trans(b_dsa).to(b_q.dtype), b_q, PREC, UP) * sscale
            b_dvt += _dot(tl.trans(b_pa).to(b_do.dtype), b_do, PREC, UP)
        tl.store(ACC_h + o_i[:, None] * D + o_d[None, :], b_dq, mask=m_i[:, None])
    if SHARED:
        b_lvlse, b_lvdelta, b_dvt_c = _lv_bwd_rows(LVLSE, b_dvt, b_vt, i_bh, M, o_j, m_j)
    tl.debug_barrier()
    # Pass 2, key blocks: routed dk, dv over every query block, whose dq rows get this key block's share.
    for n0 in range(0, N, BN):
        o_kn = n0 + tl.arange(0, BN)
        m_kn = _valid_keys(KV, i_bh, N, o_kn, N, HAS_KV)
        o_key = o_kn[:, None] * SN + o_d[None, :]
        b_kb = tl.load(K_h + o_key, mask=m_kn[:, None], other=0.0)
        b_vb = tl.load(V_h + o_key, mask=m_kn[:, None], other=0.0)
        b_mb = tl.load(MEMB + i_bh * MP * NP + o_j[:, None] * NP + o_kn[None, :]).to(tl.float16)
        b_dk, b_dv = _bwd_query_blocks(
            Q_h, DO_h, LSE, DELTA, ROUTE, ACC_h, b_kb, b_vb, b_mb, o_j, o_d, i_bh, N, SN, DSN, scale, scale_log2,
            S, D, MP, BM, BN, TQ, PREC, UP,
        )  # fmt: skip
        b_dk = b_dk * scale
        if SHARED:
            b_l, b_dls = _lv_key_block(b_r, b_kb, b_vb, b_dvt_c, b_lvlse, b_lvdelta, m_j, m_kn, scale_log2, PREC, UP)
            b_dv += _dot(tl.trans(b_l).to(b_dvt_c.dtype), b_dvt_c, PREC, UP)
            b_dk += _dot(tl.trans(b_dls).to(b_r.dtype), b_r, PREC, UP) * scale
            b_dr += _dot(b_dls.to(b_kb.dtype), b_kb, PREC, UP) * scale
        p_dkv = i_bh * N * D + o_kn[:, None] * D + o_d[None, :]
        tl.store(DK + p_dkv, b_dk.to(DK.dtype.element_ty), mask=(o_kn < N)[:, None])
        tl.store(DV + p_dkv, b_dv.to(DV.dtype.element_ty), mask=(o_kn < N)[:, None])
        tl.debug_barrier()
    # Pass 3: dq in its dtype.
    if POOL:
        b_drs = b_dr / tl.load(PCNT + o_j, mask=m_j, other=1.0)[:, None]
        b_drh = b_drs.to(tl.bfloat16)
        b_drl = (b_drs - b_drh.to(tl.float32)).to(tl.bfloat16)
    for i0 in range(0, N, BM):
        o_i = i0 + tl.arange(0, BM)
        m_i = o_i < N
        p_rows = o_i[:, None] * D + o_d[None, :]
        b_dq = tl.load(ACC_h + p_rows, mask=m_i[:, None], other=0.0)
        if POOL:
            b_mt = tl.load(PMEMB + o_j[None, :] * N + o_i[:, None], mask=m_i[:, None] & m_j[None, :], other=0.0)
            b_dq += _dot(b_mt, b_drh, PREC, UP) + _dot(b_mt, b_drl, PREC, UP)
        tl.store(DQ + i_bh * N * D + p_rows, b_dq.to(DQ.dtype.element_ty), mask=m_i[:, None])
    if SHARED:
        tl.store(DR + i_bh * M * D + o_j[:, None] * D + o_d[None, :], b_dr.to(DR.dtype.element_ty), mask=m_j[:, None])


def small_bwd(do, q, k, v, r, key_valid, o, lse, memb, route, vt, lvlse, S, shared, scale, sscale, pool=None):
    """Backward of :func:`small_fwd` (q, k, v, o as it took and gave them; do any layout of o's shape). Returns
    ``(dq, dk, dv, dr)`` in the inputs' dtypes, dq, dk, dv contiguous, shaped as q. ``pool``: the landmarks are q
    pooled with this bf16 operator (``mita.ops.landmarks.pool_operator_2d``), and dq includes the pooling's
    gradient."""
    lay = heads_layout(q, k, v)
    BH, M, D = r.shape
    N = q.shape[-2]
    dev = q.device
    NP, MP = _pads(N, M)
    dq, dk, dv = (q.new_empty(BH, N, D) for _ in range(3))
    delta = torch.empty(BH, N, device=dev, dtype=torch.float32)
    dqacc = torch.empty(BH, N, D, device=dev, dtype=torch.float32)
    dr = torch.empty_like(r) if shared else torch.zeros_like(r)
    kv = key_valid.to(torch.int8).contiguous() if key_valid is not None else q
    o, do, dlay = grad_layouts(o, do)
    cfg = _cfg("bwd", NP)
    fast(_small_bwd_kernel)[(BH,)](
        q,
        k,
        v,
        r,
        vt,
        kv,
        do,
        o,
        lse,
        lvlse,
        memb,
        route,
        delta,
        dqacc,
        dq,
        dk,
        dv,
        dr,
        pool.member if pool is not None else dr,
        pool.counts if pool is not None else dr,
        N,
        M,
        *lay,
        *dlay,
        scale,
        sscale,
        scale * LOG2E,
        sscale * LOG2E,
        S=S,
        SHARED=shared,
        HAS_KV=key_valid is not None,
        POOL=shared and pool is not None,
        D=D,
        MP=MP,
        NP=NP,
        PREC=_prec(q.dtype),
        UP=_upcast(q.dtype),
        TQ=_tail(N, cfg["BM"], "bwd"),
        **cfg,
    )
    return dq.view(q.shape), dk.view(q.shape), dv.view(q.shape), dr
