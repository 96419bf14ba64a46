"""Fused MiTA attention backward of the general path, the landmark values' backward included (``mita_bwd``).

Deterministic: dk/dv of each (expert, slot) are written to their own rows (``_mita_bwd_dkdv_routed_kernel``) and
reduced per key in a fixed order (``_dkdv_final_kernel``: by matching keys against the experts' index lists, or,
for large calls, as contiguous ranges: the routed rows written at their keys' places, ``key_lists.py``); the
shared-expert and landmark-value gradients are written as partials per query or key chunk
(``_mita_bwd_shared_kernel``, ``_lv_bwd_dr_kernel``) and summed by two small kernels (``_shared_merge_kernel``,
``_dr_merge_kernel``), so the backward runs no PyTorch kernels; ``_mita_bwd_dq_kernel`` writes dq.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mita.ops.mita.triton.attention_fwd import _blocks, _num_warps
from mita.ops.mita.triton.common import (
    LOG2E,
    _cdiv,
    _dot,
    _head_ptr,
    _next_pow2,
    _out_ptr,
    _prec,
    _upcast,
    _valid_keys,
    grad_layouts,
    heads_layout,
    regs_cap,
)
from mita.ops.mita.triton.key_lists import _key_lists
from mita.ops.mita.triton.landmark_values import _lv_bwd_dr_kernel, _lv_dkdv_block, _n_chunks
from mita.ops.mita.triton.launch import fast
from mita.ops.mita.triton.plan import RoutingPlan

# The backward kernels launch with the compiler's register choice (caps timed no better at d 64:
# notes/kernels-notes.md), except the dq kernel at 8 warps (``_dq_launch``).


@triton.jit
def _shared_block(R, VT, i_bh, M, j0, o_d, D: tl.constexpr, BS: tl.constexpr):
    # Landmarks j0 .. j0 + BS of head i_bh: [BS, D] keys R and values VT, zero rows past M.
    o_j = j0 + tl.arange(0, BS)
    at = i_bh * M * D + o_j[:, None] * D + o_d[None, :]
    m_j = (o_j < M)[:, None]
    return tl.load(R + at, mask=m_j, other=0.0), tl.load(VT + at, mask=m_j, other=0.0)


@triton.jit
def _mita_bwd_dq_kernel(
    Q,
    K,
    V,
    R,
    VT,
    IDX,
    ROWS,
    TILE_E,
    TILE_RS,
    TILE_RE,
    DO,
    O,
    LSE,
    DELTA,
    DQ,
    N,
    M,
    TOPK,
    NROWS,
    T,
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
    DIRECT: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BS: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
    ONE_S: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    # What does not depend on the tile's expert is loaded beside it: its first and end rows and (ONE_S: one block
    # holds every landmark, d <= 64) the shared keys and values (dq kernel at Segmenter 512 on the H100: 0.376 ->
    # 0.356 ms; at d 128 it spilled under the register cap; the same in the forward kernel took it from 0.322 to
    # 0.384 ms, so the forward loads them after the expert).
    e = tl.load(TILE_E + i_bh * T + i_t)
    rs = tl.load(TILE_RS + i_bh * T + i_t)
    re = tl.load(TILE_RE + i_bh * T + i_t)
    o_d = tl.arange(0, D)
    if SHARED and ONE_S:
        b_r1, b_vt1 = _shared_block(R, VT, i_bh, M, 0, o_d, D, BS)
    if e >= 0:
        o_r = rs + tl.arange(0, BM)
        m_r = o_r < re
        rows = tl.load(ROWS + i_bh * NROWS + o_r, mask=m_r, other=0)
        o_n = (rows // S).to(tl.int64)
        slot = rows % S
        # [BM, D]
        # q, k, v in their layout (heads_layout), o in the output's [B, N, H, D] order (_out_ptr), do in its own
        # layout (grad_layouts).
        b_q = tl.load(_head_ptr(Q, i_bh, H, SB, SH) + o_n[:, None] * SN + o_d[None, :], mask=m_r[:, None], other=0.0)
        K_h = _head_ptr(K, i_bh, H, SB, SH)
        V_h = _head_ptr(V, i_bh, H, SB, SH)
        p_out = o_n[:, None] * (H * D) + o_d[None, :]
        p_do = _head_ptr(DO, i_bh, H, DSB, DSH) + o_n[:, None] * DSN + o_d[None, :]
        b_do = tl.load(p_do, mask=m_r[:, None], other=0.0)
        b_lse = tl.load(LSE + i_bh * N + o_n, mask=m_r, other=0.0)
        b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)
        # delta = rowsum(dO * O), computed here and stored for the key-side kernels (a query's S rows write the
        # same value).
        b_o = tl.load(_out_ptr(O, i_bh, H, N, D) + p_out, mask=m_r[:, None], other=0.0)
        b_delta = tl.sum(b_do.to(tl.float32) * b_o.to(tl.float32), 1)
        tl.store(DELTA + i_bh * N + o_n, b_delta, mask=m_r)
        b_dq = tl.zeros([BM, D], tl.float32)
        if SHARED:
            for j0 in range(0, M, BS):
                o_j = j0 + tl.arange(0, BS)
                m_j = o_j < M
                # [BS, D]
                if ONE_S:
                    b_r, b_vt = b_r1, b_vt1
                else:
                    b_r, b_vt = _shared_block(R, VT, i_bh, M, j0, o_d, D, BS)
                # [BM, BS]
                b_s = _dot(b_q, tl.trans(b_r), PREC, UP) * sscale_log2
                b_p = tl.exp2(b_s - b_lse[:, None])
                b_p = tl.where(m_j[None, :] & (slot == 0)[:, None] & m_r[:, None], b_p, 0.0)
                b_dp = _dot(b_do, tl.trans(b_vt), PREC, UP)
                b_ds = b_p * (b_dp - b_delta[:, None])
                b_dq += _dot(b_ds.to(b_r.dtype), b_r, PREC, UP) * sscale
        for j0 in range(0, TOPK, BN):
            o_j = j0 + tl.arange(0, BN)
            b_idx = tl.load(IDX + (i_bh * M + e) * TOPK + o_j, mask=o_j < TOPK, other=-1)
            m_j = b_idx >= 0
            o_k = tl.where(m_j, b_idx, 0).to(tl.int64)
            # [BN, D]
            b_k = tl.load(K_h + o_k[:, None] * SN + o_d[None, :], mask=m_j[:, None], other=0.0)
            b_v = tl.load(V_h + o_k[:, None] * SN + o_d[None, :], mask=m_j[:, None], other=0.0)
            # [BM, BN]
            b_s = _dot(b_q, tl.trans(b_k), PREC, UP) * scale_log2
            b_p = tl.exp2(b_s - b_lse[:, None])
            b_p = tl.where(m_j[None, :] & m_r[:, None], b_p, 0.0)
            b_dp = _dot(b_do, tl.trans(b_v), PREC, UP)
            b_ds = b_p * (b_dp - b_delta[:, None])
            b_dq += _dot(b_ds.to(b_k.dtype), b_k, PREC, UP) * scale
        if DIRECT:
            tl.store(
                DQ + i_bh * N * D + o_n[:, None] * D + o_d[None, :], b_dq.to(DQ.dtype.element_ty), mask=m_r[:, None]
            )
        else:
            o_w = rows.to(tl.int64)
            tl.store(DQ + i_bh * NROWS * D + o_w[:, None] * D + o_d[None, :], b_dq, mask=m_r[:, None])


@triton.jit
def _mita_bwd_dkdv_routed_kernel(
    Q,
    K,
    V,
    IDX,
    POS,
    ROWS,
    STARTS,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    N,
    M,
    TOPK,
    NROWS,
    H,
    SB,
    SH,
    SN,
    DSB,
    DSH,
    DSN,
    scale,
    scale_log2,
    S: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
    CSR: tl.constexpr,
):
    # CSR: each slot's row goes to its place in the keys' lists (POS, from _key_pos_kernel), so a key's rows are
    # contiguous; slots without a key write nothing. Else to row (expert, slot).
    i_j = tl.program_id(0)
    e = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    o_d = tl.arange(0, D)
    o_j = i_j * BN + tl.arange(0, BN)
    m_jin = o_j < TOPK
    b_idx = tl.load(IDX + (i_bh * M + e) * TOPK + o_j, mask=m_jin, other=-1)
    m_j = b_idx >= 0
    o_k = tl.where(m_j, b_idx, 0).to(tl.int64)
    # [BN, D]
    b_k = tl.load(_head_ptr(K, i_bh, H, SB, SH) + o_k[:, None] * SN + o_d[None, :], mask=m_j[:, None], other=0.0)
    b_v = tl.load(_head_ptr(V, i_bh, H, SB, SH) + o_k[:, None] * SN + o_d[None, :], mask=m_j[:, None], other=0.0)
    Q_h = _head_ptr(Q, i_bh, H, SB, SH)
    DO_h = _head_ptr(DO, i_bh, H, DSB, DSH)
    b_dk = tl.zeros([BN, D], tl.float32)
    b_dv = tl.zeros([BN, D], tl.float32)
    rs = tl.load(STARTS + i_bh * (M + 1) + e)
    re = tl.load(STARTS + i_bh * (M + 1) + e + 1)
    for r0 in range(rs, re, BM):
        o_r = r0 + tl.arange(0, BM)
        m_r = o_r < re
        rows = tl.load(ROWS + i_bh * NROWS + o_r, mask=m_r, other=0)
        o_n = (rows // S).to(tl.int64)
        # [BM, D]
        b_q = tl.load(Q_h + o_n[:, None] * SN + o_d[None, :], mask=m_r[:, None], other=0.0)
        b_do = tl.load(DO_h + o_n[:, None] * DSN + o_d[None, :], mask=m_r[:, None], other=0.0)
        b_lse = tl.load(LSE + i_bh * N + o_n, mask=m_r, other=0.0)
        b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)
        b_delta = tl.load(DELTA + i_bh * N + o_n, mask=m_r, other=0.0)
        # [BN, BM]: keys along rows so dk, dv come out as [BN, D]
        b_st = _dot(b_k, tl.trans(b_q), PREC, UP) * scale_log2
        b_pt = tl.exp2(b_st - b_lse[None, :])
        b_pt = tl.where(m_j[:, None] & m_r[None, :], b_pt, 0.0)
        b_dv += _dot(b_pt.to(b_do.dtype), b_do, PREC, UP)
        b_dpt = _dot(b_v, tl.trans(b_do), PREC, UP)
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        b_dk += _dot(b_dst.to(b_q.dtype), b_q, PREC, UP)
    if CSR:
        o_w = i_bh * M * TOPK + tl.load(POS + (i_bh * M + e) * TOPK + o_j, mask=m_j, other=0).to(tl.int64)
        m_w = m_j
    else:
        o_w = (i_bh * M + e) * TOPK + o_j
        m_w = m_jin
    tl.store(DK + o_w[:, None] * D + o_d[None, :], b_dk * scale, mask=m_w[:, None])
    tl.store(DV + o_w[:, None] * D + o_d[None, :], b_dv, mask=m_w[:, None])


@triton.jit
def _mita_bwd_shared_kernel(
    Q,
    R,
    VT,
    DO,
    LSE,
    DELTA,
    DR,
    DVT,
    N,
    M,
    CHUNK,
    H,
    SB,
    SH,
    SN,
    DSB,
    DSH,
    DSN,
    sscale,
    sscale_log2,
    D: tl.constexpr,
    BM: tl.constexpr,
    BS: tl.constexpr,
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
    # [BS, D]
    b_r, b_vt = _shared_block(R, VT, i_bh, M, i_s * BS, o_d, D, BS)
    b_dr = tl.zeros([BS, D], tl.float32)
    b_dvt = tl.zeros([BS, D], tl.float32)
    n0 = i_c * CHUNK
    n1 = tl.minimum(n0 + CHUNK, N)
    Q_h = _head_ptr(Q, i_bh, H, SB, SH)
    DO_h = _head_ptr(DO, i_bh, H, DSB, DSH)
    for r0 in range(n0, n1, BM):
        o_n = r0 + tl.arange(0, BM)
        m_n = o_n < n1
        o_n64 = o_n.to(tl.int64)
        # [BM, D]
        b_q = tl.load(Q_h + o_n64[:, None] * SN + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_do = tl.load(DO_h + o_n64[:, None] * DSN + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_lse = tl.load(LSE + i_bh * N + o_n64, mask=m_n, other=0.0)
        b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)
        b_delta = tl.load(DELTA + i_bh * N + o_n64, mask=m_n, other=0.0)
        # [BS, BM]
        b_st = _dot(b_r, tl.trans(b_q), PREC, UP) * sscale_log2
        b_pt = tl.exp2(b_st - b_lse[None, :])
        b_pt = tl.where(m_j[:, None] & m_n[None, :], b_pt, 0.0)
        b_dvt += _dot(b_pt.to(b_do.dtype), b_do, PREC, UP)
        b_dpt = _dot(b_vt, tl.trans(b_do), PREC, UP)
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        b_dr += _dot(b_dst.to(b_q.dtype), b_q, PREC, UP)
    o_w = ((i_bh * n_c + i_c) * M + o_j).to(tl.int64)
    tl.store(DR + o_w[:, None] * D + o_d[None, :], b_dr * sscale, mask=m_j[:, None])
    tl.store(DVT + o_w[:, None] * D + o_d[None, :], b_dvt, mask=m_j[:, None])


@triton.jit
def _chunk_sum(P, i_bh, i_j, M, NC, D: tl.constexpr, BC: tl.constexpr):
    # Row i_j of head i_bh summed over the NC chunk partials of P [BH, NC, M, D] (float32, blocks of BC chunks).
    o_d = tl.arange(0, D)
    o_c = tl.arange(0, BC)
    acc = tl.zeros([D], tl.float32)
    for c0 in range(0, NC, BC):
        cc = c0 + o_c
        p = P + ((i_bh * NC + cc[:, None]) * M + i_j) * D + o_d[None, :]
        acc += tl.sum(tl.load(p, mask=cc[:, None] < NC, other=0.0), 0)
    return acc


@triton.jit
def _shared_merge_kernel(DRP, DVTP, VT, DRS, DVT, LVD, M, NC, D: tl.constexpr, BC: tl.constexpr):
    # Program (landmark, head): the shared expert's dR and d(landmark values) summed over the query chunks (dR kept
    # in float32 for _dr_merge_kernel, d(landmark values) rounded to VT's dtype), and the landmark values' delta
    # rowsum(dvt * vt) from the rounded row (what the key-side kernels read).
    i_j = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, D)
    o_w = (i_bh * M + i_j) * D + o_d
    tl.store(DRS + o_w, _chunk_sum(DRP, i_bh, i_j, M, NC, D, BC))
    b_dvt = _chunk_sum(DVTP, i_bh, i_j, M, NC, D, BC).to(DVT.dtype.element_ty)
    tl.store(DVT + o_w, b_dvt)
    b_vt = tl.load(VT + o_w)
    tl.store(LVD + i_bh * M + i_j, tl.sum(b_dvt.to(tl.float32) * b_vt.to(tl.float32), 0))


@triton.jit
def _dr_merge_kernel(DRA, DRB, DR, M, NCA, NCB, D: tl.constexpr, BCA: tl.constexpr, BCB: tl.constexpr):
    # Program (landmark, head): dR = (shared expert's partials summed) + (landmark values' partials summed), rounded
    # to DR's dtype.
    i_j = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, D)
    b_dr = _chunk_sum(DRA, i_bh, i_j, M, NCA, D, BCA) + _chunk_sum(DRB, i_bh, i_j, M, NCB, D, BCB)
    tl.store(DR + (i_bh * M + i_j) * D + o_d, b_dr.to(DR.dtype.element_ty))


@triton.jit
def _dkdv_final_kernel(
    DKE,
    DVE,
    IDX,
    PTR,
    R,
    K,
    V,
    KV,
    DVT,
    LV_LSE,
    LV_DELTA,
    DK,
    DV,
    N,
    M,
    TOPK,
    L,
    H,
    SB,
    SH,
    SN,
    scale,
    scale_log2,
    CSR: tl.constexpr,
    LV: tl.constexpr,
    HAS_KV: tl.constexpr,
    D: tl.constexpr,
    BK: tl.constexpr,
    KP: tl.constexpr,
    BS: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
):
    # Final dk, dv of a block of keys, in the keys' dtype: the sum of the key's routed (expert, slot) rows in
    # ascending expert order, plus (LV) the landmark-value attention's dk, dv. The routed rows are key j's rows
    # PTR[j] .. PTR[j + 1] (CSR: the routed kernel wrote them there) or found by matching the key against each
    # expert's index list (small m * N: no lists needed).
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_n = i_n * BK + tl.arange(0, BK)
    m_in = o_n < N
    o_n64 = o_n.to(tl.int64)
    o_d = tl.arange(0, D)
    b_dk = tl.zeros([BK, D], tl.float32)
    b_dv = tl.zeros([BK, D], tl.float32)
    if CSR:
        b_start = tl.load(PTR + i_bh * (N + 1) + o_n, mask=m_in, other=0)
        b_end = tl.load(PTR + i_bh * (N + 1) + o_n + 1, mask=m_in, other=0)
        n_max = tl.max(b_end - b_start, 0)
        for i in range(0, n_max):
            o_p = b_start + i
            m_p = o_p < b_end
            o_w = (i_bh * L + o_p.to(tl.int64))[:, None] * D + o_d[None, :]
            b_dk += tl.load(DKE + o_w, mask=m_p[:, None], other=0.0)
            b_dv += tl.load(DVE + o_w, mask=m_p[:, None], other=0.0)
    else:
        o_p = tl.arange(0, KP)
        for e in range(0, M):
            # An expert's index list holds each key at most once.
            b_idx = tl.load(IDX + (i_bh * M + e) * TOPK + o_p, mask=o_p < TOPK, other=-1)
            hit = b_idx[None, :] == o_n[:, None]
            found = tl.sum(hit.to(tl.int32), 1) > 0
            pos = tl.sum(tl.where(hit, o_p[None, :], 0), 1)
            o_w = ((i_bh * M + e) * TOPK + pos).to(tl.int64)[:, None] * D + o_d[None, :]
            b_dk += tl.load(DKE + o_w, mask=(found & m_in)[:, None], other=0.0)
            b_dv += tl.load(DVE + o_w, mask=(found & m_in)[:, None], other=0.0)
    if LV:
        m_n = _valid_keys(KV, i_bh, N, o_n, N, HAS_KV)
        o_kv = o_n64[:, None] * SN + o_d[None, :]
        b_k = tl.load(_head_ptr(K, i_bh, H, SB, SH) + o_kv, mask=m_n[:, None], other=0.0)
        b_v = tl.load(_head_ptr(V, i_bh, H, SB, SH) + o_kv, mask=m_n[:, None], other=0.0)
        b_lk, b_lv = _lv_dkdv_block(
            R, DVT, LV_LSE, LV_DELTA, b_k, b_v, m_n, i_bh, M, scale_log2, D=D, BS=BS, BN=BK, PREC=PREC, UP=UP
        )
        b_dv += b_lv
        b_dk += b_lk * scale
    o_w = o_n64[:, None] * D + o_d[None, :]
    tl.store(DK + i_bh * N * D + o_w, b_dk.to(DK.dtype.element_ty), mask=m_in[:, None])
    tl.store(DV + i_bh * N * D + o_w, b_dv.to(DV.dtype.element_ty), mask=m_in[:, None])


def _dq_launch(bm: int, d: int) -> dict:
    """Warps and register cap of the dq kernel: 8 warps (d 128) are capped at 128 registers, so 2 programs fit per SM
    (Triton 3.6 chose 130 at the LRA Pathfinder / Image shape: 1 per SM; capped, no spill: compile_check.py
    --point)."""
    warps = _num_warps(bm, d)
    return dict(num_warps=warps, **regs_cap(128 if warps == 8 else None))


def _bwd_dq(do, q, k, v, r, vt, o, lse, plan: RoutingPlan, lay, dlay, S, shared, scale, sscale, bn, bs, prec, up):
    """dq (``_mita_bwd_dq_kernel``) -> (dq ``[BH, N, d]`` in q's dtype, delta ``[BH, N]`` float32 that the kernel
    writes for the dk, dv and shared kernels)."""
    BH, m, D = r.shape
    N = q.shape[-2]
    topk = plan.idx.shape[-1]
    nrows = N * S
    T = plan.tile_e.shape[1]
    dev = q.device
    direct = S == 1
    delta = torch.empty(BH, N, device=dev, dtype=torch.float32)
    dq = q.new_empty(BH, N, D) if direct else torch.empty(BH, nrows, D, device=dev, dtype=torch.float32)
    fast(_mita_bwd_dq_kernel)[(T, BH)](
        q,
        k,
        v,
        r,
        vt,
        plan.idx,
        plan.rows,
        plan.tile_e,
        plan.tile_rs,
        plan.tile_re,
        do,
        o,
        lse,
        delta,
        dq,
        N,
        m,
        topk,
        nrows,
        T,
        *lay,
        *dlay,
        scale,
        sscale,
        scale * LOG2E,
        sscale * LOG2E,
        S=S,
        SHARED=shared,
        DIRECT=direct,
        D=D,
        BM=plan.bm,
        BN=bn,
        BS=bs,
        ONE_S=m <= bs and D <= 64,
        PREC=prec,
        UP=up,
        **_dq_launch(plan.bm, D),
    )
    if not direct:
        dq = dq.view(BH, N, S, D).sum(dim=2).to(q.dtype)
    return dq, delta


def _bwd_dkdv_routed(do, q, k, v, lse, delta, plan: RoutingPlan, lay, dlay, S, scale, bn, prec, up, csr, pos):
    """dk, dv of every routed (expert, slot), each in its own float32 row (``_mita_bwd_dkdv_routed_kernel``; row
    (expert, slot), or with csr its place ``pos`` in the keys' lists, :func:`_key_lists`) -> (dk_e, dv_e)
    ``[BH, m topk, d]``."""
    BH, m, topk = plan.idx.shape
    N, D = q.shape[-2], q.shape[-1]
    dev = q.device
    bmk = 32 if D <= 64 else 16
    L = m * topk
    dk_e = torch.empty(BH, L, D, device=dev, dtype=torch.float32)
    dv_e = torch.empty(BH, L, D, device=dev, dtype=torch.float32)
    fast(_mita_bwd_dkdv_routed_kernel)[(_cdiv(topk, bn), m, BH)](
        q,
        k,
        v,
        plan.idx,
        pos,
        plan.rows,
        plan.starts,
        do,
        lse,
        delta,
        dk_e,
        dv_e,
        N,
        m,
        topk,
        N * S,
        *lay,
        *dlay,
        scale,
        scale * LOG2E,
        S=S,
        D=D,
        BM=bmk,
        BN=bn,
        PREC=prec,
        UP=up,
        CSR=csr,
        num_warps=4,
    )
    return dk_e, dv_e


def _merge_bc(nc: int) -> int:
    # Chunk partials a merge program loads per step.
    return min(64, _next_pow2(nc))


def _dr_merge(dr_shared: torch.Tensor, dr_lv: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """dR in r's dtype: the shared expert's and the landmark values' chunk partials (``[BH, chunks, m, d]`` float32
    each) summed (``_dr_merge_kernel``)."""
    BH, m, D = r.shape
    dr = torch.empty_like(r)
    nca, ncb = dr_shared.shape[1], dr_lv.shape[1]
    fast(_dr_merge_kernel)[(m, BH)](
        dr_shared, dr_lv, dr, m, nca, ncb, D=D, BCA=_merge_bc(nca), BCB=_merge_bc(ncb), num_warps=2
    )
    return dr


def _bwd_shared(do, q, r, vt, lse, delta, lay, dlay, sscale, bs, prec, up):
    """The shared expert's dR and d(landmark values) (``_mita_bwd_shared_kernel``: partial sums per query chunk,
    summed by ``_shared_merge_kernel``) -> (dr ``[BH, 1, m, d]`` float32, the one-chunk form :func:`_dr_merge`
    takes; dvt in r's dtype; lv_delta ``[BH, m]`` float32)."""
    BH, m, D = r.shape
    N = q.shape[-2]
    dev = q.device
    bms = 64 if D <= 64 else 32
    n_sblk = _cdiv(m, bs)
    # Enough query chunks to fill the GPU; partial sums are reduced in a fixed order.
    n_chunk = max(1, min(_cdiv(N, 4 * bms), _cdiv(512, n_sblk * BH)))
    chunk = _cdiv(_cdiv(N, n_chunk), bms) * bms
    n_chunk = _cdiv(N, chunk)
    dr = torch.empty(BH, n_chunk, m, D, device=dev, dtype=torch.float32)
    dvt = torch.empty(BH, n_chunk, m, D, device=dev, dtype=torch.float32)
    fast(_mita_bwd_shared_kernel)[(n_sblk, n_chunk, BH)](
        q,
        r,
        vt,
        do,
        lse,
        delta,
        dr,
        dvt,
        N,
        m,
        chunk,
        *lay,
        *dlay,
        sscale,
        sscale * LOG2E,
        D=D,
        BM=bms,
        BS=bs,
        PREC=prec,
        UP=up,
        num_warps=4,
    )
    # The chunks' partials summed (dR in float32, d(landmark values) rounded) and the landmark values' delta: one
    # small launch; the partials are freed before the per-key kernel allocates dk and dv.
    dr_sum = torch.empty(BH, 1, m, D, device=dev, dtype=torch.float32)
    dvt_sum = torch.empty(BH, m, D, device=dev, dtype=r.dtype)
    lv_delta = torch.empty(BH, m, device=dev, dtype=torch.float32)
    fast(_shared_merge_kernel)[(m, BH)](
        dr, dvt, vt, dr_sum, dvt_sum, lv_delta, m, n_chunk, D=D, BC=_merge_bc(n_chunk), num_warps=2
    )
    return dr_sum, dvt_sum, lv_delta


def _bwd_dkdv_final(
    dk_e, dv_e, idx, ptr, r, k, v, kv, dvt, lv_lse, lv_delta, lay, csr, kp, lbs, shared, has_kv, scale, prec, up
):
    """dk, dv in k's and v's dtypes: each key's routed rows summed in a fixed order, the landmark values' part added
    with ``shared`` (``_dkdv_final_kernel``)."""
    BH, m, topk = idx.shape
    N, D = k.shape[-2], k.shape[-1]
    dk = k.new_empty(BH, N, D)
    dv = v.new_empty(BH, N, D)
    bk = 32
    fast(_dkdv_final_kernel)[(_cdiv(N, bk), BH)](
        dk_e,
        dv_e,
        idx,
        ptr,
        r,
        k,
        v,
        kv,
        dvt,
        lv_lse,
        lv_delta,
        dk,
        dv,
        N,
        m,
        topk,
        m * topk,
        *lay,
        scale,
        scale * LOG2E,
        CSR=csr,
        LV=shared,
        HAS_KV=has_kv,
        D=D,
        BK=bk,
        KP=kp,
        BS=lbs,
        PREC=prec,
        UP=up,
        num_warps=4,
    )
    return dk, dv


def _bwd_lv_dr(r, k, v, kv, dvt, lv_lse, lv_delta, lay, lbs, has_kv, scale, prec, up):
    """dR of the landmark values (``_lv_bwd_dr_kernel``): partials per key chunk ``[BH, chunks, m, d]`` float32,
    summed by :func:`_dr_merge`."""
    BH, m, D = r.shape
    N = k.shape[-2]
    nc, ch = _n_chunks(N, m, _cdiv(m, lbs), BH, 64)
    dr_lv = torch.empty(BH, nc, m, D, device=r.device, dtype=torch.float32)
    fast(_lv_bwd_dr_kernel)[(_cdiv(m, lbs), nc, BH)](
        r,
        k,
        v,
        kv,
        dvt,
        lv_lse,
        lv_delta,
        dr_lv,
        N,
        m,
        ch,
        *lay,
        scale,
        scale * LOG2E,
        HAS_KV=has_kv,
        D=D,
        BS=lbs,
        BN=64,
        PREC=prec,
        UP=up,
        num_warps=4,
    )
    return dr_lv


def mita_bwd(
    do,
    q,
    k,
    v,
    r,
    vt,
    o,
    lse,
    plan: RoutingPlan,
    S: int,
    shared: bool,
    scale: float,
    sscale: float,
    key_valid=None,
    lv_lse=None,
):
    """Fused backward, landmark values' backward included.

    Args:
        do, q, k, v, o: ``[BH, N, d]`` or ``[B, H, N, d]``; q, k, v in one layout (``heads_layout``), o as
            :func:`mita_fwd` gives it (a copy when not), do any layout of o's shape with a contiguous last dim
            (read in place with its own strides, ``grad_layouts``; a copy otherwise);
            r, vt: ``[BH, m, d]``; lse: the forward's ``[BH, N]`` log2 LSE.
        key_valid: ``[BH, N]`` bool or int8 (1 = valid) or None; lv_lse: the landmark values' ``[BH, m]`` log2 LSE
            (with ``shared``).

    Returns:
        ``(dq, dk, dv, dr)`` in the dtypes of q, k, v, r (one rounding each: everything is summed in float32 first);
        dq, dk, dv contiguous, shaped as q.
    """
    lay = heads_layout(q, k, v)
    BH, m, D = r.shape
    N = q.shape[-2]
    bn, bs = _blocks(m, plan.idx.shape[-1], D)
    prec, up = _prec(q.dtype), _upcast(q.dtype)
    o, do, dlay = grad_layouts(o, do)
    dq, delta = _bwd_dq(do, q, k, v, r, vt, o, lse, plan, lay, dlay, S, shared, scale, sscale, bn, bs, prec, up)
    # Routed keys/values: one row per (expert, slot) (each key's rows together where the keys take CSR lists), then
    # a per-key reduction in a fixed order.
    csr, ptr, pos, kp = _key_lists(plan.idx, N)
    dk_e, dv_e = _bwd_dkdv_routed(do, q, k, v, lse, delta, plan, lay, dlay, S, scale, bn, prec, up, csr, pos)
    if shared:
        dr, dvt, lv_delta = _bwd_shared(do, q, r, vt, lse, delta, lay, dlay, sscale, bs, prec, up)
    else:
        dvt = lv_delta = lv_lse = vt
    kv = key_valid.to(torch.int8).contiguous() if key_valid is not None else delta
    has_kv = key_valid is not None
    lbs = int(min(64 if D <= 64 else 32, max(16, _next_pow2(m))))
    dk, dv = _bwd_dkdv_final(
        dk_e, dv_e, plan.idx, ptr, r, k, v, kv, dvt, lv_lse, lv_delta, lay, csr, kp, lbs, shared, has_kv, scale,
        prec, up,
    )  # fmt: skip
    # The per-entry rows are summed into dk, dv: free them (and the CSR list) before the dR partials.
    del dk_e, dv_e, pos, ptr
    if shared:
        # dR of the landmark values (partials per key chunk) joins the shared expert's, in one small launch.
        dr = _dr_merge(dr, _bwd_lv_dr(r, k, v, kv, dvt, lv_lse, lv_delta, lay, lbs, has_kv, scale, prec, up), r)
    else:
        dr = torch.zeros_like(r)
    return dq.view(q.shape), dk.view(q.shape), dv.view(q.shape), dr
