"""Fused MiTA attention forward of the general path: one online softmax over [m shared entries ; S * k routed
entries] per tile of queries routed to one expert (``_mita_fwd_kernel``, launched by ``mita_fwd``).

Derived from the operator contract in README.md (not from the reference code's varlen + merge pipeline) and from
the usual FlashAttention-2 forward structure. Queries are grouped by expert with a stable sort of their routes
(``plan.py``), and each program takes a tile of queries routed to one expert; routed keys/values are read through
the expert's index list (never gathered into a copy), and the shared and routed entries share one softmax, so no
log-sum-exp merge is needed for S = 1; every shape is static (the tile table has a fixed upper bound), so there is
no host synchronisation. Settings: ``FWD_CONFIG``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mita.ops.mita.triton.common import (
    LOG2E,
    _dot,
    _head_ptr,
    _next_pow2,
    _out_ptr,
    _prec,
    _softmax_fma,
    _upcast,
    heads_layout,
    out_layout,
    regs_cap,
)
from mita.ops.mita.triton.launch import fast

_BIG_NEG = float("-inf")


# ----------------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _mita_fwd_kernel(
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
    O,
    LSE,
    N,
    M,
    TOPK,
    NROWS,
    T,
    H,
    SB,
    SH,
    SN,
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
    FULL: tl.constexpr,
):
    # The online softmax of _softmax_fma (the scale in the exponent's FMA, rescaling every block). FULL: every
    # index list holds TOPK >= 0 entries, TOPK % BN == 0, M % BS == 0 and S == 1 (no padding), so the key blocks and
    # shared blocks load and score without masks.
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    e = tl.load(TILE_E + i_bh * T + i_t)
    if e >= 0:
        rs = tl.load(TILE_RS + i_bh * T + i_t)
        re = tl.load(TILE_RE + i_bh * T + i_t)
        o_r = rs + tl.arange(0, BM)
        m_r = o_r < re
        rows = tl.load(ROWS + i_bh * NROWS + o_r, mask=m_r, other=0)
        o_n = (rows // S).to(tl.int64)
        slot = rows % S
        o_d = tl.arange(0, D)
        # [BM, D]
        b_q = tl.load(_head_ptr(Q, i_bh, H, SB, SH) + o_n[:, None] * SN + o_d[None, :], mask=m_r[:, None], other=0.0)
        K_h = _head_ptr(K, i_bh, H, SB, SH)
        V_h = _head_ptr(V, i_bh, H, SB, SH)
        b_m = tl.full([BM], float("-inf"), tl.float32)
        b_l = tl.zeros([BM], tl.float32)
        b_acc = tl.zeros([BM, D], tl.float32)
        if SHARED:
            for j0 in range(0, M, BS):
                o_j = j0 + tl.arange(0, BS)
                m_j = o_j < M
                # [BS, D]
                if FULL:
                    b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :])
                    b_vt = tl.load(VT + i_bh * M * D + o_j[:, None] * D + o_d[None, :])
                else:
                    b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
                    b_vt = tl.load(VT + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
                # [BM, BS]
                b_s = _dot(b_q, tl.trans(b_r), PREC, UP)
                if not FULL:
                    b_s = tl.where(m_j[None, :] & (slot == 0)[:, None], b_s, float("-inf"))
                b_m, b_l, b_acc = _softmax_fma(b_s, sscale_log2, b_vt, b_m, b_l, b_acc, PREC, UP)
        for j0 in range(0, TOPK, BN):
            o_j = j0 + tl.arange(0, BN)
            if FULL:
                o_k = tl.load(IDX + (i_bh * M + e) * TOPK + o_j).to(tl.int64)
                # [BN, D]
                b_k = tl.load(K_h + o_k[:, None] * SN + o_d[None, :])
                b_v = tl.load(V_h + o_k[:, None] * SN + o_d[None, :])
            else:
                b_idx = tl.load(IDX + (i_bh * M + e) * TOPK + o_j, mask=o_j < TOPK, other=-1)
                m_j = b_idx >= 0
                o_k = tl.where(m_j, b_idx, 0).to(tl.int64)
                b_k = tl.load(K_h + o_k[:, None] * SN + o_d[None, :], mask=m_j[:, None], other=0.0)
                b_v = tl.load(V_h + o_k[:, None] * SN + o_d[None, :], mask=m_j[:, None], other=0.0)
            # [BM, BN]
            b_s = _dot(b_q, tl.trans(b_k), PREC, UP)
            if not FULL:
                b_s = tl.where(m_j[None, :], b_s, float("-inf"))
            b_m, b_l, b_acc = _softmax_fma(b_s, scale_log2, b_v, b_m, b_l, b_acc, PREC, UP)
        m_nz = b_l > 0
        b_o = b_acc / tl.where(m_nz, b_l, 1.0)[:, None]
        b_lse = tl.where(m_nz, b_m + tl.log2(tl.where(m_nz, b_l, 1.0)), float("-inf"))
        if DIRECT:
            O_h = _out_ptr(O, i_bh, H, N, D)
            tl.store(O_h + o_n[:, None] * (H * D) + o_d[None, :], b_o.to(O.dtype.element_ty), mask=m_r[:, None])
            tl.store(LSE + i_bh * N + o_n, b_lse, mask=m_r)
        else:
            o_w = rows.to(tl.int64)
            tl.store(O + i_bh * NROWS * D + o_w[:, None] * D + o_d[None, :], b_o, mask=m_r[:, None])
            tl.store(LSE + i_bh * NROWS + o_w, b_lse, mask=m_r)


# Launch settings of the general path's attention kernels: query rows per tile at most bm_max; keys / landmarks per
# step at most bn_max (None: 64 for d <= 64, else 32); warps and pipeline stages of the forward (None: by tile size /
# Triton's default). maxnreg caps the forward's registers per thread and num_stages sets its pipeline depth: None for
# the default (_fwd_launch), 0 for the compiler's choice / Triton's default (scripts/bench/compile_check.py prints
# registers and programs per SM). bm_infer: bm_max of a forward that no backward follows (no input requires a
# gradient, or grad mode is off), which can take larger query tiles than the backward wants (None: bm_max).
# route_stream (CUDA only; CUDA graphs capture the fork and join): 3: the routing in order, the plan's kernels on a
# second stream beside the top-k after its block-top pass, at ROUTE_STREAM_MIN_N keys or more (below, the fork and
# join cost more host time than they save: on the H100 eager forwards at B 8 x 4096 and LRA ListOps took 0.05-0.16 ms
# less in order); 0: everything in order. Without padding (and S = 1, block
# sizes dividing m and k) the forward's loads and scores skip their masks (FULL); its online softmax is _softmax_fma.
# Measurements: notes/kernels-notes.md.
FWD_CONFIG = dict(bm_max=64, bn_max=None, num_warps=None, num_stages=None, maxnreg=None, bm_infer=None, route_stream=3)
ROUTE_STREAM_MIN_N = 65536


# ----------------------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------------------


def _blocks(m: int, topk: int, d: int) -> tuple[int, int]:
    cap = FWD_CONFIG["bn_max"] or (64 if d <= 64 else 32)
    bn = int(min(cap, max(16, _next_pow2(topk))))
    bs = int(min(cap, max(16, _next_pow2(m))))
    return bn, bs


def _num_warps(bm: int, d: int) -> int:
    return 4 if bm * d <= 64 * 64 else 8


def _fwd_num_warps(bm: int, d: int) -> int:
    # The forward keeps 4 warps for 128-row tiles at d <= 64 (8 were 1.3-1.4x slower).
    return 4 if d <= 64 and bm <= 128 else _num_warps(bm, d)


def _fwd_launch(bm: int, bn: int, d: int) -> dict:
    """Warps, pipeline stages and register cap of the fused forward (FWD_CONFIG overrides). 64-row tiles of 64-key
    blocks at d 64 take a 96-register cap and 2 stages (5 programs per SM instead of 3; faster on the H200, see
    notes/kernels-notes.md); other tile shapes keep the compiler's choice."""
    tuned = bm == 64 and bn == 64 and d == 64
    stages, cap = FWD_CONFIG["num_stages"], FWD_CONFIG["maxnreg"]
    if stages is None:
        stages = 2 if tuned else 0
    if cap is None:
        cap = 96 if tuned else 0
    opts = dict(num_warps=FWD_CONFIG["num_warps"] or _fwd_num_warps(bm, d), **regs_cap(cap))
    if stages:
        opts["num_stages"] = int(stages)
    return opts


