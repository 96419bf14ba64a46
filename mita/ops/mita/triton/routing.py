"""Top-S routing per query: ``route_topk`` (``_route_kernel``), the S landmarks with the largest ``q_n . R_i``
(first maximum on ties), in order. Settings: ``ROUTE_CONFIG``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mita.ops.mita.triton.common import (
    _cdiv,
    _head_ptr,
    _next_pow2,
    _prec,
    _score,
    _sm_count,
    _upcast,
    heads_layout,
    regs_cap,
)
from mita.ops.mita.triton.launch import fast, interpreting

# The routing kernel's tile (queries bm x landmarks bs) and warps; None: by S (route_topk). For GPU A/B runs
# (scripts/bench/ab_scan.py --sweep route.bm=64,128); every value gives the same routes.
# Loads go without masks where N and m are multiples of the tiles (EVEN).
# persistent (S = 1, one landmark tile, unmasked): programs per SM of a persistent routing kernel, each looping over
# query tiles with the landmark tile loaded once (0: one program per query tile), used where each program takes at
# most persistent_max tiles; stages: that loop's pipelining.
ROUTE_CONFIG = dict(
    bm=None, bs=None, num_warps=None, maxnreg=None, persistent=2, persistent_max=4, stages=2
)  # fmt: skip


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
    H,
    SB,
    SH,
    SN,
    S: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BS: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
    EXACT: tl.constexpr,
    EVEN: tl.constexpr,
    PERSIST: tl.constexpr = 0,
    STAGES: tl.constexpr = 2,
):
    # EVEN: N % BM == 0 and M % BS == 0, so the query and landmark tiles load without masks.
    # PERSIST (S = 1, EVEN, M == BS): the grid's first axis is a number of persistent programs, each
    # with the landmark tile loaded once, looping over query tiles i_n, i_n + programs, ... (STAGES: the loop's
    # software pipelining, which loads the next query tiles during this one's scores).
    # Top-S landmarks of each query (ROUTE).
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, D)
    if PERSIST:
        o_j = tl.arange(0, BS)
        b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :])
        Q_h = _head_ptr(Q, i_bh, H, SB, SH)
        for i_t in tl.range(i_n, N // BM, tl.num_programs(0), num_stages=STAGES):
            o_t = i_t * BM + tl.arange(0, BM)
            b_q = tl.load(Q_h + o_t.to(tl.int64)[:, None] * SN + o_d[None, :])
            b_sc = _score(b_q, b_r, PREC, UP, EXACT)
            t_max = tl.max(b_sc, 1)
            t_arg = tl.min(tl.where(b_sc == t_max[:, None], o_j[None, :], 2147483647), 1)
            # A NaN row maximum matches nothing: landmark 0, as the tiled form gives.
            t_arg = tl.where(t_arg < BS, t_arg, 0)
            tl.store(ROUTE + i_bh * N + o_t.to(tl.int64), t_arg)
        return
    o_n = i_n * BM + tl.arange(0, BM)
    m_n = o_n < N
    if EVEN:
        b_q = tl.load(_head_ptr(Q, i_bh, H, SB, SH) + o_n.to(tl.int64)[:, None] * SN + o_d[None, :])
    else:
        b_q = tl.load(
            _head_ptr(Q, i_bh, H, SB, SH) + o_n.to(tl.int64)[:, None] * SN + o_d[None, :], mask=m_n[:, None], other=0.0
        )
    if S == 1:
        # First maximum: within a tile the lowest index among equal scores (-0.0 == +0.0 as compares see them),
        # across tiles a later tile only on a strictly larger score. Landmark 0 if every score is NaN.
        best_s = tl.full([BM], float("-inf"), tl.float32)
        best_i = tl.zeros([BM], tl.int32)
        for j0 in range(0, M, BS):
            o_j = j0 + tl.arange(0, BS)
            if EVEN:
                b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :])
            else:
                b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=(o_j < M)[:, None], other=0.0)
            b_sc = _score(b_q, b_r, PREC, UP, EXACT)
            if M % BS != 0:
                b_sc = tl.where((o_j < M)[None, :], b_sc, float("-inf"))
            t_max = tl.max(b_sc, 1)
            t_arg = tl.min(tl.where(b_sc == t_max[:, None], o_j[None, :], 2147483647), 1)
            upd = t_max > best_s
            best_s = tl.where(upd, t_max, best_s)
            best_i = tl.where(upd, t_arg, best_i)
        tl.store(ROUTE + i_bh * N + o_n.to(tl.int64), best_i, mask=m_n)
    else:
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
        q: ``[BH, N, d]`` or ``[B, H, N, d]`` queries (any layout :func:`heads_layout` takes).
        r: ``[BH, m, d]`` landmarks.
        S: experts per query, ``1 <= S <= m``.

    Returns:
        ``[BH, N * S]`` int32: entry ``n * S + s`` is query n's s-th landmark.
    """
    BH, M, D = r.shape
    N = q.shape[-2]
    route = torch.empty(BH, N * S, device=q.device, dtype=torch.int32)
    # S = 1: 128 queries x up to 128 landmarks per step (fewer reloads of R; a max and a first-index min per
    # score). S > 1: 64 x 64 (the ordered passes keep more state per score).
    bm = ROUTE_CONFIG["bm"] or (128 if S == 1 else 64)
    bs = int(min(ROUTE_CONFIG["bs"] or (128 if S == 1 else 64), max(16, _next_pow2(M))))
    warps = ROUTE_CONFIG["num_warps"] or (8 if bm * bs >= 128 * 128 else 4)
    even = N % bm == 0 and M % bs == 0
    per_sm = int(ROUTE_CONFIG["persistent"] or 0)
    if per_sm < 0:
        raise ValueError(f"ROUTE_CONFIG['persistent'] must be >= 0, got {per_sm}")
    persist = per_sm > 0 and S == 1 and even and M == bs
    grid = (_cdiv(N, bm), BH)
    if persist:
        # Persistent programs: per_sm per SM over all heads (two under the interpreter, to run the loop).
        progs = 2 if interpreting() else _sm_count(q.device) * per_sm
        per_head = max(1, min(N // bm, _cdiv(progs, BH)))
        persist = interpreting() or _cdiv(N // bm, per_head) <= int(ROUTE_CONFIG["persistent_max"])
        if persist:
            grid = (per_head, BH)
    fast(_route_kernel)[grid](
        q,
        r,
        route,
        N,
        M,
        *heads_layout(q),
        S=S,
        D=D,
        BM=bm,
        BS=bs,
        PREC=_prec(q.dtype),
        UP=_upcast(q.dtype),
        EXACT=interpreting(),
        EVEN=even,
        PERSIST=persist,
        STAGES=int(ROUTE_CONFIG["stages"]),
        num_warps=warps,
        **regs_cap(ROUTE_CONFIG["maxnreg"]),
    )
    return route


def _compile_cases() -> list:
    """Kernels and constexpr settings (bf16, d 64) for scripts/bench/compile_check.py beyond its own list: the
    routing kernel."""
    common = dict(D=64, PREC="tf32", UP=False)
    return [
        ("route S=1", _route_kernel, dict(S=1, BM=128, BS=128, EXACT=False, EVEN=0, **common), 8, None),
        ("route S=1 even", _route_kernel, dict(S=1, BM=128, BS=128, EXACT=False, EVEN=1, **common), 8, None),
        ("route S=1 persistent", _route_kernel,
         dict(S=1, BM=128, BS=128, EXACT=False, EVEN=1, PERSIST=1, STAGES=2, **common), 8, None),
        ("route S=2", _route_kernel, dict(S=2, BM=64, BS=64, EXACT=False, EVEN=0, **common), 4, None),
    ]  # fmt: skip
