"""The routing plan of the general path: routed rows ``n * S + s`` stably sorted by expert, the experts' first rows
and a tile table of static length (``build_plan``, ``RoutingPlan``, ``plan_shape``), built without host
synchronisation: one launch of chunk programs that each count their head's routes (``_plan_local_kernel``) for
calls of few rows, else a chunked counting sort of three kernels (``_plan_count_kernel``,
``_plan_offsets_kernel``, ``_plan_scatter_kernel``). Also ``order_key`` /
``topk_lowest_index``, the PyTorch form of the kernels' order keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mita.ops.mita.triton.attention_fwd import FWD_CONFIG
from mita.ops.mita.triton.common import _cdiv, _next_pow2
from mita.ops.mita.triton.launch import fast


@triton.jit
def _plan_local_kernel(
    ROUTE, ROWS, STARTS, TILE_E, TILE_RS, TILE_RE, NR, M, T, BMQ, TT,
    MP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    # The routing plan in one launch of (chunk of BR rows, batch-head) programs: each program counts the experts of
    # the whole (batch, head) and of the rows before its chunk (histograms of BC rows at a time; the routes are a few
    # KiB, read from L2), so it knows every expert's first row and its own rows' next positions without the other
    # programs; its rows' ranks among the chunk's rows of their expert come from one [BR, BR] comparison sum (a
    # stable counting sort). Program (0, bh) stores the first rows; program c writes tiles c * TT .. (c + 1) * TT.
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    r_lo = i_c * BR
    route = ROUTE + i_bh * NR
    tot = tl.zeros([MP], tl.int32)
    pre = tl.zeros([MP], tl.int32)
    for r0 in range(0, NR, BC):
        o_r = r0 + tl.arange(0, BC)
        b_e = tl.load(route + o_r, mask=o_r < NR, other=0)
        tot += tl.histogram(b_e, MP)
        pre += tl.histogram(tl.where(o_r < r_lo, b_e, 0), MP)
    # The rows past NR (counted in tot) and from r_lo on (in pre) were counted as expert 0.
    o_m = tl.arange(0, MP)
    n_pad = (NR + BC - 1) // BC * BC
    tot -= tl.where(o_m == 0, n_pad - NR, 0)
    pre -= tl.where(o_m == 0, n_pad - r_lo, 0)
    start = _plan_chunk_head(STARTS, TILE_E, TILE_RS, TILE_RE, tot, i_c, i_bh, M, T, TT, BMQ, MP, BT)
    o_b = tl.arange(0, BR)
    o_r = r_lo + o_b
    m_r = o_r < NR
    # Rows past NR read expert 0: they come after every row of the chunk, so they change no rank.
    b_e = tl.load(route + o_r, mask=m_r, other=0)
    # Row j's rank among the chunk's rows of its expert: the earlier rows i < j with the same expert (sum over axis 0).
    w = (o_b[:, None] < o_b[None, :]).to(tl.int32)
    rank = tl.sum(tl.where(b_e[:, None] == b_e[None, :], w, 0), 0)
    base = tl.sum(tl.where(b_e[:, None] == o_m[None, :], (start + pre)[None, :], 0), 1)
    tl.store(ROWS + i_bh * NR + base + rank, o_r, mask=m_r)


@triton.jit
def _plan_chunk_head(
    STARTS, TILE_E, TILE_RS, TILE_RE, cnt, i_c, i_bh, M, T, TT, BMQ, MP: tl.constexpr, BT: tl.constexpr
):  # fmt: skip
    # What chunk program i_c of a head writes from the head's [MP] expert counts: the experts' first rows (chunk 0)
    # and tiles i_c * TT .. (i_c + 1) * TT of the tile table. Returns the first rows.
    incl = tl.cumsum(cnt, 0)
    start = incl - cnt
    if i_c == 0:
        _plan_starts(STARTS, cnt, i_bh, M, MP)
    t_lo = i_c * TT
    _plan_tiles(TILE_E, TILE_RS, TILE_RE, cnt, start, incl, i_bh, M, T, t_lo, tl.minimum(t_lo + TT, T), BMQ, MP, BT)
    return start


@triton.jit
def _plan_starts(STARTS, cnt, i_bh, M, MP: tl.constexpr):
    # Each expert's first row (exclusive prefix of the [MP] counts) and end row; STARTS[bh] = first rows, then the
    # total after the last expert.
    o_m = tl.arange(0, MP)
    incl = tl.cumsum(cnt, 0)
    start = incl - cnt
    tl.store(STARTS + i_bh * (M + 1) + o_m, start, mask=o_m < M)
    tl.store(STARTS + i_bh * (M + 1) + o_m + 1, incl, mask=o_m == M - 1)
    return start, incl


@triton.jit
def _plan_tiles(
    TILE_E, TILE_RS, TILE_RE, cnt, start, incl, i_bh, M, T, t_lo, t_hi, BMQ, MP: tl.constexpr, BT: tl.constexpr
):
    # Tiles t_lo .. t_hi of the tile table of one (batch, head) from the expert counts, first rows and end rows
    # ([MP] each; experts past M have none).
    o_m = tl.arange(0, MP)
    tiles = (cnt + BMQ - 1) // BMQ
    tcum = tl.cumsum(tiles, 0)
    for t0 in range(t_lo, t_hi, BT):
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < t_hi
        # Expert of tile t: the number of experts whose tiles all come before t (padded experts have no tiles
        # and count only past the last tile, giving e >= M there).
        e_t = tl.sum((tcum[None, :] <= o_t[:, None]).to(tl.int32), 1)
        ok = e_t < M
        sel = o_m[None, :] == e_t[:, None]
        first_t = tl.sum(tl.where(sel, (tcum - tiles)[None, :], 0), 1)
        rs = tl.sum(tl.where(sel, start[None, :], 0), 1) + (o_t - first_t) * BMQ
        re = tl.sum(tl.where(sel, incl[None, :], 0), 1)
        tl.store(TILE_E + i_bh * T + o_t, tl.where(ok, e_t, -1), mask=m_t)
        tl.store(TILE_RS + i_bh * T + o_t, tl.where(ok, rs, 0), mask=m_t)
        tl.store(TILE_RE + i_bh * T + o_t, tl.where(ok, re, 0), mask=m_t)


@triton.jit
def _plan_count_kernel(ROUTE, CNTS, NR, CR, NC, MP: tl.constexpr, BR: tl.constexpr):
    # Chunked plan, step 1 of 3: per chunk of CR rows, the number of rows routed to each expert, summed in registers
    # (a histogram per BR rows) and stored once -> CNTS[bh, c].
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    r_lo = i_c * CR
    r_end = tl.minimum(r_lo + CR, NR)
    cnt = tl.zeros([MP], tl.int32)
    for r0 in range(r_lo, r_end, BR):
        o_r = r0 + tl.arange(0, BR)
        cnt += tl.histogram(tl.load(ROUTE + i_bh * NR + o_r, mask=o_r < r_end, other=0), MP)
    # The rows past the chunk's end were counted as expert 0.
    pad = (r_end - r_lo + BR - 1) // BR * BR - (r_end - r_lo)
    o_m = tl.arange(0, MP)
    tl.store(CNTS + (i_bh * (NC + 1) + i_c) * MP + o_m, cnt - tl.where(o_m == 0, pad, 0))


@triton.jit
def _plan_offsets_kernel(CNTS, NC, MP: tl.constexpr, BE: tl.constexpr, BC: tl.constexpr):
    # Step 2 of 3, one program per (block of BE experts, batch-head): each chunk's count of an expert becomes the
    # expert's rows in the earlier chunks (exclusive prefix over the chunks, in place), and the expert totals go
    # to the row after the last chunk, CNTS[bh, NC].
    i_e = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_e = i_e * BE + tl.arange(0, BE)
    base = CNTS + i_bh * (NC + 1) * MP
    run = tl.zeros([BE], tl.int32)
    for c0 in range(0, NC, BC):
        o_c = c0 + tl.arange(0, BC)
        ptr = base + o_c[:, None] * MP + o_e[None, :]
        b_c = tl.load(ptr, mask=(o_c < NC)[:, None], other=0)
        tl.store(ptr, run[None, :] + tl.cumsum(b_c, 0) - b_c, mask=(o_c < NC)[:, None])
        run += tl.sum(b_c, 0)
    tl.store(base + NC * MP + o_e, run)


@triton.jit
def _plan_scatter_kernel(
    ROUTE, CNTS, ROWS, STARTS, TILE_E, TILE_RS, TILE_RE, NR, CR, NC, M, T, BMQ, TT,
    MP: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    # Step 3 of 3: each chunk writes its rows at their expert's next position, in row order (a stable counting
    # sort). The expert totals (step 2) give the experts' first rows; program 0 stores them (STARTS) and program c
    # writes tiles c * TT .. (c + 1) * TT of the tile table. The chunk's [MP] next positions live in its CNTS row
    # (its rows before this chunk from step 2, plus the expert's first row), advanced after each step of BR rows.
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_m = tl.arange(0, MP)
    head = CNTS + i_bh * (NC + 1) * MP
    cnt = tl.load(head + NC * MP + o_m)
    start = _plan_chunk_head(STARTS, TILE_E, TILE_RS, TILE_RE, cnt, i_c, i_bh, M, T, TT, BMQ, MP, BT)
    nxt = head + i_c * MP
    tl.store(nxt + o_m, tl.load(nxt + o_m) + start)
    tl.debug_barrier()
    # Pairwise weights of a step: an earlier row of the same expert counts 1, a later one 1 << 16, so one sum gives
    # a row's rank among its expert's rows of the step (low half) and whether it is their last (high half 0). Row
    # j's sum runs over axis 0 (within a thread's registers in the default layout, not across the lanes).
    o_b = tl.arange(0, BR)
    w = tl.where(o_b[:, None] < o_b[None, :], 1, tl.where(o_b[:, None] > o_b[None, :], 1 << 16, 0))
    r_end = tl.minimum((i_c + 1) * CR, NR)
    route = ROUTE + i_bh * NR
    # Each step's experts are loaded one step ahead. Rows past the chunk's end (last step only) read the expert of
    # its last row: they are later than every row of the chunk, so they change no rank, only the "last" flags of
    # the final step, whose next positions are not used again.
    b_next = tl.load(route + tl.minimum(i_c * CR + o_b, r_end - 1))
    for r0 in range(i_c * CR, r_end, BR):
        o_r = r0 + o_b
        m_r = o_r < r_end
        b_e = b_next
        b_next = tl.load(route + tl.minimum(o_r + BR, r_end - 1))
        s = tl.sum(tl.where(b_e[:, None] == b_e[None, :], w, 0), 0)
        pos = tl.load(nxt + b_e, mask=m_r, other=0) + (s & 0xFFFF)
        tl.store(ROWS + i_bh * NR + pos, o_r, mask=m_r)
        tl.debug_barrier()
        tl.store(nxt + b_e, pos + 1, mask=m_r & (s < (1 << 16)))
        tl.debug_barrier()


# ----------------------------------------------------------------------------------------------------------------
# routing plan (Triton counting sort, no host synchronisation)
# ----------------------------------------------------------------------------------------------------------------


def order_key(scores: torch.Tensor) -> torch.Tensor:
    """int64 images of float32 scores in the same order (-0.0 as +0.0): the kernels' int32 order keys."""
    bits = (scores.float() + 0.0).view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)