def mita_fwd(q, k, v, r, vt, plan, S: int, shared: bool, scale: float, sscale: float, full=False):
    """Fused forward. q, k, v: ``[BH, N, d]`` or ``[B, H, N, d]``, one layout (:func:`heads_layout`: any batch, head
    and row strides); r, vt: ``[BH, m, d]``. full: every entry of ``plan.idx`` is a key index (no -1: no padding),
    so the kernel may skip masks where the block sizes divide m and k.

    Returns:
        ``(o, lse [BH, N] float32 in log2 units)``; o in q's dtype: ``[BH, N, d]`` for flattened heads, else
        ``[B, H, N, d]`` stored in ``[B, N, H, d]`` order (its ``transpose(1, 2)`` is contiguous, as the output
        projection wants).
    """
    lay = heads_layout(q, k, v)
    BH, m, D = r.shape
    N = q.shape[-2]
    topk = plan.idx.shape[-1]
    nrows = N * S
    T = plan.tile_e.shape[1]
    bn, bs = _blocks(m, topk, D)
    direct = S == 1
    if direct:
        o = out_layout(q)
        lse = torch.empty(BH, N, device=q.device, dtype=torch.float32)
    else:
        o = torch.empty(BH, nrows, D, device=q.device, dtype=torch.float32)
        lse = torch.empty(BH, nrows, device=q.device, dtype=torch.float32)
    fast(_mita_fwd_kernel)[(T, BH)](
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
        o,
        lse,
        N,
        m,
        topk,
        nrows,
        T,
        *lay,
        scale * LOG2E,
        sscale * LOG2E,
        S=S,
        SHARED=shared,
        DIRECT=direct,
        D=D,
        BM=plan.bm,
        BN=bn,
        BS=bs,
        PREC=_prec(q.dtype),
        UP=_upcast(q.dtype),
        FULL=bool(full) and S == 1 and topk % bn == 0 and m % bs == 0,
        **_fwd_launch(plan.bm, bn, D),
    )
    if direct:
        return o, lse
    # Merge the S partial softmaxes of each query (only slot 0 holds the shared entries).
    o = o.view(BH, N, S, D)
    lse = lse.view(BH, N, S)
    tot = torch.logsumexp(lse * math.log(2.0), dim=-1) / math.log(2.0)
    tot_safe = torch.where(torch.isinf(tot), torch.zeros_like(tot), tot)
    # In place: the float32 partials are the largest buffers of the call.
    out = o.mul_(torch.exp2(lse - tot_safe[..., None])[..., None]).sum(dim=2)
    del o
    return out_layout(q).copy_(out.view(q.shape)), tot
