"""Exact top-k kernels that select per row: the select kernel (start + emit + select) and the persistent fallback
with grid barriers.

- ``_topk_select_kernel``: per row, a start threshold that at least k keys reach, by bisection over the block tops
  (``_start_row``, ``_kth_largest_key`` / ``_kth_largest_key_narrow``), the emission of the row's candidates in
  block order (``_emit_row``, re-scoring the blocks that need it) and, when they fit the list, the final selection
  (``_final_row``: the k largest packed keys, indices ascending); it may also merge the landmark values' partials
  (``landmark_values._lv_merge_row``).
- ``_topk_fallback_kernel``: the rows whose candidates overflow their list, in one launch of persistent programs
  (``_grid_barrier`` between the passes of ``topk_scan._topk_scan_body``), then their final selection
  (``_final_row``).

The host side (``exact_topk``) is ``topk.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mita.ops.mita.triton.common import _head_ptr
from mita.ops.mita.triton.landmark_values import _lv_merge_row
from mita.ops.mita.triton.topk_scan import (
    _EMPTY,
    _KEY_NEG_INF,
    _NPASS,
    _head_kk,
    _key_block_scores,
    _key_threshold,
    _order_key,
    _pack_key,
    _topk_scan_body,
)


@triton.jit
def _kth_largest_key(key, valid, kk, LO: tl.constexpr, HI: tl.constexpr, STEPS: tl.constexpr):
    # The largest t in [LO, HI) (a range of 2^32 values: int32 order keys, or 32-bit words) with count(valid &
    # key >= t) >= kk, i.e. the kk-th largest key of the 1-D entries valid, by bisection (STEPS = 32 steps); LO when
    # fewer than kk entries are valid, HI - 1 when kk <= 0 (int64). With STEPS < 32 the bisection stops early: t is
    # then that key rounded down to a multiple of 2^(32 - STEPS) above LO (HI - 2^(32 - STEPS) when kk <= 0), still
    # with count(key >= t) >= kk: a lower bound, as the long-row top-k's start threshold may be. (A radix select by
    # four 8-bit tl.histogram rounds was slower on the H200.)
    # With int32 keys (LO = -2^31) every midpoint fits int32 (mid < hi <= 2^31), so the entries are compared as
    # int32: no int64 copy of the keys (registers, hence programs per SM).
    t = tl.full([], LO, tl.int64)
    hi = tl.full([], HI, tl.int64)
    for _ in range(STEPS):
        mid = t + (hi - t) // 2
        if LO == -2147483648:
            ok = tl.sum((valid & (key >= mid.to(tl.int32))).to(tl.int32), 0) >= kk
        else:
            ok = tl.sum((valid & (key >= mid)).to(tl.int32), 0) >= kk
        t = tl.where(ok, mid, t)
        hi = tl.where(ok, hi, mid)
    return t


@triton.jit
def _kth_largest_key_narrow(key, valid, kk, k_max, UNIT: tl.constexpr):
    # _kth_largest_key over int32 order keys with the bisection's range taken from the entries: [min, max + 1) of the
    # valid keys (k_max: the largest valid key, any value when none is valid) when kk >= 1 of them are valid
    # (count(key >= min) >= kk > count(key >= max + 1) = 0 bound it as the full range's invariant does), else the
    # full [-2^31, 2^31) (the same results as there: -2^31, or 2^31 - 1 for kk <= 0). Halves it until at most UNIT
    # wide: UNIT = 1 gives the kk-th largest key itself; UNIT > 1 a key at most UNIT - 1 below it that still has
    # count(key >= t) >= kk (a lower bound). Scores of one row span a few binary exponents (a range of ~2^25 keys),
    # so this takes ~25 steps for the exact key instead of 32, and ~13 instead of 20 for a start threshold within
    # 2^12 keys.
    n_valid = tl.sum(valid.to(tl.int32), 0)
    k_min = tl.min(tl.where(valid, key, 2147483647), 0)
    narrow = (kk >= 1) & (n_valid >= kk)
    t = tl.where(narrow, k_min.to(tl.int64), -2147483648)
    hi = tl.where(narrow, k_max.to(tl.int64) + 1, 2147483648)
    while hi - t > UNIT:
        mid = t + (hi - t) // 2
        ok = tl.sum((valid & (key >= mid.to(tl.int32))).to(tl.int32), 0) >= kk
        t = tl.where(ok, mid, t)
        hi = tl.where(ok, hi, mid)
    return t


@triton.jit
def _start_row(
    CMAX, KK, LO, HI, CNT, row, M, NB, NBLK, topk, nrows, HAS_KV: tl.constexpr, F: tl.constexpr, GP: tl.constexpr,
    P: tl.constexpr, ONE_PLANE: tl.constexpr, STEPS: tl.constexpr, NARROW: tl.constexpr,
):  # fmt: skip
    # Row row's start threshold lo = the largest order key t that kk maxima of groups of F entries reach (so kk
    # distinct keys reach it; rounded down when STEPS < 32, see _kth_largest_key), hi = just above the row maximum,
    # stored as state slot 0 of the refinement (LO, HI); its refinement counts start at zero. Entries: the NB = t *
    # NBLK first of the block-top planes (t = 1: the block maxima; t = 2: also each block's second largest score),
    # entry e in plane e // NBLK. Returns lo (int64).
    kk = _head_kk(KK, row // M, topk, HAS_KV)
    o_b = tl.arange(0, GP)[:, None] * F + tl.arange(0, F)[None, :]
    if ONE_PLANE:
        # The block maxima only: one contiguous row (vector loads, no per-entry plane arithmetic).
        e_ptr = CMAX + row * NBLK + o_b
    else:
        e_ptr = CMAX + (o_b // NBLK).to(tl.int64) * nrows * NBLK + row * NBLK + o_b % NBLK
    g = tl.max(tl.load(e_ptr, mask=o_b < NB, other=float("-inf")), 1)
    m_g = g > float("-inf")
    g_key = _order_key(g)
    r_max = tl.max(tl.where(m_g, g_key, _KEY_NEG_INF), 0)
    if NARROW:
        lo = _kth_largest_key_narrow(g_key, m_g, kk, r_max, 1 << (32 - STEPS))
    else:
        lo = _kth_largest_key(g_key, m_g, kk, -2147483648, 2147483648, STEPS)
    tl.store(LO + row, lo)
    tl.store(HI + row, r_max.to(tl.int64) + 1)
    o_c = tl.arange(0, _NPASS * P)
    tl.store(CNT + ((o_c // P) * nrows + row) * P + o_c % P, tl.zeros([_NPASS * P], tl.int32))
    return lo


@triton.jit
def _grid_barrier(BAR, target, SPIN: tl.constexpr):
    # Every program of the launch waits here until BAR (zeroed before the launch, raised by one per program and
    # barrier) reaches target = (barriers so far) x programs. The writes before it are released at GPU scope, the
    # reads after it acquire them. Only for launches whose programs are all resident at once.
    # SPIN 0: one thread polls with acquire loads; 1: every thread polls with volatile loads, then one acquire.
    tl.debug_barrier()
    tl.atomic_add(BAR, 1, sem="release", scope="gpu")
    if SPIN == 0:
        seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
    else:
        seen = tl.load(BAR, volatile=True)
        while seen < target:
            seen = tl.load(BAR, volatile=True)
        tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _fallback_items(
    pid, NPROG, n_s, BH, R, K, KV, KK, LO, HI, DONE, CNT, OFF, CAND, N, M, CH, G, NBLK, CAP, topk, H, SB, SH, SN, nrows,
    i_pass, MODE: tl.constexpr, P: tl.constexpr, HAS_KV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    # One fallback pass (_topk_scan_body's MODE 1, 2 or 3) over program pid's share of the (landmark tile, key chunk,
    # batch-head) items, items pid, pid + NPROG, ...; the state other programs wrote is read from L2 (".cg").
    for it in range(pid, n_s * G * BH, NPROG):
        _topk_scan_body(
            (it // G) % n_s, it % G, (it // (G * n_s)).to(tl.int64), R, K, KV, KK, LO, HI, DONE, R, R, CNT, OFF, CAND,
            R, R, R, R, 1.0, N, M, CH, G, NBLK, CAP, topk, H, SB, SH, SN, nrows, i_pass, MODE, P, True, HAS_KV, D, BS,
            BN, PREC, UP, EXACT, 1, 1, 0, False, False, False, ".cg",
        )  # fmt: skip


@triton.jit
def _topk_fallback_kernel(
    R, K, KV, KK, LO, HI, DONE, CNT, OFF, CAND, IDX, N, M, CH, G, NBLK, CAP, topk, H, SB, SH, SN, nrows, n_s, BH,
    NPROG, P: tl.constexpr, HAS_KV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr, RB: tl.constexpr, SPIN: tl.constexpr,
    CP: tl.constexpr, FNARROW: tl.constexpr,
):  # fmt: skip
    # The long-row top-k's fallback (refinement passes, recount, ordered emit: _topk_scan_body's modes 1-3) in one
    # launch of NPROG persistent programs (no more than the SMs hold at once, so all are resident; 1 under the
    # interpreter, which runs programs one after another). Each program first checks every row's count (OFF, final
    # since the select kernel): when no row has more than CAP, all return at once, which is the common case.
    # Otherwise the programs take the (landmark tile, key chunk, batch-head) items of each pass in turn, with a grid
    # barrier between passes (the counter is OFF[nrows], zeroed by the select kernel); every program passes every
    # barrier.
    # The refinement stops after the first pass whose state has every fallback row done (the recount and the
    # ordered emit then read the slot after it), so a row that settles in a few passes costs a few barriers.
    # After one more barrier the programs also select the fallback rows' top-k (_final_row; CP, FNARROW as the
    # select kernel's).
    pid = tl.program_id(0)
    n_fb = 0
    for r0 in range(0, nrows, RB):
        o_r = r0 + tl.arange(0, RB)
        n_fb += tl.sum((tl.load(OFF + o_r, mask=o_r < nrows, other=0) > CAP).to(tl.int32), 0)
    if n_fb > 0:
        BAR = OFF + nrows
        n_bar = 0
        # Refinement passes until every fallback row is done (its state slot after a pass says so; every program
        # reads the same slots after the barrier, so all leave the loop together), at most _NPASS.
        i_pass = 0
        fin = 0
        while i_pass < _NPASS:
            _fallback_items(
                pid, NPROG, n_s, BH, R, K, KV, KK, LO, HI, DONE, CNT, OFF, CAND, N, M, CH, G, NBLK, CAP, topk, H, SB,
                SH, SN, nrows, i_pass, 1, P, HAS_KV, D, BS, BN, PREC, UP, EXACT,
            )  # fmt: skip
            n_bar += NPROG
            _grid_barrier(BAR, n_bar, SPIN)
            n_open = 0
            for r0 in range(0, nrows, RB):
                o_r = r0 + tl.arange(0, RB)
                m_r = o_r < nrows
                fb_r = m_r & (tl.load(OFF + o_r, mask=m_r, other=0) > CAP)
                d_r = tl.load(DONE + i_pass * nrows + o_r, mask=fb_r, other=1, cache_modifier=".cg")
                n_open += tl.sum((fb_r & (d_r == 0)).to(tl.int32), 0)
            i_pass += 1
            fin = i_pass
            if n_open == 0:
                i_pass = _NPASS
        _fallback_items(
            pid, NPROG, n_s, BH, R, K, KV, KK, LO, HI, DONE, CNT, OFF, CAND, N, M, CH, G, NBLK, CAP, topk, H, SB, SH,
            SN, nrows, fin, 2, P, HAS_KV, D, BS, BN, PREC, UP, EXACT,
        )  # fmt: skip
        _grid_barrier(BAR, n_bar + NPROG, SPIN)
        _fallback_items(
            pid, NPROG, n_s, BH, R, K, KV, KK, LO, HI, DONE, CNT, OFF, CAND, N, M, CH, G, NBLK, CAP, topk, H, SB, SH,
            SN, nrows, fin, 3, P, HAS_KV, D, BS, BN, PREC, UP, EXACT,
        )  # fmt: skip
        # The fallback rows' top-k (the select kernel did the others'), rows in turn, once every list is written;
        # other programs wrote them: loaded from L2.
        _grid_barrier(BAR, n_bar + 2 * NPROG, SPIN)
        for r_i in range(pid, nrows, NPROG):
            row = r_i + tl.zeros([], tl.int64)
            if tl.load(OFF + row) > CAP:
                _final_row(CAND, IDX, row, CAP, topk, CAP, CP, FNARROW, ".cg")


@triton.jit
def _final_row(
    CAND, IDX, row, LIM, TOPK, CAP, CP: tl.constexpr, NARROW: tl.constexpr, CM: tl.constexpr,
):  # fmt: skip
    # Row row's TOPK largest packed entries among the first min(LIM, CAP) of its candidate list (score desc, index
    # asc; fewer when the list holds fewer valid keys; the entries past them read as empty), their key indices
    # ascending, then -1. The selection (NARROW 0 / 1): the threshold key t (_kth_largest_key, over the whole range
    # or the list's own), then, unless every entry at t is taken, the lowest indices among them (the same helper on
    # the low word); NARROW 2: the TOPK-th largest packed entry from one descending sort. The order: one sort of
    # the list. CM: the list's cache modifier (".cg" where other programs
    # of the same launch wrote it).
    o_c = tl.arange(0, CP)
    c = tl.load(CAND + row * CAP + o_c, mask=o_c < tl.minimum(LIM, CAP), other=_EMPTY, cache_modifier=CM)
    valid = c != _EMPTY
    n_sel = tl.minimum(tl.sum(valid.to(tl.int32), 0), TOPK)
    c_low = c & 0xFFFFFFFF
    if NARROW == 2:
        # The n_sel-th largest packed entry by one sort of the list (entries are distinct: each holds its key's
        # index), so exactly the n_sel entries at or above it are chosen.
        srt = tl.sort(c, 0, descending=True)
        th = tl.max(tl.where(o_c == n_sel - 1, srt, _EMPTY), 0)
        sel = valid & (c >= th) & (n_sel > 0)
    else:
        c_key = c >> 32
        if NARROW:
            c_k32 = c_key.to(tl.int32)
            lo = _kth_largest_key_narrow(c_k32, valid, n_sel, tl.max(tl.where(valid, c_k32, -2147483648), 0), 1)
        else:
            lo = _kth_largest_key(c_key.to(tl.int32), valid, n_sel, -2147483648, 2147483648, 32)
        m_gt = valid & (c_key > lo)
        m_tie = valid & (c_key == lo)
        n_tie = n_sel - tl.sum(m_gt.to(tl.int32), 0)
        # lo2: the n_tie-th largest low word among the ties (0, i.e. all of them, when every tie is taken).
        lo2 = tl.full([], 0, tl.int64)
        if n_tie < tl.sum(m_tie.to(tl.int32), 0):
            lo2 = _kth_largest_key(c_low, m_tie, n_tie, 0, 4294967296, 32)
        sel = m_gt | (m_tie & (c_low >= lo2))
    base = IDX + row * TOPK
    # The chosen indices ascending by one sort of the list (the others as INT32_MAX, after them), then -1.
    srt = tl.sort(tl.where(sel, (0xFFFFFFFF - c_low).to(tl.int32), 2147483647), 0)
    tl.store(base + o_c, tl.where(o_c < n_sel, srt, -1), mask=o_c < TOPK)


@triton.jit
def _emit_row(
    R, K, KV, CMAX, ARG, CAND, row, lo, N, M, NBLK, CAP, H, SB, SH, SN, nrows, HAS_KV: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr, ET: tl.constexpr,
    EB: tl.constexpr,
):  # fmt: skip
    # The count + emit step of one row: every key with order key >= lo goes to the row's candidate list in block
    # order (positions from prefix sums; those past CAP are dropped) and the count is returned. The emission reads ET
    # block tops per block (planes 0 to ET - 1 of CMAX, where the keys of planes 0 to ET - 2 sit in ARG): a block
    # whose j-th largest score (j < ET) is below the threshold holds j - 1 such keys at most, written from the block
    # tops. Only the blocks whose ET-th largest reaches it are scored again, one after another, with the same dot of
    # the same landmark tile as the block-top pass (so the same scores to the bit: this kernel runs with the passes'
    # warps), the row's scores taken out of the tile's. EB blocks per step; ET 2 or 3 one vector per plane, ET > 3
    # (a power of 2) an [EB, ET] tile.
    i_bh = row // M
    i_j = row % M
    t_f = _key_threshold(lo)
    PS = (i_bh * 0 + nrows) * NBLK
    o_e = tl.arange(0, EB)
    o_d = tl.arange(0, D)
    o_j = (i_j // BS) * BS + tl.arange(0, BS)
    K_h = _head_ptr(K, i_bh, H, SB, SH)
    n = tl.zeros([], tl.int32)
    for b0 in range(0, NBLK, EB):
        o_b = b0 + o_e
        m_b = o_b < NBLK
        e_at = row * NBLK + o_b
        if ET > 3:
            o_t = tl.arange(0, ET)
            t_at = o_t[None, :] * PS + e_at[:, None]
            e_top = tl.load(CMAX + t_at, mask=m_b[:, None], other=float("-inf"))
            # Planes descend, so the tops at or above the threshold are the first c of the block's, and the last
            # reaches it when all ET do.
            c = tl.sum((e_top >= t_f).to(tl.int32), 1)
            more = m_b & (c == ET)
            w = tl.where(more | ~m_b, 0, c)
            pos = n + tl.cumsum(w, 0) - w
            e_arg = tl.load(ARG + t_at, mask=m_b[:, None] & (o_t[None, :] < ET - 1), other=0).to(tl.int32)
            p_t = pos[:, None] + o_t[None, :]
            packed = _pack_key(e_top, o_b[:, None] * BN + e_arg)
            tl.store(CAND + row * CAP + p_t, packed, mask=(o_t[None, :] < w[:, None]) & (p_t < CAP))
        else:
            e_max = tl.load(CMAX + e_at, mask=m_b, other=float("-inf"))
            e_sec = tl.load(CMAX + PS + e_at, mask=m_b, other=float("-inf"))
            one = m_b & (e_max >= t_f) & (e_sec < t_f)
            if ET == 3:
                e_thr = tl.load(CMAX + 2 * PS + e_at, mask=m_b, other=float("-inf"))
                two = m_b & (e_sec >= t_f) & (e_thr < t_f)
                more = m_b & (e_thr >= t_f)
                w = tl.where(one, 1, tl.where(two, 2, 0))
            else:
                more = m_b & (e_sec >= t_f)
                w = one.to(tl.int32)
            pos = n + tl.cumsum(w, 0) - w
            e_n = o_b * BN + tl.load(ARG + e_at, mask=m_b, other=0).to(tl.int32)
            packed = _pack_key(e_max, e_n)
            tl.store(CAND + row * CAP + pos, packed, mask=(w > 0) & (pos < CAP))
            if ET == 3:
                e_n2 = o_b * BN + tl.load(ARG + PS + e_at, mask=m_b, other=0).to(tl.int32)
                packed2 = _pack_key(e_sec, e_n2)
                tl.store(CAND + row * CAP + pos + 1, packed2, mask=two & (pos + 1 < CAP))
        n += tl.sum(w, 0)
        n_more = tl.sum(more.to(tl.int32), 0)
        while n_more > 0:
            blk = tl.min(tl.where(more, o_b, 2147483647), 0)
            more = more & (o_b != blk)
            n_more -= 1
            o_n = blk * BN + tl.arange(0, BN)
            b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=(o_j < M)[:, None], other=0.0)
            m_n, b_sc = _key_block_scores(b_r, K_h, KV, i_bh, N, o_n, N, SN, o_d, HAS_KV, PREC, UP, EXACT)
            s_row = tl.max(tl.where((o_j == i_j)[:, None], b_sc, float("-inf")), 0)
            w_c = (m_n & (s_row >= t_f)).to(tl.int32)
            p_c = n + tl.cumsum(w_c, 0) - w_c
            r_packed = _pack_key(s_row, o_n)
            tl.store(CAND + row * CAP + p_c, r_packed, mask=(w_c > 0) & (p_c < CAP))
            n += tl.sum(w_c, 0)
    return n


@triton.jit
def _topk_select_kernel(
    R, K, KV, CMAX, ARG, KK, LO, HI, OFF, CNT, CAND, IDX, PM, PL, PACC, VT, LSE, N, M, NB, NBLK, CAP, topk, H, SB, SH,
    SN, nrows, NC, HAS_KV: tl.constexpr, F: tl.constexpr, GP: tl.constexpr, P: tl.constexpr,
    ONE_PLANE: tl.constexpr, STEPS: tl.constexpr, NARROW: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr, ET: tl.constexpr, EB: tl.constexpr,
    CP: tl.constexpr, FNARROW: tl.constexpr,
    MERGE: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    # One row per program: the start threshold and state slot 0 (_start_row), the row's keys at or above it into its
    # candidate list (_emit_row), and when they fit the list (count <= CAP) its top-k (_final_row); OFF[row] = the
    # count, so rows with more than CAP take the fallback (_topk_fallback_kernel, which also selects their top-k).
    # MERGE: the row's landmark values from their split-key partials too.
    row = tl.program_id(0).to(tl.int64)
    if MERGE:
        _lv_merge_row(PM, PL, PACC, VT, LSE, row % M, row // M, M, NC, D, BC)
    lo = _start_row(CMAX, KK, LO, HI, CNT, row, M, NB, NBLK, topk, nrows, HAS_KV, F, GP, P, ONE_PLANE, STEPS, NARROW)
    if row == 0:
        # The persistent fallback kernel's barrier counter.
        tl.store(OFF + nrows, 0)
    n = _emit_row(
        R, K, KV, CMAX, ARG, CAND, row, lo, N, M, NBLK, CAP, H, SB, SH, SN, nrows, HAS_KV, D, BS, BN, PREC, UP, EXACT,
        ET, EB,
    )  # fmt: skip
    tl.store(OFF + row, n)
    if n <= CAP:
        # The list's entries were written by this program's threads: make them visible to all of them.
        tl.debug_barrier()
        _final_row(CAND, IDX, row, n, topk, CAP, CP, FNARROW, "")
