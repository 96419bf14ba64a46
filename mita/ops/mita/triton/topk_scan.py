"""Exact top-k kernels that score keys: the on-chip top-k of short rows, the two launches of medium rows and the
block-top / refinement passes of long rows.

- ``_topk_small_kernel`` (rows up to ``topk.SMALL_N`` keys): one program per (16 landmarks, head) keeps the
  [landmarks, N] order keys on chip and finds the k-th largest by a four-way search (``_topk_select``).
- ``_topk_keys_kernel`` / ``_topk_rows_kernel`` (rows up to ``topk.MEDIUM_N`` keys): the order keys through a
  scratch buffer, then the same search a few rows at a time (``_topk_select_split``: a tile and a tail).
- ``_topk_scan_body`` / ``_topk_scan_kernel``: the passes over a long row's key blocks, one helper each: block tops
  (``_scan_block_tops``), with the landmark values' split-key partials computed from the same scores (``LVF``);
  the fallback's refinement passes (``_scan_counts``), recount and ordered emission (``_scan_band``).
- The order-key helpers (``_order_key``, ``_pack_key``, ``_key_threshold``, ``_first_max``) and the per-row
  refinement state (``_topk_state``, ``_narrow``) these passes and the selection kernels (``topk_select``) share.

The host side (``exact_topk``, ``SCAN_CONFIG``) is ``topk.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mita.ops.mita.triton.common import (
    _head_ptr,
    _score,
    _softmax_fma,
    _softmax_fma_max,
    _softmax_lazy,
    _softmax_lazy_max,
    _softmax_step,
    _valid_keys,
)
from mita.ops.mita.triton.landmark_values import _lv_merge_row, _lv_store

# Threshold candidates per refinement pass of the long-row top-k, and the number of passes (16^8 = 2^32).
_P = 16
_PASSES = 8


@triton.jit
def _first_max(b_x, b_max, o_k, BN: tl.constexpr):
    # The first column of each row of b_x [X, BN] holding its maximum b_max [X] (-0.0 and +0.0 compare equal, as
    # the maximum-with-index reduction's ties see them; column 0 for a row without a match, i.e. a NaN maximum).
    c = tl.min(tl.where(b_x == b_max[:, None], o_k[None, :], BN), 1)
    return tl.where(c < BN, c, 0)


@triton.jit
def _order_key(s):
    # fp32 -> int32 with the same order (-0.0 folded onto +0.0 first, as a stable sort sees them as equal).
    s = tl.where(s == 0.0, 0.0, s)
    b = s.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _pack_key(s, n):
    # One int64 per (score, key index) whose order is score desc, index asc: the order key above, the reversed index
    # below (_final_row decodes it).
    return (_order_key(s).to(tl.int64) << 32) + (0xFFFFFFFF - n.to(tl.int64))


@triton.jit
def _key_threshold(lo):
    # The float t with order key(s) >= lo <=> s >= t (order keys map one to one and in order onto float bit
    # patterns: -inf below every score's key; NaN, which no score reaches, above +inf's key: a row without valid
    # keys).
    t = tl.where(lo >= 0, lo, lo ^ 0x7FFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where(lo <= _KEY_NEG_INF, float("-inf"), t)


@triton.jit
def _count3(b_key, t1, t2, t3, WIDE: tl.constexpr):
    # Per row of b_key [R, L]: how many keys reach each of the thresholds t1, t2, t3 [R], in one reduction over
    # packed fields (WIDE: 21-bit fields of an int64, for L >= 1024; else 10-bit fields of an int32).
    if WIDE:
        f = tl.where(b_key >= t1[:, None], 1, 0).to(tl.int64)
        f += tl.where(b_key >= t2[:, None], 1, 0).to(tl.int64) << 21
        f += tl.where(b_key >= t3[:, None], 1, 0).to(tl.int64) << 42
        c = tl.sum(f, 1)
        return (c & 2097151).to(tl.int32), ((c >> 21) & 2097151).to(tl.int32), (c >> 42).to(tl.int32)
    else:
        f = tl.where(b_key >= t1[:, None], 1, 0)
        f += tl.where(b_key >= t2[:, None], 1024, 0)
        f += tl.where(b_key >= t3[:, None], 1048576, 0)
        c = tl.sum(f, 1)
        return c & 1023, (c >> 10) & 1023, c >> 20


@triton.jit
def _topk_select(b_key, m_v, m_j, kk):
    """Top-kk of each row of the int32 order keys b_key [R, L] among the entries m_v (rows m_j), ties to the lower
    column: a 0/1 [R, L] selection (every valid entry of a row with at most kk of them); :func:`_topk_select_split`
    without a tail."""
    return _topk_select_split(b_key, m_v, m_j, kk, b_key, m_v, False)[0]


@triton.jit
def _topk_select_split(b_key, m_v, m_j, kk, t_key, m_t, TAIL: tl.constexpr):
    """Top-kk of each row of the int32 order keys b_key [R, L] (entries m_v, rows m_j) and, with TAIL, the row's
    further columns t_key [R, T] (entries m_t), ties to the lower column: the 0/1 selections ([R, L], [R, T]). The
    kk-th largest key is the largest t with count(key >= t) >= kk, found by a four-way search from [row min, row max
    + 1): each step counts the keys at or above the three thresholds that split [lo, hi) in four, as one sum of packed
    fields per tile (10 bits in an int32 where a tile's count stays below 1024, else 21 bits in an int64), and keeps
    the quarter holding the kk-th largest key. A row stops as soon as count(key >= lo) == kk ({key >= lo} is then its
    top-kk), otherwise when hi = lo + 1, and the ties at lo are taken in column order. (About half the steps of a
    bisection: each step's block-wide reduction, not its arithmetic, is what the short kernels wait on.) Every
    threshold lies above the row's smallest key, so without a tail L = 1024 columns count at most 1023."""
    tl.static_assert(b_key.shape[1] < 2097152)
    WIDE: tl.constexpr = b_key.shape[1] > 1024 or (TAIL and b_key.shape[1] >= 1024)
    lo = tl.min(tl.where(m_v, b_key, 2147483647), 1).to(tl.int64)
    hi = tl.max(tl.where(m_v, b_key, -2147483648), 1).to(tl.int64) + 1
    c_lo = tl.sum(m_v.to(tl.int32), 1)
    # Entries outside m_v never reach a threshold: every threshold is above lo, so above the smallest int32.
    b_key = tl.where(m_v, b_key, -2147483648)
    if TAIL:
        tl.static_assert(t_key.shape[1] < 1024)
        lo = tl.minimum(lo, tl.min(tl.where(m_t, t_key, 2147483647), 1).to(tl.int64))
        hi = tl.maximum(hi, tl.max(tl.where(m_t, t_key, -2147483648), 1).to(tl.int64) + 1)
        c_lo += tl.sum(m_t.to(tl.int32), 1)
        t_key = tl.where(m_t, t_key, -2147483648)
    busy = m_j & (c_lo != kk) & (hi - lo > 1)
    while tl.max(busy.to(tl.int32), 0) > 0:
        w = hi - lo
        # lo < t1 <= t2 <= t3 < hi for a busy row (w >= 2), so all within int32.
        t1 = lo + tl.maximum(w // 4, 1)
        t2 = lo + w // 2
        t3 = lo + (3 * w) // 4
        u1, u2, u3 = t1.to(tl.int32), t2.to(tl.int32), t3.to(tl.int32)
        c1, c2, c3 = _count3(b_key, u1, u2, u3, WIDE)
        if TAIL:
            e1, e2, e3 = _count3(t_key, u1, u2, u3, False)
            c1 += e1
            c2 += e2
            c3 += e3
        # The largest threshold that kk keys reach (lo always does) and the next one above it.
        ok1 = busy & (c1 >= kk)
        ok2 = busy & (c2 >= kk)
        ok3 = busy & (c3 >= kk)
        hi = tl.where(ok3, hi, tl.where(ok2, t3, tl.where(ok1, t2, tl.where(busy, t1, hi))))
        lo = tl.where(ok3, t3, tl.where(ok2, t2, tl.where(ok1, t1, lo)))
        c_lo = tl.where(ok3, c3, tl.where(ok2, c2, tl.where(ok1, c1, c_lo)))
        busy = m_j & (c_lo != kk) & (hi - lo > 1)
    m_gt = m_v & (b_key > lo[:, None])
    m_eq = m_v & (b_key == lo[:, None])
    n_gt = tl.sum(m_gt.to(tl.int32), 1)
    if TAIL:
        t_gt = m_t & (t_key > lo[:, None])
        t_eq = m_t & (t_key == lo[:, None])
        n_gt += tl.sum(t_gt.to(tl.int32), 1)
        t_rank = tl.cumsum(t_eq.to(tl.int32), 1) - 1 + tl.sum(m_eq.to(tl.int32), 1)[:, None]
        sel_t = t_gt | (t_eq & (t_rank < (kk - n_gt)[:, None]))
    else:
        sel_t = m_t
    tie_rank = tl.cumsum(m_eq.to(tl.int32), 1) - 1
    return m_gt | (m_eq & (tie_rank < (kk - n_gt)[:, None])), sel_t


# ----------------------------------------------------------------------------------------------------------------
# exact top-k: short rows, on chip; medium rows through a scratch buffer
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _topk_small_kernel(
    R,
    K,
    KV,
    KK,
    IDX,
    N,
    M,
    TOPK,
    H,
    SB,
    SH,
    SN,
    HAS_KV: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    NP: tl.constexpr,
    KP: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
    EXACT: tl.constexpr,
):
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, D)
    o_j = i_s * BS + tl.arange(0, BS)
    m_j = o_j < M
    o_n = tl.arange(0, NP)
    m_n = _valid_keys(KV, i_bh, N, o_n, N, HAS_KV)
    b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
    b_k = tl.load(
        _head_ptr(K, i_bh, H, SB, SH) + o_n.to(tl.int64)[:, None] * SN + o_d[None, :], mask=m_n[:, None], other=0.0
    )
    # [BS, NP] order keys of the raw scores; invalid keys take no part.
    b_key = _order_key(_score(b_r, b_k, PREC, UP, EXACT))
    m_v = m_n[None, :] & m_j[:, None]
    kk = _head_kk(KK, i_bh, TOPK, HAS_KV)
    sel = _topk_select(b_key, m_v, m_j, kk)
    base = IDX + (i_bh * M + o_j) * TOPK
    _emit_selected(base, sel, o_n, 0)
    _emit_missing(base, m_j, kk, TOPK, KP)


@triton.jit
def _emit_selected(base, sel, o_n, first):
    # The columns o_n [L] that sel [R, L] selects, in column order, to base[r] + first + 0, 1, ... (first: 0, or an
    # [R, 1] offset); returns how many each row took.
    pos = tl.cumsum(sel.to(tl.int32), 1) - 1 + first
    tl.store(base[:, None] + pos, tl.broadcast_to(o_n[None, :], sel.shape), mask=sel)
    return tl.sum(sel.to(tl.int32), 1)


@triton.jit
def _emit_missing(base, m_r, kk, TOPK, KP: tl.constexpr):
    # -1 in the slots kk .. TOPK - 1 of the rows m_r (slots a row has no valid key for).
    o_p = tl.arange(0, KP)
    tl.store(
        base[:, None] + o_p[None, :],
        tl.full([m_r.shape[0], KP], -1, tl.int32),
        mask=m_r[:, None] & (o_p[None, :] >= kk) & (o_p[None, :] < TOPK),
    )


@triton.jit
def _topk_keys_kernel(
    R,
    K,
    V,
    KV,
    SCR,
    PM,
    PL,
    PACC,
    VT,
    LSE,
    scale_log2,
    N,
    M,
    CH,
    NS,
    H,
    SB,
    SH,
    SN,
    HAS_KV: tl.constexpr,
    LV: tl.constexpr,
    DIRECT: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
    EXACT: tl.constexpr,
):
    # Medium rows, first launch: the order keys of a (BS landmarks, CH keys) tile into the scratch SCR [BH, M, NS]
    # (int32; keys from N on are not written). LV: the landmark values' online softmax over the same scores, as
    # _lv_fwd_kernel's split-key partials (PM, PL, PACC [BH, chunks, M(, D)]; the rows kernel merges them), or with one
    # key chunk (DIRECT) the values and their LSE themselves.
    i_s = tl.program_id(0)
    i_g = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    o_d = tl.arange(0, D)
    o_j = i_s * BS + tl.arange(0, BS)
    m_j = o_j < M
    b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
    K_h = _head_ptr(K, i_bh, H, SB, SH)
    V_h = _head_ptr(V, i_bh, H, SB, SH)
    scr = SCR + i_bh * M * NS
    b_m = tl.full([BS], float("-inf"), tl.float32)
    b_l = tl.zeros([BS], tl.float32)
    b_acc = tl.zeros([BS, D], tl.float32)
    n1 = tl.minimum(N, (i_g + 1) * CH)
    for n0 in range(i_g * CH, n1, BN):
        o_b = n0 + tl.arange(0, BN)
        m_b, b_s = _key_block_scores(b_r, K_h, KV, i_bh, N, o_b, n1, SN, o_d, HAS_KV, PREC, UP, EXACT)
        tl.store(scr + o_j[:, None] * NS + o_b[None, :], _order_key(b_s), mask=m_j[:, None] & (o_b < n1)[None, :])
        if LV:
            b_v = tl.load(V_h + o_b.to(tl.int64)[:, None] * SN + o_d[None, :], mask=m_b[:, None], other=0.0)
            b_ls = tl.where(m_b[None, :], b_s * scale_log2, float("-inf"))
            b_m, b_l, b_acc = _softmax_step(b_ls, b_v, b_m, b_l, b_acc, PREC, UP)
    if LV:
        _lv_store(b_m, b_l, b_acc, PM, PL, PACC, VT, LSE, i_bh, i_g, tl.num_programs(1), M, o_j, m_j, o_d, D, DIRECT)


@triton.jit
def _topk_rows_kernel(
    KV,
    KK,
    IDX,
    SCR,
    PM,
    PL,
    PACC,
    VT,
    LSE,
    N,
    M,
    TOPK,
    NS,
    NC,
    HAS_KV: tl.constexpr,
    NP: tl.constexpr,
    NT: tl.constexpr,
    RS: tl.constexpr,
    KP: tl.constexpr,
    MERGE: tl.constexpr,
    D: tl.constexpr,
    BC: tl.constexpr,
):
    # Medium rows, second launch: RS rows of the scratch's order keys as one [RS, NP] tile (and, NT > 0, the keys from
    # NP on as a [RS, NT] tail: rows a little longer than a power of 2), the four-way search of the short rows
    # (_topk_select_split), and the rows' indices, ascending, then -1. MERGE: then the rows' landmark values from the
    # NC split-key partials of the keys kernel.
    i_r = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    kk = _head_kk(KK, i_bh, TOPK, HAS_KV)
    o_r = i_r * RS + tl.arange(0, RS)
    m_r = o_r < M
    row = SCR + (i_bh * M + o_r)[:, None] * NS
    o_n = tl.arange(0, NP)
    m_n = _valid_keys(KV, i_bh, N, o_n, N, HAS_KV)
    m_v = m_n[None, :] & m_r[:, None]
    b_key = tl.load(row + o_n[None, :], mask=m_v, other=-2147483648)
    if NT > 0:
        o_t = NP + tl.arange(0, NT)
        m_t = _valid_keys(KV, i_bh, N, o_t, N, HAS_KV)
        m_tv = m_t[None, :] & m_r[:, None]
        t_key = tl.load(row + o_t[None, :], mask=m_tv, other=-2147483648)
        sel, sel_t = _topk_select_split(b_key, m_v, m_r, kk, t_key, m_tv, True)
    else:
        sel = _topk_select(b_key, m_v, m_r, kk)
    base = IDX + (i_bh * M + o_r) * TOPK
    n_sel = _emit_selected(base, sel, o_n, 0)
    if NT > 0:
        _emit_selected(base, sel_t, o_t, n_sel[:, None])
    _emit_missing(base, m_r, kk, TOPK, KP)
    if MERGE:
        for i_j in range(i_r * RS, tl.minimum(i_r * RS + RS, M)):
            _lv_merge_row(PM, PL, PACC, VT, LSE, i_j, i_bh, M, NC, D, BC)


# ----------------------------------------------------------------------------------------------------------------
# exact top-k: long rows, threshold passes
# ----------------------------------------------------------------------------------------------------------------

# Device copies of the pass constants, the order key of -inf and the empty candidate-list entry.
_NPASS = tl.constexpr(_PASSES)
_KEY_NEG_INF = tl.constexpr(-2139095041)
_EMPTY = tl.constexpr(-(2**63))


@triton.jit
def _head_kk(KK, i_bh, topk, HAS_KV: tl.constexpr):
    # Keys each landmark of head i_bh keeps: the head's valid-key count clamped to topk (KK) with padding, else topk.
    if HAS_KV:
        kk = tl.load(KK + i_bh)
    else:
        kk = topk
    return kk


@triton.jit
def _narrow(lo, hi, p, P: tl.constexpr):
    # [t_p, t_{p+1}) of the P sub-ranges of [lo, hi), t_p = lo + (hi - lo) * p // P (the last one ends at hi).
    t_lo = lo + ((hi - lo) * p) // P
    t_hi = tl.where(p + 1 < P, lo + ((hi - lo) * (p + 1)) // P, hi)
    return t_lo, t_hi


@triton.jit
def _topk_state(LO, HI, DONE, CNT, row, m_j, fb, kk, i_pass, nrows, CAP, write, P: tl.constexpr, CM: tl.constexpr):
    # (lo, hi, done) of the rows before refinement pass i_pass (i_pass = _NPASS: the final state), from the state
    # before pass i_pass - 1 and that pass's counts; write: store it in slot i_pass (one program per landmark tile).
    # Invariant for a row not done: count(key >= lo) >= kk > count(key >= hi). CM ".cg": the previous slot and counts
    # were written by other programs of the same launch (the persistent fallback kernel): loaded from L2, not L1.
    if i_pass == 0:
        lo = tl.load(LO + row, mask=m_j, other=0)
        hi = tl.load(HI + row, mask=m_j, other=1)
        # Rows whose candidates all fit the list are done; so are rows whose lo is the k-th key itself.
        done = (~fb) | (hi - lo <= 1)
    else:
        prev = (i_pass - 1) * nrows + row
        lo = tl.load(LO + prev, mask=m_j, other=0, cache_modifier=CM)
        hi = tl.load(HI + prev, mask=m_j, other=1, cache_modifier=CM)
        done_p = tl.load(DONE + prev, mask=m_j, other=1, cache_modifier=CM) != 0
        o_p = tl.arange(0, P)
        cnt = tl.load(CNT + prev[:, None] * P + o_p[None, :], mask=m_j[:, None], other=0, cache_modifier=CM)
        # Counts fall with the threshold, so the thresholds kk keys reach are a prefix; p = 0 (lo) always is.
        n_ok = tl.sum((cnt >= kk).to(tl.int32), 1)
        p_star = tl.maximum(n_ok - 1, 0)
        t_lo, t_hi = _narrow(lo, hi, p_star, P)
        c_lo = tl.sum(tl.where(o_p[None, :] == p_star[:, None], cnt, 0), 1)
        lo = tl.where(done_p, lo, t_lo)
        hi = tl.where(done_p, hi, t_hi)
        done = done_p | (c_lo <= CAP) | (t_hi - t_lo <= 1)
    if write:
        cur = i_pass * nrows + row
        tl.store(LO + cur, lo, mask=m_j)
        tl.store(HI + cur, hi, mask=m_j)
        tl.store(DONE + cur, done.to(tl.int32), mask=m_j)
    return lo, hi, done


@triton.jit
def _key_block_scores(b_r, K_h, KV, i_bh, N, o_n, n1, SN, o_d, HAS_KV: tl.constexpr, PREC: tl.constexpr,
                      UP: tl.constexpr, EXACT: tl.constexpr):  # fmt: skip
    # Scores of the landmark tile b_r against the key block o_n (keys below n1, and valid with padding) -> (valid
    # keys [BN], scores [BS, BN]). Every pass that scores keys calls this, so equal launches give equal bits.
    m_n = _valid_keys(KV, i_bh, N, o_n, n1, HAS_KV)
    b_k = tl.load(K_h + o_n.to(tl.int64)[:, None] * SN + o_d[None, :], mask=m_n[:, None], other=0.0)
    return m_n, _score(b_r, b_k, PREC, UP, EXACT)


@triton.jit
def _clear_lists(CAND, row, fb, CAP, BS: tl.constexpr, BN: tl.constexpr):
    # Empty the [CAP] candidate lists of the tile's fallback rows fb [BS].
    for c0 in range(0, CAP, BN):
        o_e = c0 + tl.arange(0, BN)
        tl.store(
            CAND + row[:, None] * CAP + o_e[None, :],
            tl.full([BS, BN], _EMPTY, tl.int64),
            mask=fb[:, None] & (o_e < CAP)[None, :],
        )


@triton.jit
def _chunk_offsets(CNT, row, need, i_g, G, nrows, MODE: tl.constexpr, P: tl.constexpr, BS: tl.constexpr,
                   BN: tl.constexpr, CM: tl.constexpr):  # fmt: skip
    # MODE 3: where this chunk's keys go in each row's list -> (w_hi, w_band) [BS], from the per-chunk counts of MODE 2:
    # the earlier chunks' keys >= hi, and every chunk's keys >= hi then the earlier chunks' keys in [lo, hi). MODE 2
    # writes nothing: zeros.
    w_hi = tl.zeros([BS], tl.int32)
    w_band = tl.zeros([BS], tl.int32)
    if MODE == 3:
        CC = CNT + _NPASS * nrows * P
        n_hi = tl.zeros([BS], tl.int32)
        for g0 in range(0, G, BN):
            o_g = g0 + tl.arange(0, BN)
            m_g = need[:, None] & (o_g < G)[None, :]
            a_hi = tl.load(CC + (row[:, None] * G + o_g[None, :]) * 2, mask=m_g, other=0, cache_modifier=CM)
            a_band = tl.load(CC + (row[:, None] * G + o_g[None, :]) * 2 + 1, mask=m_g, other=0, cache_modifier=CM)
            before = (o_g < i_g)[None, :]
            n_hi += tl.sum(a_hi, 1)
            w_hi += tl.sum(tl.where(before, a_hi, 0), 1)
            w_band += tl.sum(tl.where(before, a_band, 0), 1)
        w_band += n_hi
    return w_hi, w_band


@triton.jit
def _scan_block_tops(b_r, K_h, V, KV, CMAX, ARG, PM, PL, PACC, scale_log2, i_bh, i_g, o_j, m_j, row, o_d, n0, n1, N,
                     M, G, NBLK, PS, H, SB, SH, SN, HAS_KV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                     BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr, TOPT: tl.constexpr,
                     BG: tl.constexpr, ET: tl.constexpr, LVF: tl.constexpr, EVEN: tl.constexpr,
                     LAZY: tl.constexpr):  # fmt: skip
    # MODE 0: the TOPT >= 2 largest scores of each key block per landmark (ties: distinct keys) -> CMAX [TOPT, rows,
    # NBLK] (plane t: the (t+1)-th largest), and where in its block the largest is -> ARG [rows, NBLK] (int8; the first
    # such key). ET >= 3 (TOPT >= ET): also where the keys of planes 1 to ET - 2 are -> ARG planes 1 to ET - 2 (the
    # select kernel's emission reads ET planes). Each block top is a plain maximum and the first key equal to it.
    # EVEN: no padding, M % BS == 0 and every chunk a whole number of BG-block steps within N: the key blocks load and
    # the block tops reduce without masks.
    # LVF: the same scores also give the landmark values' split-key partials of this chunk, softmax(s * scale) v as
    # (max, sum, accumulator) in log2 units -> PM, PL [BH, G, M], PACC [BH, G, M, D] (merged by _lv_merge_kernel), so
    # the keys are scored once for both. LAZY: their online softmax is _softmax_lazy's (2: _softmax_fma's); with EVEN
    # and LAZY they reuse the block maxima.
    # BG key blocks per step: their tops gather in [BS, BG] registers and are stored at once (one store per row and
    # plane instead of one per block).
    o_c = tl.arange(0, BG)
    nb1 = (n1 + BN - 1) // BN
    if LVF:
        V_h = _head_ptr(V, i_bh, H, SB, SH)
        l_m = tl.full([BS], float("-inf"), tl.float32)
        l_l = tl.zeros([BS], tl.float32)
        l_acc = tl.zeros([BS, D], tl.float32)
    for g0 in range(n0, n1, BN * BG):
        a_max = tl.full([BS, BG], float("-inf"), tl.float32)
        a_sec = tl.full([BS, BG], float("-inf"), tl.float32)
        a_arg = tl.zeros([BS, BG], tl.int32)
        if ET >= 3:
            a_thr = tl.full([BS, BG], float("-inf"), tl.float32)
            a_arg2 = tl.zeros([BS, BG], tl.int32)
        for j in range(BG):
            n_b = g0 + j * BN
            o_n = n_b + tl.arange(0, BN)
            if EVEN:
                # The same dot of the same operands as _key_block_scores: the same bits.
                b_k = tl.load(K_h + o_n.to(tl.int64)[:, None] * SN + o_d[None, :])
                b_sc = _score(b_r, b_k, PREC, UP, EXACT)
                b_x = b_sc
                b_max = tl.max(b_x, 1)
                if LVF:
                    b_v = tl.load(V_h + o_n.to(tl.int64)[:, None] * SN + o_d[None, :])
                    if LAZY == 2:
                        l_m, l_l, l_acc = _softmax_fma_max(b_sc, b_max, scale_log2, b_v, l_m, l_l, l_acc, PREC, UP)
                    elif LAZY:
                        l_m, l_l, l_acc = _softmax_lazy_max(b_sc, b_max, scale_log2, b_v, l_m, l_l, l_acc, PREC, UP)
                    else:
                        l_m, l_l, l_acc = _softmax_step(b_sc * scale_log2, b_v, l_m, l_l, l_acc, PREC, UP)
            else:
                m_n, b_sc = _key_block_scores(b_r, K_h, KV, i_bh, N, o_n, n1, SN, o_d, HAS_KV, PREC, UP, EXACT)
                if LVF:
                    b_v = tl.load(V_h + o_n.to(tl.int64)[:, None] * SN + o_d[None, :], mask=m_n[:, None], other=0.0)
                    if LAZY == 2:
                        b_ls = tl.where(m_n[None, :], b_sc, float("-inf"))
                        l_m, l_l, l_acc = _softmax_fma(b_ls, scale_log2, b_v, l_m, l_l, l_acc, PREC, UP)
                    elif LAZY:
                        b_ls = tl.where(m_n[None, :], b_sc, float("-inf"))
                        l_m, l_l, l_acc = _softmax_lazy(b_ls, scale_log2, b_v, l_m, l_l, l_acc, PREC, UP)
                    else:
                        b_ls = tl.where(m_n[None, :], b_sc * scale_log2, float("-inf"))
                        l_m, l_l, l_acc = _softmax_step(b_ls, b_v, l_m, l_l, l_acc, PREC, UP)
                b_x = tl.where(m_j[:, None] & m_n[None, :], b_sc, float("-inf"))
                b_max = tl.max(b_x, 1)
            # The maximum and the first key holding it; that key dropped, the second largest (ties count as the keys
            # they are).
            o_k = tl.arange(0, BN)
            c_i = _first_max(b_x, b_max, o_k, BN)
            b_x = tl.where(o_k[None, :] == c_i[:, None], float("-inf"), b_x)
            sel = o_c[None, :] == j
            if ET >= 3:
                # The second with its position; that key dropped too, the third.
                b_sec = tl.max(b_x, 1)
                c_2 = _first_max(b_x, b_sec, o_k, BN)
                b_x = tl.where(o_k[None, :] == c_2[:, None], float("-inf"), b_x)
                b_top = tl.max(b_x, 1)
                a_thr = tl.where(sel, b_top[:, None], a_thr)
                a_arg2 = tl.where(sel, c_2[:, None], a_arg2)
            else:
                b_sec = tl.max(b_x, 1)
                b_top = b_sec
            a_max = tl.where(sel, b_max[:, None], a_max)
            a_sec = tl.where(sel, b_sec[:, None], a_sec)
            a_arg = tl.where(sel, c_i[:, None], a_arg)
            for t in tl.static_range(2 + (ET >= 3), TOPT):
                # Further planes (block_top > 2): stored per block; with ET > 3 also where the keys of planes up to
                # ET - 2 sit (c_n: plane t - 1's).
                c_n = tl.min(tl.where(b_x == b_top[:, None], o_n[None, :], N), 1)
                if t <= ET - 1:
                    tl.store(
                        ARG + (t - 1) * PS + row * NBLK + n_b // BN, (c_n - n_b).to(tl.int8), mask=m_j & (n_b < n1)
                    )
                b_x = tl.where(o_n[None, :] == c_n[:, None], float("-inf"), b_x)
                b_top = tl.max(b_x, 1)
                tl.store(CMAX + t * PS + row * NBLK + n_b // BN, b_top, mask=m_j & (n_b < n1))
        o_e = g0 // BN + o_c
        e_at = row[:, None] * NBLK + o_e[None, :]
        m_e = m_j[:, None] & (o_e < nb1)[None, :]
        tl.store(CMAX + e_at, a_max, mask=m_e)
        tl.store(CMAX + PS + e_at, a_sec, mask=m_e)
        tl.store(ARG + e_at, a_arg.to(tl.int8), mask=m_e)
        if ET >= 3:
            tl.store(CMAX + 2 * PS + e_at, a_thr, mask=m_e)
            tl.store(ARG + PS + e_at, a_arg2.to(tl.int8), mask=m_e)
    if LVF:
        o_w = (i_bh * G + i_g) * M + o_j
        tl.store(PM + o_w, l_m, mask=m_j)
        tl.store(PL + o_w, l_l, mask=m_j)
        tl.store(PACC + o_w[:, None] * D + o_d[None, :], l_acc, mask=m_j[:, None])


@triton.jit
def _block_at_lo(b_r, K_h, KV, i_bh, N, n_b, n1, SN, o_d, need, b_lo, HAS_KV: tl.constexpr, BN: tl.constexpr,
                 PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr):  # fmt: skip
    # The key block at n_b scored again: (key offsets [BN], order keys [BS, BN], which keys are >= lo in the rows that
    # need them [BS, BN]).
    o_n = n_b + tl.arange(0, BN)
    m_n, b_sc = _key_block_scores(b_r, K_h, KV, i_bh, N, o_n, n1, SN, o_d, HAS_KV, PREC, UP, EXACT)
    b_key = _order_key(b_sc)
    m_lo = need[:, None] & m_n[None, :] & (b_key >= b_lo[:, None])
    return o_n, b_key, m_lo


@triton.jit
def _scan_counts(b_r, K_h, KV, i_bh, N, n0, n1, SN, o_d, need, b_lo, b_t, b_cnt, HAS_KV: tl.constexpr,
                 P: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
                 EXACT: tl.constexpr):  # fmt: skip
    # MODE 1: b_cnt [BS, P] plus this chunk's counts of keys >= each of the P thresholds b_t [BS, P] in [lo, hi).
    for n_b in range(n0, n1, BN):
        o_n, b_key, m_lo = _block_at_lo(
            b_r, K_h, KV, i_bh, N, n_b, n1, SN, o_d, need, b_lo, HAS_KV, BN, PREC, UP, EXACT
        )
        if tl.sum(m_lo.to(tl.int32)) > 0:
            for p in tl.static_range(P):
                sel_p = (tl.arange(0, P) == p)[None, :]
                t_p = tl.sum(tl.where(sel_p, b_t, 0), 1)
                c_p = tl.sum((m_lo & (b_key >= t_p[:, None])).to(tl.int32), 1)
                b_cnt += tl.where(sel_p, c_p[:, None], 0)
    return b_cnt


@triton.jit
def _scan_band(b_r, K_h, KV, CAND, i_bh, row, N, n0, n1, CAP, SN, o_d, need, b_lo, b_hi, c_hi, c_band, w_hi, w_band,
               MODE: tl.constexpr, HAS_KV: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
               EXACT: tl.constexpr):  # fmt: skip
    # MODE 2: c_hi, c_band [BS] plus this chunk's counts of keys >= hi and of keys in [lo, hi). MODE 3: also writes
    # those keys to the row's list from the chunk's offsets w_hi, w_band (_chunk_offsets), both in key order,
    # truncated at CAP.
    for n_b in range(n0, n1, BN):
        o_n, b_key, m_lo = _block_at_lo(
            b_r, K_h, KV, i_bh, N, n_b, n1, SN, o_d, need, b_lo, HAS_KV, BN, PREC, UP, EXACT
        )
        if tl.sum(m_lo.to(tl.int32)) > 0:
            # (order key, reversed index): one int64 whose order is score desc, index asc (MODE 3 writes it).
            packed = (b_key.to(tl.int64) << 32) + (0xFFFFFFFF - o_n.to(tl.int64))[None, :]
            m_hi = m_lo & (b_key >= b_hi[:, None])
            m_band = m_lo & (b_key < b_hi[:, None])
            if MODE == 3:
                p_hi = w_hi + c_hi
                p_band = w_band + c_band
                r_hi = p_hi[:, None] + tl.cumsum(m_hi.to(tl.int32), 1) - 1
                r_band = p_band[:, None] + tl.cumsum(m_band.to(tl.int32), 1) - 1
                pos = tl.where(m_hi, r_hi, r_band)
                tl.store(CAND + row[:, None] * CAP + pos, packed, mask=m_lo & (pos < CAP))
            c_hi += tl.sum(m_hi.to(tl.int32), 1)
            c_band += tl.sum(m_band.to(tl.int32), 1)
    return c_hi, c_band


@triton.jit
def _topk_scan_body(
    i_s, i_g, i_bh, R, K, KV, KK, LO, HI, DONE, CMAX, ARG, CNT, OFF, CAND, V, PM, PL, PACC, scale_log2, N, M, CH, G,
    NBLK, CAP, topk, H, SB, SH, SN, nrows, i_pass, MODE: tl.constexpr, P: tl.constexpr, SKIP: tl.constexpr,
    HAS_KV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
    EXACT: tl.constexpr, TOPT: tl.constexpr, BG: tl.constexpr, ET: tl.constexpr, LVF: tl.constexpr,
    EVEN: tl.constexpr, LAZY: tl.constexpr, CM: tl.constexpr,
):  # fmt: skip
    # One program per (landmark tile, key chunk, batch-head); rows are landmarks (row = bh * M + landmark).
    # MODE 0: the block tops of the chunk's key blocks (and with LVF the landmark values' partials): _scan_block_tops.
    # Rows with more keys at or above the start threshold than CAP (fallback rows, OFF > CAP: the select kernel's
    # counts) then take the refinement path:
    # MODE 1: refinement pass i_pass: counts of keys >= each of P thresholds in [lo, hi) -> CNT[i_pass, row, P]
    #         (_scan_counts).
    # MODE 2: final state (slot i_pass: _NPASS, or the pass after the last one the persistent kernel ran), empty
    #         candidate lists, per key chunk the count of keys >= hi and of keys in [lo, hi) -> CNT tail [rows, G, 2]
    #         (_scan_band).
    # MODE 3: from the final state (slot i_pass), write the candidates (>= hi first, then [lo, hi), both in key
    #         order, truncated at CAP) (_scan_band).
    # SKIP (modes 1-3): landmark tiles without a fallback row do nothing. CM: cache modifier of the loads of what
    # other programs of the same launch wrote (".cg" in the persistent fallback kernel).
    o_d = tl.arange(0, D)
    o_j = i_s * BS + tl.arange(0, BS)
    m_j = o_j < M
    row = i_bh * M + o_j
    active = tl.sum(m_j.to(tl.int32), 0) > 0
    if MODE != 0:
        fb = m_j & (tl.load(OFF + row, mask=m_j, other=0) > CAP)
        if SKIP:
            active = tl.sum(fb.to(tl.int32), 0) > 0
    if active:
        n0 = i_g * CH
        n1 = tl.minimum(n0 + CH, N)
        if MODE != 0:
            kk = _head_kk(KK, i_bh, topk, HAS_KV)
            if MODE == 1:
                b_lo64, b_hi64, done = _topk_state(
                    LO, HI, DONE, CNT, row, m_j, fb, kk, i_pass, nrows, CAP, i_g == 0, P, CM
                )
                need = fb & ~done
            elif MODE == 2:
                b_lo64, b_hi64, done = _topk_state(
                    LO, HI, DONE, CNT, row, m_j, fb, kk, i_pass, nrows, CAP, i_g == 0, P, CM
                )
                need = fb
                if i_g == 0:
                    _clear_lists(CAND, row, fb, CAP, BS, BN)
            else:
                b_lo64 = tl.load(LO + i_pass * nrows + row, mask=m_j, other=0, cache_modifier=CM)
                b_hi64 = tl.load(HI + i_pass * nrows + row, mask=m_j, other=0, cache_modifier=CM)
                need = fb
            # Compares in int32 (keys are int32; hi = 2^31 only above a NaN key, which scores never are).
            b_lo = b_lo64.to(tl.int32)
            b_hi = tl.minimum(b_hi64, 2147483647).to(tl.int32)
            active = tl.sum(need.to(tl.int32), 0) > 0
        if MODE == 1:
            o_p = tl.arange(0, P)
            # [BS, P] thresholds lo + (hi - lo) * p / P (p = 0 gives lo itself), all below hi: int32.
            b_t = (b_lo64[:, None] + ((b_hi64 - b_lo64)[:, None] * o_p[None, :]) // P).to(tl.int32)
            b_cnt = tl.zeros([BS, P], tl.int32)
        if MODE == 2 or MODE == 3:
            c_hi = tl.zeros([BS], tl.int32)
            c_band = tl.zeros([BS], tl.int32)
            w_hi, w_band = _chunk_offsets(CNT, row, need, i_g, G, nrows, MODE, P, BS, BN, CM)
        if active:
            b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
            K_h = _head_ptr(K, i_bh, H, SB, SH)
            PS = (i_bh * 0 + nrows) * NBLK  # plane stride of CMAX (int64: rows x blocks may pass 2^31)
            if MODE == 0:
                _scan_block_tops(
                    b_r, K_h, V, KV, CMAX, ARG, PM, PL, PACC, scale_log2, i_bh, i_g, o_j, m_j, row, o_d, n0, n1, N, M,
                    G, NBLK, PS, H, SB, SH, SN, HAS_KV, D, BS, BN, PREC, UP, EXACT, TOPT, BG, ET, LVF, EVEN, LAZY,
                )  # fmt: skip
            if MODE == 1:
                b_cnt = _scan_counts(
                    b_r, K_h, KV, i_bh, N, n0, n1, SN, o_d, need, b_lo, b_t, b_cnt, HAS_KV, P, BN, PREC, UP, EXACT
                )
                o_p2 = tl.arange(0, P)
                tl.atomic_add(
                    CNT + (i_pass * nrows + row)[:, None] * P + o_p2[None, :],
                    b_cnt,
                    mask=need[:, None],
                    sem="relaxed",
                )
            if MODE == 2 or MODE == 3:
                c_hi, c_band = _scan_band(
                    b_r, K_h, KV, CAND, i_bh, row, N, n0, n1, CAP, SN, o_d, need, b_lo, b_hi, c_hi, c_band, w_hi,
                    w_band, MODE, HAS_KV, BN, PREC, UP, EXACT,
                )  # fmt: skip
            if MODE == 2:
                CC2 = CNT + _NPASS * nrows * P
                tl.store(CC2 + (row * G + i_g) * 2, c_hi, mask=need)
                tl.store(CC2 + (row * G + i_g) * 2 + 1, c_band, mask=need)


@triton.jit
def _topk_scan_kernel(
    R, K, KV, KK, LO, HI, DONE, CMAX, ARG, CNT, OFF, CAND, V, PM, PL, PACC, scale_log2, N, M, CH, G, NBLK, CAP, topk,
    H, SB, SH, SN, nrows, i_pass, MODE: tl.constexpr, P: tl.constexpr, SKIP: tl.constexpr, HAS_KV: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr,
    TOPT: tl.constexpr, BG: tl.constexpr, ET: tl.constexpr, LVF: tl.constexpr, EVEN: tl.constexpr, LAZY: tl.constexpr,
):  # fmt: skip
    # One program per (landmark tile, key chunk, batch-head): _topk_scan_body.
    _topk_scan_body(
        tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64), R, K, KV, KK, LO, HI, DONE, CMAX, ARG, CNT,
        OFF, CAND, V, PM, PL, PACC, scale_log2, N, M, CH, G, NBLK, CAP, topk, H, SB, SH, SN, nrows, i_pass, MODE, P,
        SKIP, HAS_KV, D, BS, BN, PREC, UP, EXACT, TOPT, BG, ET, LVF, EVEN, LAZY, "",
    )  # fmt: skip