def topk_lowest_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest float32 scores along the last dim, ties to the lower index, in no order.

    Args:
        scores: ``[..., L]`` float32 (``-inf`` allowed; NaN not).
        k: ``1 <= k <= L``.

    Returns:
        ``[..., k]`` int64 indices. The score's order-preserving int32 image and the reversed index are packed
        into one int64 key, so ``torch.topk`` on the keys is exact whatever its own tie order.
    """
    L = scores.shape[-1]
    key = order_key(scores)
    low = 0xFFFFFFFF - torch.arange(L, device=scores.device, dtype=torch.int64)
    packed = (key << 32) + low
    top = torch.topk(packed, k, dim=-1, sorted=False).values
    return 0xFFFFFFFF - (top & 0xFFFFFFFF)


class RoutingPlan:
    """Everything the kernels need to know about the routing of one call (all device tensors, static shapes).

    Attributes:
        idx: ``[BH, m, topk]`` int32 key index of each routed slot, ascending, -1 for a slot with no valid key.
        rows: ``[BH, N * S]`` int32 row ids ``n * S + s`` sorted by expert (stable).
        starts: ``[BH, m + 1]`` int32 first row of each expert in ``rows``.
        tile_e, tile_rs, tile_re: ``[BH, T]`` int32 expert, first row and end row of each query tile (-1: none).
    """

    def __init__(self, idx, rows, starts, tile_e, tile_rs, tile_re, bm):
        self.idx, self.rows, self.starts = idx, rows, starts
        self.tile_e, self.tile_rs, self.tile_re = tile_e, tile_rs, tile_re
        self.bm = bm


# Calls of at most _PLAN_LOCAL_N routed rows per (batch, head) and _PLAN_LOCAL_MAX over all take the one-launch
# plan (_plan_local_kernel, chunks of _PLAN_LOCAL_ROWS rows; each program reads its head's routes, so its GPU time
# grows with the square of the rows per head), the others the chunked one. On the H100 the chunked plan's GPU time
# was lower everywhere but at two heads (Segmenter 512, 384 heads of 1025 rows: 0.018 against 0.091 ms), but with it
# eager MiTA forwards at LRA ListOps (64 x 2000 rows) and B 8 x H 2 x 4096 were 0.1-0.4 ms slower than with the
# one-launch plan, where the host, not the GPU, sets the pace (notes/kernels-notes.md).
_PLAN_LOCAL_N = 8192
_PLAN_LOCAL_MAX = 1 << 17
_PLAN_LOCAL_ROWS = 64
# Chunked plan (timed on the H200): chunks of at most _PLAN_ROWS rows, fewer where
# that gives about _PLAN_PROGRAMS programs over all (batch, head) pairs (latency is hidden by many short programs);
# scatter programs of _PLAN_WARPS warps in steps of _PLAN_STEP rows (at most 2^15; ranks among equal experts from
# a [step, step] comparison), writing the tile table in blocks of about _PLAN_TILE_ENTRIES (tile, expert) pairs
# (fewer registers, more programs resident); expert counts by histograms of up to _PLAN_COUNT_STEP rows; offsets
# over blocks of _PLAN_EXPERTS experts, _PLAN_OFFSETS_BLOCK counts per step (8 experts: more programs; on the H200 the
# offsets kernel took 5 us at 64K to 1M against 7-8 us with 16 and 12-13 us with 32).
_PLAN_ROWS = 1024
_PLAN_PROGRAMS = 2048
_PLAN_STEP = 64
_PLAN_WARPS = 1
_PLAN_TILE_ENTRIES = 1024
_PLAN_COUNT_STEP = 1024
_PLAN_EXPERTS = 8
_PLAN_OFFSETS_BLOCK = 4096


def plan_bm_max(train: bool = True) -> int:
    """Largest query tile of the routing plan: ``FWD_CONFIG["bm_max"]``, or ``bm_infer`` (when set) for a forward
    without backward."""
    if train or FWD_CONFIG["bm_infer"] is None:
        return int(FWD_CONFIG["bm_max"])
    return int(FWD_CONFIG["bm_infer"])


def plan_shape(nrows: int, m: int, bm_max: int | None = None) -> tuple[int, int]:
    """``(bm, T)``: query rows per tile and the tile table's length (a static upper bound) for ``nrows = N * S``
    routed rows over m experts; tiles of at most ``bm_max`` rows (None: :func:`plan_bm_max` of training)."""
    cap = plan_bm_max() if bm_max is None else bm_max
    bm = int(min(cap, max(16, _next_pow2(max(1, nrows // m)))))
    return bm, _cdiv(nrows, bm) + min(m, nrows)


def _chunk_tiles(T: int, nc: int, mp: int) -> tuple[int, int]:
    """``(tt, bt)``: tiles of the tile table each of nc chunk programs writes (whole blocks of bt tiles, about
    ``_PLAN_TILE_ENTRIES`` (tile, expert) pairs each; the first programs write it, the others none)."""
    bt = max(2, _PLAN_TILE_ENTRIES // mp)
    return _cdiv(_cdiv(T, nc), bt) * bt, bt


def build_plan(idx: torch.Tensor, route: torch.Tensor, m: int, bm_max: int | None = None) -> RoutingPlan:
    """Build the routing plan from the expert key lists and the query routes (no host synchronisation).

    Args:
        idx: ``[BH, m, topk]`` int32 key index of each routed slot, -1 for a slot with no valid key.
        route: ``[BH, N * S]`` int32 landmark of row ``n * S + s``, in ``[0, m)``.
        m: number of landmarks.
        bm_max: largest query tile (None: :func:`plan_bm_max` of training).

    Returns:
        The :class:`RoutingPlan`.
    """
    BH, nrows = route.shape
    dev = route.device
    bm, T = plan_shape(nrows, m, bm_max)
    # Histograms take at least one bin per lane of a warp.
    mp = max(32, _next_pow2(m))
    i32 = torch.int32
    rows = torch.empty(BH, nrows, device=dev, dtype=i32)
    starts = torch.empty(BH, m + 1, device=dev, dtype=i32)
    tile_e, tile_rs, tile_re = (torch.empty(BH, T, device=dev, dtype=i32) for _ in range(3))
    if nrows <= _PLAN_LOCAL_N and BH * nrows <= _PLAN_LOCAL_MAX:
        # One launch of (chunk, batch-head) programs, each counting the whole head's routes itself.
        nc = _cdiv(nrows, _PLAN_LOCAL_ROWS)
        tt, bt = _chunk_tiles(T, nc, mp)
        bc = min(_PLAN_COUNT_STEP, max(32, _next_pow2(nrows)))
        fast(_plan_local_kernel)[(nc, BH)](
            route, rows, starts, tile_e, tile_rs, tile_re, nrows, m, T, bm, tt,
            MP=mp, BR=_PLAN_LOCAL_ROWS, BC=bc, BT=bt, num_warps=4,
        )  # fmt: skip
        return RoutingPlan(idx, rows, starts, tile_e, tile_rs, tile_re, bm)
    # Chunked counting sort (three launches at any size): per-chunk expert counts, offsets, scatter + tile table.
    br = _PLAN_STEP
    # Chunks of whole steps: _PLAN_ROWS rows at most, fewer where that gives about _PLAN_PROGRAMS programs.
    cr = _cdiv(_cdiv(nrows, _cdiv(_PLAN_PROGRAMS, BH)), br) * br
    cr = max(br, min(cr, _PLAN_ROWS // br * br))
    nc = _cdiv(nrows, cr)
    # Row c < nc: chunk c's expert counts, then its first output positions; row nc: the expert totals.
    cnts = torch.empty(BH, nc + 1, mp, device=dev, dtype=i32)
    brc = min(_PLAN_COUNT_STEP, _next_pow2(cr))
    fast(_plan_count_kernel)[(nc, BH)](route, cnts, nrows, cr, nc, MP=mp, BR=brc, num_warps=4)
    be = min(mp, _PLAN_EXPERTS)
    bc = max(1, min(_next_pow2(nc), _PLAN_OFFSETS_BLOCK // be))
    fast(_plan_offsets_kernel)[(mp // be, BH)](cnts, nc, MP=mp, BE=be, BC=bc, num_warps=4)
    tt, bt = _chunk_tiles(T, nc, mp)
    fast(_plan_scatter_kernel)[(nc, BH)](
        route, cnts, rows, starts, tile_e, tile_rs, tile_re, nrows, cr, nc, m, T, bm, tt,
        MP=mp, BR=br, BT=bt, num_warps=_PLAN_WARPS,
    )  # fmt: skip
    return RoutingPlan(idx, rows, starts, tile_e, tile_rs, tile_re, bm)
