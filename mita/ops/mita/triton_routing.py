"""Triton kernels for MiTA's routing and landmark values: exact top-k, argmax routing, split-key landmark values.

- ``exact_topk``: per landmark, the k keys with the largest raw score ``R_i . k_j`` (ties to the lower key
  index), computed tile by tile without writing the [m, N] scores. Each score is mapped to an order-preserving
  int32 key. Short rows (N <= ``SMALL_N``) keep a [landmarks, N] tile on chip and find the k-th largest key by
  bisection over the 2^32 key range (32 counting steps in registers). Long rows take a few passes over the keys:
  block maxima give a threshold that at least k keys reach; 16-way refinement passes raise it until at most
  ``cap`` keys reach it (or until it is the k-th largest key itself); a counting pass and an emitting pass then
  write the keys above it, in key order, into a [m, cap] candidate list, and a top-k of that small list (score
  packed with the reversed index into one int64) gives the exact answer. Rows that converge early skip the
  remaining passes on the device, so there is no host synchronisation and the result is exact for any input.
- ``route_topk``: per query, the S landmarks with the largest ``q_n . R_i`` (first maximum on ties), in order.
- ``landmark_values``: ``softmax(R k^T s) v`` as a split-key (flash-decoding style) attention of m queries over
  N keys: each program takes a key chunk for a tile of landmarks and writes a partial (max, sum, accumulator);
  a merge kernel combines them. Its backward: one kernel for dk, dv (each key block loops over the landmarks),
  one for dR partials over key chunks, summed in a fixed order (deterministic).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Rows up to this length take the on-chip top-k (if the [N, d] key tile stays within _SMALL_BYTES).
SMALL_N = 512
_SMALL_BYTES = 1 << 16
# Threshold candidates per refinement pass of the long-row top-k, and the number of passes (16^8 = 2^32).
_P = 16
_PASSES = 8


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and _interpreting()


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UP: tl.constexpr):
    # UP: the CPU interpreter multiplies bf16 tiles as their raw uint16 bits, so upcast there first.
    if UP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _score(a, b, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr):
    # a [X, D] . b [Y, D] -> [X, Y] float32. EXACT (CPU interpreter): an elementwise product and sum, so equal
    # columns give bitwise-equal scores (a BLAS matmul need not); exact ties decide the top-k.
    if EXACT:
        return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], 2)
    else:
        return _dot(a, tl.trans(b), PREC, UP)


@triton.jit
def _order_key(s):
    # fp32 -> int32 with the same order (-0.0 folded onto +0.0 first, as a stable sort sees them as equal).
    s = tl.where(s == 0.0, 0.0, s)
    b = s.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


# ----------------------------------------------------------------------------------------------------------------
# exact top-k: short rows, on chip
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
    KSEL,
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
    m_n = o_n < N
    if HAS_KV:
        m_n = m_n & (tl.load(KV + i_bh * N + o_n, mask=m_n, other=0) != 0)
    b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
    b_k = tl.load(K + i_bh * N * D + o_n[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)
    # [BS, NP] order keys of the raw scores; invalid keys take no part.
    b_key = _order_key(_score(b_r, b_k, PREC, UP, EXACT))
    m_v = m_n[None, :] & m_j[:, None]
    if HAS_KV:
        kk = tl.load(KK + i_bh)
    else:
        kk = KSEL
    # Largest t with count(key >= t) >= kk, by bisection on [lo, hi): count(>= lo) >= kk > count(>= hi).
    lo = tl.full([BS], -2147483648, tl.int64)
    hi = tl.full([BS], 2147483648, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        c = tl.sum((m_v & (b_key >= mid[:, None])).to(tl.int32), 1)
        ok = c >= kk
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    m_gt = m_v & (b_key > lo[:, None])
    m_eq = m_v & (b_key == lo[:, None])
    n_gt = tl.sum(m_gt.to(tl.int32), 1)
    tie_rank = tl.cumsum(m_eq.to(tl.int32), 1) - 1
    sel = m_gt | (m_eq & (tie_rank < (kk - n_gt)[:, None]))
    pos = tl.cumsum(sel.to(tl.int32), 1) - 1
    base = IDX + (i_bh * M + o_j) * KSEL
    tl.store(base[:, None] + pos, tl.broadcast_to(o_n[None, :], [BS, NP]), mask=sel)
    o_p = tl.arange(0, KP)
    tl.store(
        base[:, None] + o_p[None, :],
        tl.full([BS, KP], -1, tl.int32),
        mask=m_j[:, None] & (o_p[None, :] >= kk) & (o_p[None, :] < KSEL),
    )


# ----------------------------------------------------------------------------------------------------------------
# exact top-k: long rows, threshold passes
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _topk_scan_kernel(
    R,
    K,
    KV,
    LO,
    HI,
    DONE,
    CMAX,
    CNT,
    OFF,
    CAND,
    N,
    M,
    CH,
    G,
    NB,
    CAP,
    MODE: tl.constexpr,
    P: tl.constexpr,
    SKIP: tl.constexpr,
    HAS_KV: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
    EXACT: tl.constexpr,
):
    # MODE 0: maximum of each key block per landmark -> CMAX [BH, M, NB].
    # MODE 1: counts of keys >= each of P thresholds between LO and HI (rows not DONE) -> CNT [BH, M, P] (int adds).
    # MODE 2: per key chunk, count of keys >= HI and of keys in [LO, HI) -> CNT [BH, M, G, 2].
    # MODE 3: write the packed keys of the candidates (>= HI first, then [LO, HI), both in key order) at OFF.
    i_s = tl.program_id(0)
    i_g = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    o_d = tl.arange(0, D)
    o_j = i_s * BS + tl.arange(0, BS)
    m_j = o_j < M
    row = i_bh * M + o_j
    active = tl.sum(m_j.to(tl.int32), 0) > 0
    if MODE == 1 or SKIP:
        # Only landmark tiles with a row still to refine (MODE 1) or to recount (MODE 2 after refinement).
        b_done = tl.load(DONE + row, mask=m_j, other=1)
        active = tl.sum((b_done == 0).to(tl.int32), 0) > 0
    if active:
        b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
        n0 = i_g * CH
        n1 = tl.minimum(n0 + CH, N)
        if MODE != 0:
            b_lo64 = tl.load(LO + row, mask=m_j, other=0)
            b_hi64 = tl.load(HI + row, mask=m_j, other=0)
            # Compares in int32 (keys are int32; hi = 2^31 only above a NaN key, which scores never are).
            b_lo = b_lo64.to(tl.int32)
            b_hi = tl.minimum(b_hi64, 2147483647).to(tl.int32)
        if MODE == 1:
            o_p = tl.arange(0, P)
            # [BS, P] thresholds lo + (hi - lo) * p / P (p = 0 gives lo itself), all below hi: int32.
            b_t = (b_lo64[:, None] + ((b_hi64 - b_lo64)[:, None] * o_p[None, :]) // P).to(tl.int32)
            b_cnt = tl.zeros([BS, P], tl.int32)
        if MODE >= 2:
            c_hi = tl.zeros([BS], tl.int32)
            c_band = tl.zeros([BS], tl.int32)
        if MODE == 3:
            w_hi = tl.load(OFF + (row * G + i_g) * 2, mask=m_j, other=0)
            w_band = tl.load(OFF + (row * G + i_g) * 2 + 1, mask=m_j, other=0)
        for n_b in range(n0, n1, BN):
            o_n = n_b + tl.arange(0, BN)
            m_n = o_n < n1
            if HAS_KV:
                m_n = m_n & (tl.load(KV + i_bh * N + o_n, mask=m_n, other=0) != 0)
            b_k = tl.load(K + i_bh * N * D + o_n.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)
            b_sc = _score(b_r, b_k, PREC, UP, EXACT)
            m_v = m_j[:, None] & m_n[None, :]
            if MODE == 0:
                b_max = tl.max(tl.where(m_v, b_sc, float("-inf")), 1)
                tl.store(CMAX + row * NB + n_b // BN, b_max, mask=m_j)
            else:
                b_key = _order_key(b_sc)
                m_lo = m_v & (b_key >= b_lo[:, None])
                if tl.sum(m_lo.to(tl.int32)) > 0:
                    if MODE == 1:
                        for p in tl.static_range(P):
                            sel_p = (tl.arange(0, P) == p)[None, :]
                            t_p = tl.sum(tl.where(sel_p, b_t, 0), 1)
                            c_p = tl.sum((m_lo & (b_key >= t_p[:, None])).to(tl.int32), 1)
                            b_cnt += tl.where(sel_p, c_p[:, None], 0)
                    else:
                        m_hi = m_lo & (b_key >= b_hi[:, None])
                        m_band = m_lo & (b_key < b_hi[:, None])
                        if MODE == 3:
                            p_hi = w_hi + c_hi
                            p_band = w_band + c_band
                            r_hi = p_hi[:, None] + tl.cumsum(m_hi.to(tl.int32), 1) - 1
                            r_band = p_band[:, None] + tl.cumsum(m_band.to(tl.int32), 1) - 1
                            pos = tl.where(m_hi, r_hi, r_band)
                            m_w = (m_hi | m_band) & (pos < CAP)
                            # (order key, reversed index): one int64 whose order is score desc, index asc.
                            packed = (b_key.to(tl.int64) << 32) + (0xFFFFFFFF - o_n.to(tl.int64))[None, :]
                            tl.store(CAND + row[:, None] * CAP + pos, packed, mask=m_w)
                        c_hi += tl.sum(m_hi.to(tl.int32), 1)
                        c_band += tl.sum(m_band.to(tl.int32), 1)
        if MODE == 1:
            o_p2 = tl.arange(0, P)
            tl.atomic_add(CNT + row[:, None] * P + o_p2[None, :], b_cnt, mask=m_j[:, None] & (b_done == 0)[:, None])
        if MODE == 2:
            tl.store(CNT + (row * G + i_g) * 2, c_hi, mask=m_j)
            tl.store(CNT + (row * G + i_g) * 2 + 1, c_band, mask=m_j)


@triton.jit
def _topk_update_kernel(LO, HI, DONE, CNT, KK, ROWS, M, CAP, P: tl.constexpr, BLK: tl.constexpr):
    # One refinement step per row: lo becomes the largest threshold that kk keys still reach.
    o = tl.program_id(0) * BLK + tl.arange(0, BLK)
    m = o < ROWS
    b_done = tl.load(DONE + o, mask=m, other=1)
    upd = m & (b_done == 0)
    lo = tl.load(LO + o, mask=m, other=0)
    hi = tl.load(HI + o, mask=m, other=1)
    kk = tl.load(KK + o // M, mask=m, other=0)
    o_p = tl.arange(0, P)
    cnt = tl.load(CNT + o[:, None] * P + o_p[None, :], mask=m[:, None], other=0)
    ok = cnt >= kk[:, None]
    # Counts fall with the threshold, so the thresholds kk keys reach are a prefix; p = 0 (lo) always is.
    n_ok = tl.sum(ok.to(tl.int32), 1)
    p_star = tl.maximum(n_ok - 1, 0)
    t_lo = lo + ((hi - lo) * p_star) // P
    t_hi = tl.where(p_star + 1 < P, lo + ((hi - lo) * (p_star + 1)) // P, hi)
    c_lo = tl.sum(tl.where(o_p[None, :] == p_star[:, None], cnt, 0), 1)
    done = (c_lo <= CAP) | (t_hi - t_lo <= 1)
    tl.store(LO + o, t_lo, mask=upd)
    tl.store(HI + o, t_hi, mask=upd)
    tl.store(DONE + o, done.to(tl.int32), mask=upd)
    tl.store(CNT + o[:, None] * P + o_p[None, :], tl.zeros([BLK, P], tl.int32), mask=m[:, None])


def _valid_counts(key_valid: torch.Tensor | None, BH: int, N: int, ksel: int, dev) -> torch.Tensor:
    if key_valid is None:
        return torch.full((BH,), ksel, device=dev, dtype=torch.int32)
    return key_valid.sum(-1).clamp(max=ksel).to(torch.int32)


def exact_topk(
    r: torch.Tensor,
    k: torch.Tensor,
    key_valid: torch.Tensor | None,
    ksel: int,
    *,
    small_max_n: int = SMALL_N,
    cap: int | None = None,
    timer=None,
) -> torch.Tensor:
    """Per landmark, the indices of the ``ksel`` valid keys with the largest raw score, ties to the lower index.

    Args:
        r: ``[BH, m, d]`` landmarks.
        k: ``[BH, N, d]`` keys (same dtype as r).
        key_valid: ``[BH, N]`` bool, or None when every key is valid.
        ksel: keys per landmark, ``1 <= ksel <= N``.
        small_max_n: rows up to this length take the on-chip kernel (when the key tile fits in 64 KiB).
        cap: candidate-list length of the long-row path (default ``max(2 ksel, 64)`` rounded to a power of 2).
        timer: None, or ``timer(name, fn)`` that runs ``fn()`` (profiling: each pass of the long-row path is one
            named call).

    Returns:
        ``[BH, m, ksel]`` int32 key indices, ascending, then -1 for the slots a row has no valid key for.
    """
    BH, M, D = r.shape
    N = k.shape[1]
    dev = r.device
    kv = key_valid.to(torch.int8).contiguous() if key_valid is not None else r
    prec, up = _prec(r.dtype), _upcast(r.dtype)
    NP = max(16, _next_pow2(N))
    if N <= small_max_n and NP * D * k.element_size() <= _SMALL_BYTES:
        # Without padding every row keeps ksel keys: no count tensor (one launch in all).
        kk = _valid_counts(key_valid, BH, N, ksel, dev) if key_valid is not None else r
        idx = torch.empty(BH, M, ksel, device=dev, dtype=torch.int32)
        bs = 16
        _topk_small_kernel[(triton.cdiv(M, bs), BH)](
            r,
            k,
            kv,
            kk,
            idx,
            N,
            M,
            ksel,
            HAS_KV=key_valid is not None,
            D=D,
            BS=bs,
            NP=NP,
            KP=max(16, _next_pow2(ksel)),
            PREC=prec,
            UP=up,
            EXACT=_interpreting(),
            num_warps=4 if NP <= 256 else 8,
        )
        return idx
    kk = _valid_counts(key_valid, BH, N, ksel, dev)
    bn = 64
    bs = 64 if D <= 64 else 32
    n_s = triton.cdiv(M, bs)
    NB = triton.cdiv(N, bn)
    G = max(1, min(NB, triton.cdiv(1024, n_s * BH)))
    CH = triton.cdiv(triton.cdiv(N, G), bn) * bn
    G = triton.cdiv(N, CH)
    cap = cap or max(64, _next_pow2(2 * ksel))
    rows = BH * M
    grid = (n_s, G, BH)
    common = dict(
        HAS_KV=key_valid is not None, D=D, BS=bs, BN=bn, PREC=prec, UP=up, EXACT=_interpreting(), P=_P, num_warps=4
    )
    i64 = torch.int64

    def run(name, fn):
        return fn() if timer is None else timer(name, fn)

    dummy64 = torch.empty(1, device=dev, dtype=i64)
    cmax = torch.empty(BH, M, NB, device=dev, dtype=torch.float32)
    lo = torch.empty(rows, device=dev, dtype=i64)
    hi = torch.empty(rows, device=dev, dtype=i64)
    done = torch.empty(rows, device=dev, dtype=torch.int32)
    cnt = torch.zeros(rows, _P, device=dev, dtype=torch.int32)
    counts = torch.empty(rows, G, 2, device=dev, dtype=torch.int32)

    def scan(mode, cnt_buf, done_buf=done, off=dummy64, cand=dummy64, skip=False):
        _topk_scan_kernel[grid](
            r, k, kv, lo, hi, done_buf, cmax, cnt_buf, off, cand, N, M, CH, G, NB, cap, MODE=mode, SKIP=skip, **common
        )

    run("block maxima", lambda: scan(0, cnt))
    kk_row = kk.repeat_interleave(M)

    def start_bounds():
        # lo = the kk-th largest maximum of key groups (kk distinct keys reach it), hi = just above the row maximum.
        # Groups of f blocks keep >= 4 ksel maxima (so the start stays close to the k-th key) in a smaller top-k.
        f = 1
        while NB % (2 * f) == 0 and NB // (2 * f) >= 4 * ksel:
            f *= 2
        gmax = cmax.view(rows, NB // f, f).amax(-1) if f > 1 else cmax.view(rows, NB)
        if gmax.shape[1] >= ksel:
            top = torch.topk(gmax, ksel, dim=-1, sorted=True).values
            start = torch.gather(top, 1, (kk_row.long() - 1).clamp(min=0)[:, None])[:, 0]
        else:
            start = torch.full((rows,), float("-inf"), device=dev)
        rmax = gmax.max(-1).values

        def key(x):
            b = torch.where(x == 0, torch.zeros_like(x), x).contiguous().view(torch.int32)
            return torch.where(b >= 0, b, b ^ 0x7FFFFFFF).to(i64)

        lo.copy_(key(start))
        hi.copy_(key(rmax) + 1)

    run("start threshold (top-k of group maxima)", start_bounds)
    # Count first: a row whose start already leaves at most cap candidates needs no refinement pass at all.
    run("count pass", lambda: scan(2, counts))

    def mark_done():
        tot = counts.view(rows, -1).sum(-1)
        done.copy_(((tot <= cap) | (hi - lo <= 1)).to(torch.int32))

    run("mark done rows", mark_done)
    done0 = done.clone()
    for i in range(_PASSES):
        run(f"refine pass {i}", lambda: scan(1, cnt))
        run(
            f"refine update {i}",
            lambda: _topk_update_kernel[(triton.cdiv(rows, 128),)](lo, hi, done, cnt, kk, rows, M, cap, P=_P, BLK=128),
        )
    # Recount only the landmark tiles that had a row to refine (the others keep their first counts).
    run("recount pass", lambda: scan(2, counts, done_buf=done0, skip=True))
    cand = torch.full((rows, cap), torch.iinfo(i64).min, device=dev, dtype=i64)

    def emit():
        n_hi = counts[..., 0].sum(-1, keepdim=True)
        off = torch.stack(
            [
                torch.cumsum(counts[..., 0], -1) - counts[..., 0],
                n_hi + torch.cumsum(counts[..., 1], -1) - counts[..., 1],
            ],
            -1,
        ).to(torch.int32)
        scan(3, counts, off=off.contiguous(), cand=cand)

    run("emit pass", emit)

    def final():
        top = torch.topk(cand, ksel, dim=-1, sorted=False).values
        idx = torch.where(top == torch.iinfo(i64).min, -1, 0xFFFFFFFF - (top & 0xFFFFFFFF))
        # Ascending valid indices, then -1.
        idx = torch.where(idx < 0, N, idx).sort(-1).values
        return torch.where(idx == N, -1, idx).to(torch.int32).view(BH, M, ksel).contiguous()

    return run("top-k of the candidate list", final)


# ----------------------------------------------------------------------------------------------------------------
# routing: top-S landmarks per query
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _route_kernel(
    Q,
    R,
    ROUTE,
    N,
    M,
    S: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BS: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
    EXACT: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, D)
    o_n = i_n * BM + tl.arange(0, BM)
    m_n = o_n < N
    b_q = tl.load(Q + i_bh * N * D + o_n.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)
    prev_s = tl.full([BM], float("inf"), tl.float32)
    prev_i = tl.full([BM], -1, tl.int32)
    for s in tl.static_range(S):
        best_s = tl.full([BM], float("-inf"), tl.float32)
        best_i = tl.full([BM], 2147483647, tl.int32)
        for j0 in range(0, M, BS):
            o_j = j0 + tl.arange(0, BS)
            b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=(o_j < M)[:, None], other=0.0)
            b_sc = _score(b_q, b_r, PREC, UP, EXACT)
            b_sc = tl.where(b_sc == 0.0, 0.0, b_sc)
            # Only entries after the previous pick in (score desc, index asc) order.
            ok = (o_j < M)[None, :] & (
                (b_sc < prev_s[:, None]) | ((b_sc == prev_s[:, None]) & (o_j[None, :] > prev_i[:, None]))
            )
            b_sc = tl.where(ok, b_sc, float("-inf"))
            t_max = tl.max(b_sc, 1)
            t_arg = tl.min(tl.where(ok & (b_sc == t_max[:, None]), o_j[None, :], 2147483647), 1)
            upd = (t_max > best_s) | ((t_max == best_s) & (t_arg < best_i))
            best_s = tl.where(upd, t_max, best_s)
            best_i = tl.where(upd, t_arg, best_i)
        tl.store(ROUTE + i_bh * N * S + o_n.to(tl.int64) * S + s, best_i, mask=m_n)
        prev_s = best_s
        prev_i = best_i


def route_topk(q: torch.Tensor, r: torch.Tensor, S: int) -> torch.Tensor:
    """Per query, the S landmarks with the largest raw score ``q_n . R_i`` (ties to the lower index), best first.

    Args:
        q: ``[BH, N, d]`` queries.
        r: ``[BH, m, d]`` landmarks.
        S: experts per query, ``1 <= S <= m``.

    Returns:
        ``[BH, N * S]`` int32: entry ``n * S + s`` is query n's s-th landmark.
    """
    BH, N, D = q.shape
    M = r.shape[1]
    route = torch.empty(BH, N * S, device=q.device, dtype=torch.int32)
    bm = 64
    bs = int(min(64, max(16, _next_pow2(M))))
    _route_kernel[(triton.cdiv(N, bm), BH)](
        q,
        r,
        route,
        N,
        M,
        S=S,
        D=D,
        BM=bm,
        BS=bs,
        PREC=_prec(q.dtype),
        UP=_upcast(q.dtype),
        EXACT=_interpreting(),
        num_warps=4,
    )
    return route


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
    for n_b in range(n0, n1, BN):
        o_n = n_b + tl.arange(0, BN)
        m_n = o_n < n1
        if HAS_KV:
            m_n = m_n & (tl.load(KV + i_bh * N + o_n, mask=m_n, other=0) != 0)
        o_n64 = o_n.to(tl.int64)
        b_k = tl.load(K + i_bh * N * D + o_n64[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_v = tl.load(V + i_bh * N * D + o_n64[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_s = _dot(b_r, tl.trans(b_k), PREC, UP) * scale_log2
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_s, 1))
        b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_p = tl.exp2(b_s - b_ms[:, None])
        b_alpha = tl.exp2(b_m - b_ms)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v, PREC, UP)
        b_m = b_mn
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
def _lv_merge_kernel(PM, PL, PACC, VT, LSE, M, NC, D: tl.constexpr, BS: tl.constexpr):
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, D)
    o_j = i_s * BS + tl.arange(0, BS)
    m_j = o_j < M
    b_m = tl.full([BS], float("-inf"), tl.float32)
    b_l = tl.zeros([BS], tl.float32)
    b_acc = tl.zeros([BS, D], tl.float32)
    for c in range(0, NC):
        o_w = (i_bh * NC + c) * M + o_j
        c_m = tl.load(PM + o_w, mask=m_j, other=float("-inf"))
        c_l = tl.load(PL + o_w, mask=m_j, other=0.0)
        c_acc = tl.load(PACC + o_w[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
        b_mn = tl.maximum(b_m, c_m)
        b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        a_old = tl.exp2(b_m - b_ms)
        a_new = tl.exp2(c_m - b_ms)
        b_l = b_l * a_old + c_l * a_new
        b_acc = b_acc * a_old[:, None] + c_acc * a_new[:, None]
        b_m = b_mn
    m_nz = b_l > 0
    b_o = b_acc / tl.where(m_nz, b_l, 1.0)[:, None]
    tl.store(VT + i_bh * M * D + o_j[:, None] * D + o_d[None, :], b_o.to(VT.dtype.element_ty), mask=m_j[:, None])
    tl.store(LSE + i_bh * M + o_j, tl.where(m_nz, b_m + tl.log2(tl.where(m_nz, b_l, 1.0)), float("-inf")), mask=m_j)


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
    m_n = o_n < N
    m_in = m_n
    if HAS_KV:
        m_n = m_n & (tl.load(KV + i_bh * N + o_n, mask=m_n, other=0) != 0)
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
        m_n = o_n < n1
        if HAS_KV:
            m_n = m_n & (tl.load(KV + i_bh * N + o_n, mask=m_n, other=0) != 0)
        o_n64 = o_n.to(tl.int64)
        b_k = tl.load(K + i_bh * N * D + o_n64[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_v = tl.load(V + i_bh * N * D + o_n64[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)
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


def _n_chunks(N: int, n_s: int, BH: int, bn: int, target: int = 1024) -> tuple[int, int]:
    nc = max(1, min(triton.cdiv(N, 4 * bn), triton.cdiv(target, n_s * BH)))
    ch = triton.cdiv(triton.cdiv(N, nc), bn) * bn
    return triton.cdiv(N, ch), ch


def landmark_values_fwd(r, k, v, key_valid, scale: float):
    """Forward of ``softmax(R k^T scale) v`` over valid keys. r ``[BH, m, d]``, k, v ``[BH, N, d]``.

    Returns:
        ``(vt [BH, m, d] in r's dtype, lse [BH, m] float32 in log2 units; -inf for a row with no valid key)``.
    """
    BH, M, D = r.shape
    N = k.shape[1]
    dev = r.device
    bs, bn = _lv_blocks(M, D)
    n_s = triton.cdiv(M, bs)
    nc, ch = _n_chunks(N, n_s, BH, bn)
    kv = key_valid.to(torch.int8).contiguous() if key_valid is not None else r
    vt = torch.empty(BH, M, D, device=dev, dtype=r.dtype)
    lse = torch.empty(BH, M, device=dev, dtype=torch.float32)
    direct = nc == 1
    if direct:
        pm = pl = pacc = lse
    else:
        pm = torch.empty(BH, nc, M, device=dev, dtype=torch.float32)
        pl = torch.empty(BH, nc, M, device=dev, dtype=torch.float32)
        pacc = torch.empty(BH, nc, M, D, device=dev, dtype=torch.float32)
    _lv_fwd_kernel[(n_s, nc, BH)](
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
        scale * LOG2E,
        HAS_KV=key_valid is not None,
        DIRECT=direct,
        D=D,
        BS=bs,
        BN=bn,
        PREC=_prec(r.dtype),
        UP=_upcast(r.dtype),
        num_warps=4,
    )
    if not direct:
        _lv_merge_kernel[(n_s, BH)](pm, pl, pacc, vt, lse, M, nc, D=D, BS=bs, num_warps=4)
    return vt, lse


def landmark_values_bwd(dvt, r, k, v, key_valid, vt, lse, scale: float):
    """Backward of :func:`landmark_values_fwd`. Returns ``(dr, dk, dv)`` float32, shapes of r, k, v."""
    BH, M, D = r.shape
    N = k.shape[1]
    dev = r.device
    bs, bn = _lv_blocks(M, D)
    n_s = triton.cdiv(M, bs)
    dvt = dvt.to(r.dtype).contiguous()
    delta = (dvt.float() * vt.float()).sum(-1).contiguous()
    kv = key_valid.to(torch.int8).contiguous() if key_valid is not None else r
    prec, up = _prec(r.dtype), _upcast(r.dtype)
    has_kv = key_valid is not None
    dk = torch.empty(BH, N, D, device=dev, dtype=torch.float32)
    dv = torch.empty(BH, N, D, device=dev, dtype=torch.float32)
    _lv_bwd_dkdv_kernel[(triton.cdiv(N, bn), BH)](
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
    nc, ch = _n_chunks(N, n_s, BH, bn)
    dr = torch.empty(BH, nc, M, D, device=dev, dtype=torch.float32)
    _lv_bwd_dr_kernel[(n_s, nc, BH)](
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
