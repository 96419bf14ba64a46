"""Short-sequence MiTA (image sizes, N <= 256): the whole operator in two forward launches and one backward.

At DeiT shapes (N = 197, m = k = 25) every routed key list covers a large part of the sequence, so the sparse
path (query tiles per expert, ~8 queries each, keys read through index lists) wastes most of each tile and pays
for a plan, a sort and five launches. Here the whole key tile of a (batch, head) stays on chip:

- ``_small_route_kernel`` (16 landmarks per program): the exact top-k of each landmark's raw scores ``R k^T`` by
  a four-way search on the scores' int32 order keys (ties to the lower key index), written as a [m, N] 0/1
  membership tile, and the landmark values ``softmax(R k^T scale) v`` from the same scores;
- ``_small_attn_kernel`` (a block of queries per program): routing (top-S of ``q R^T``, ties to the lower
  landmark index), then one dense softmax over [m landmarks ; N keys], where key n counts for query i as many
  times as it appears in the routed lists of i's experts: ``c_in = onehot(route_i) . membership[:, n]`` (one
  tensor-core product), logit ``q_i . k_n * scale + log(c_in)``, and ``-inf`` where ``c_in = 0``. With S = 1,
  ``c`` is 0 or 1; with S = 2 a key in both lists enters twice, exactly as in the concatenated softmax of the
  contract.

The backward is ``short_bwd.py``.
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
    _out_ptr,
    _prec,
    _score,
    _softmax_step,
    _upcast,
    _valid_keys,
    heads_layout,
    out_layout,
    regs_cap,
)
from mita.ops.mita.triton.launch import fast, interpreting
from mita.ops.mita.triton.topk import _valid_counts
from mita.ops.mita.triton.topk_scan import _head_kk, _order_key, _topk_select

# Limits of the one-program-per-(batch, head) path: the key tile and the [m, N] score tile live on chip.
SMALL_MAX_N = 256
SMALL_MAX_TILE = 8192


def small_supported(N: int, m: int, d: int) -> bool:
    """Whether the short-sequence kernels take a call with N tokens, m landmarks and head dim d."""
    NP = max(16, _next_pow2(N))
    MP = max(16, _next_pow2(m))
    return NP <= SMALL_MAX_N and MP * NP <= SMALL_MAX_TILE and NP * d <= 256 * 64


# Launch settings per kernel (block sizes above are capped at NP); scripts/bench/sweep.py sweeps them
# (``--sweep small.bwd.BM=32,64``). ``tail`` 1: the last query and key blocks of the attention (the last query block
# of the backward) hold N % block rows rounded up to a power of two, not a whole block (N = 197, blocks of 64: 208
# rows against 256); 0: whole blocks, masked. The backward's stays 0 until timed: its second tile body spills (sm_90,
# 456 B of stack against 120 B). ``maxnreg``: a register cap; 168 keeps 3 programs of 4 warps per SM on sm_90 without
# spilling (Triton 3.6, the H200's, allocates 170 registers to the attention with the tail on and 181 to the route
# kernel with padding, which fit 2). Route at 128: 4 programs per SM (Triton 3.6: 104 B of stack; untimed). The
# backward takes 255 registers even with 32 x 32 tiles (the shared expert's state); capped at 168 it fits 3 programs
# per SM with 160 B (32 x 32) to 656 B (64 x 64) of stack (Triton 3.6; untimed).
CONFIG = {
    "route": dict(BS=16, num_warps=4, num_stages=1, maxnreg=168),
    "attn": dict(BM=64, BN=64, tail=1, num_warps=4, num_stages=2, maxnreg=168),
    "bwd": dict(BM=64, BN=64, tail=0, num_warps=4, num_stages=1, maxnreg=None),
}


def _cfg(name: str, NP: int) -> dict:
    """Launch keywords of a short-path kernel from CONFIG, block sizes capped at NP (the route kernel's rows per
    program at the padded landmark count: a larger BS would leave its grid empty); ``tail`` is :func:`_tail`'s;
    ``maxnreg`` None: no cap."""
    cfg = {
        k: (min(v, NP) if k in ("BM", "BN", "BS") else v)
        for k, v in CONFIG[name].items()
        if k not in ("tail", "maxnreg")
    }
    return {**cfg, **regs_cap(CONFIG[name].get("maxnreg"))}


def _tail(N: int, block: int, name: str) -> int:
    """Size of a separate last block after the whole blocks of ``block`` rows, or 0 for none (the last block is then
    a whole one, masked): N % block rounded up to a power of two (at least 16, the smallest tensor-core tile) when
    CONFIG[name]["tail"] is on and that is smaller than ``block``."""
    r = N % block
    t = max(16, _next_pow2(r))
    return t if CONFIG[name]["tail"] and r and t < block else 0


def _pads(N: int, m: int) -> tuple[int, int]:
    """Key and landmark counts padded to powers of two (at least 16, the smallest tensor-core tile)."""
    return max(16, _next_pow2(N)), max(16, _next_pow2(m))


@triton.jit
def _whole_blocks_end(N, BLOCK: tl.constexpr, LAST: tl.constexpr):
    """Where a loop over whole blocks of BLOCK rows stops: before a separate last block of LAST rows (N % BLOCK
    rounded up to a power of two, ``_tail``), or at N when LAST = 0 (its last block is then a whole one, masked)."""
    if LAST > 0:
        return (N // BLOCK) * BLOCK
    else:
        return N


@triton.jit
def _onehot_route(SCORE, o_j, m_j, ROUTE, o_i, m_i, i_bh, N, S: tl.constexpr, MP: tl.constexpr):
    """Top-S landmarks of each query row of SCORE [BM, MP] (ties to the lower index) as a 0/1 matrix; the picks
    are stored to ROUTE [BH, N, S] when ROUTE is given (forward)."""
    avail = m_j[None, :] & (SCORE == SCORE)
    b_oh = tl.zeros(SCORE.shape, tl.float32)
    for s in tl.static_range(S):
        b_x = tl.where(avail, SCORE, float("-inf"))
        t_max = tl.max(b_x, 1)
        t_arg = tl.min(tl.where(avail & (b_x == t_max[:, None]), o_j[None, :], MP), 1)
        tl.store(ROUTE + (i_bh * N + o_i) * S + s, t_arg, mask=m_i)
        hit = o_j[None, :] == t_arg[:, None]
        b_oh += hit.to(tl.float32)
        avail = avail & (~hit)
    return b_oh


@triton.jit
def _routed_logits(b_q, b_k, b_c, scale_log2, S: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """[BM, BN] log2-unit logits of the routed keys: ``q . k * scale`` plus log2 of the key's multiplicity c in the
    query's routed lists; -inf where c = 0 (the key is in none of them, or is padding). log2 c is exact without
    ``tl.log2`` (a libdevice routine of some thirty instructions per entry) for c <= 2: 0 with S = 1, c - 1 with S = 2
    (the same bits as log2)."""
    b_s = _dot(b_q, tl.trans(b_k), PREC, UP) * scale_log2
    if S == 2:
        b_s = b_s + (b_c - 1.0)
    elif S > 2:
        b_s = b_s + tl.log2(tl.maximum(b_c, 1.0))
    return tl.where(b_c > 0, b_s, float("-inf"))


@triton.jit
def _routed_p_ds(
    b_q, b_k, b_v, b_do, b_c, b_lse, b_delta, scale_log2, S: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr
):
    """Backward of the routed entries of a [BM queries, BN keys] tile: probabilities P (from the rows' LSE) and
    dS = P (dO v^T - delta)."""
    b_p = tl.exp2(_routed_logits(b_q, b_k, b_c, scale_log2, S, PREC, UP) - b_lse[:, None])
    return b_p, b_p * (_dot(b_do, tl.trans(b_v), PREC, UP) - b_delta[:, None])


@triton.jit
def _attn_keys(b_q, b_oh, K_h, V_h, MEMB_h, o_j, o_d, n0, N, SN, scale_log2, b_m, b_l, b_acc, NP: tl.constexpr,
               S: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):  # fmt: skip
    """The online softmax of BM queries (routes b_oh [BM, MP]) over keys n0 .. n0 + BN."""
    o_n = n0 + tl.arange(0, BN)
    m_n = o_n < N
    b_k = tl.load(K_h + o_n[:, None] * SN + o_d[None, :], mask=m_n[:, None], other=0.0)
    b_v = tl.load(V_h + o_n[:, None] * SN + o_d[None, :], mask=m_n[:, None], other=0.0)
    b_mb = tl.load(MEMB_h + o_j[:, None] * NP + o_n[None, :]).to(tl.float16)
    # [BM, BN] how many of the query's experts hold each key (0 for padding: it is in no list).
    b_c = tl.dot(b_oh, b_mb)
    b_s = _routed_logits(b_q, b_k, b_c, scale_log2, S, PREC, UP)
    return _softmax_step(b_s, b_v, b_m, b_l, b_acc, PREC, UP)


@triton.jit
def _small_route_kernel(
    R,
    K,
    V,
    KV,
    KK,
    MEMB,
    VT,
    LVLSE,
    N,
    M,
    TOPK,
    H,
    SB,
    SH,
    SN,
    scale_log2,
    SHARED: tl.constexpr,
    HAS_KV: tl.constexpr,
    D: tl.constexpr,
    MP: tl.constexpr,
    NP: tl.constexpr,
    BS: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
    EXACT: tl.constexpr,
):
    """BS landmark rows: exact top-k membership [BS, NP] and (SHARED) the landmark values and their LSE."""
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, D)
    o_j = i_s * BS + tl.arange(0, BS)
    m_j = o_j < M
    o_n = tl.arange(0, NP)
    m_n = _valid_keys(KV, i_bh, N, o_n, N, HAS_KV)
    kk = _head_kk(KK, i_bh, TOPK, HAS_KV)
    b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
    o_kv = o_n[:, None] * SN + o_d[None, :]
    b_k = tl.load(_head_ptr(K, i_bh, H, SB, SH) + o_kv, mask=m_n[:, None], other=0.0)
    # [BS, NP] raw scores: the top-k ranks them, the landmark values softmax them.
    b_sc = _score(b_r, b_k, PREC, UP, EXACT)

    # Exact top-k per landmark row (ties to the lower key index).
    sel = _topk_select(_order_key(b_sc), m_n[None, :] & m_j[:, None], m_j, kk)
    tl.store(MEMB + i_bh * MP * NP + o_j[:, None] * NP + o_n[None, :], sel.to(tl.int8))

    if SHARED:
        # Landmark values softmax(R k^T scale) v over the valid keys; zeros for a row with no valid key.
        b_v = tl.load(_head_ptr(V, i_bh, H, SB, SH) + o_kv, mask=m_n[:, None], other=0.0)
        b_s = tl.where(m_n[None, :], b_sc * scale_log2, float("-inf"))
        b_mx = tl.max(b_s, 1)
        b_mxs = tl.where(b_mx == float("-inf"), 0.0, b_mx)
        b_p = tl.exp2(b_s - b_mxs[:, None])
        b_l = tl.sum(b_p, 1)
        m_nz = b_l > 0
        b_vt = _dot(b_p.to(b_v.dtype), b_v, PREC, UP) / tl.where(m_nz, b_l, 1.0)[:, None]
        tl.store(VT + i_bh * M * D + o_j[:, None] * D + o_d[None, :], b_vt.to(b_v.dtype), mask=m_j[:, None])
        b_lse = tl.where(m_nz, b_mxs + tl.log2(tl.where(m_nz, b_l, 1.0)), float("-inf"))
        tl.store(LVLSE + i_bh * M + o_j, b_lse, mask=m_j)


@triton.jit
def _attn_rows(Q, K, V, R, VT, MEMB, O, LSE, ROUTE, i0, i_bh, N, M, H, SB, SH, SN, scale_log2, sscale_log2,
               S: tl.constexpr, SHARED: tl.constexpr, D: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
               EXACT: tl.constexpr):  # fmt: skip
    """The small attention kernel's work for query rows i0 .. i0 + BM of head i_bh."""
    o_d = tl.arange(0, D)
    o_j = tl.arange(0, MP)
    m_j = o_j < M
    o_i = i0 + tl.arange(0, BM)
    m_i = o_i < N
    K_h = _head_ptr(K, i_bh, H, SB, SH)
    V_h = _head_ptr(V, i_bh, H, SB, SH)
    MEMB_h = MEMB + i_bh * MP * NP
    b_q = tl.load(_head_ptr(Q, i_bh, H, SB, SH) + o_i[:, None] * SN + o_d[None, :], mask=m_i[:, None], other=0.0)
    b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
    # [BM, MP] raw q . R: routing, and (scaled) the shared logits.
    b_qr = _score(b_q, b_r, PREC, UP, EXACT)
    b_qr = tl.where(b_qr == 0.0, 0.0, b_qr)
    b_oh = _onehot_route(b_qr, o_j, m_j, ROUTE, o_i, m_i, i_bh, N, S, MP).to(tl.float16)
    if SHARED:
        b_vt = tl.load(VT + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
        b_a = tl.where(m_j[None, :], b_qr * sscale_log2, float("-inf"))
        b_m = tl.max(b_a, 1)
        b_pa = tl.exp2(b_a - b_m[:, None])
        b_l = tl.sum(b_pa, 1)
        b_acc = _dot(b_pa.to(b_vt.dtype), b_vt, PREC, UP)
    else:
        b_m = tl.full([BM], float("-inf"), tl.float32)
        b_l = tl.zeros([BM], tl.float32)
        b_acc = tl.zeros([BM, D], tl.float32)
    # Whole key blocks of BN, then (BT > 0) the last BT keys.
    n_end = _whole_blocks_end(N, BN, BT)
    for n0 in range(0, n_end, BN):
        b_m, b_l, b_acc = _attn_keys(
            b_q, b_oh, K_h, V_h, MEMB_h, o_j, o_d, n0, N, SN, scale_log2, b_m, b_l, b_acc, NP, S, BN, PREC, UP
        )
    if BT > 0:
        b_m, b_l, b_acc = _attn_keys(
            b_q, b_oh, K_h, V_h, MEMB_h, o_j, o_d, n_end, N, SN, scale_log2, b_m, b_l, b_acc, NP, S, BT, PREC, UP
        )
    m_nz = b_l > 0
    b_o = b_acc / tl.where(m_nz, b_l, 1.0)[:, None]
    O_h = _out_ptr(O, i_bh, H, N, D)
    tl.store(O_h + o_i[:, None] * (H * D) + o_d[None, :], b_o.to(O.dtype.element_ty), mask=m_i[:, None])
    b_lse = tl.where(m_nz, b_m + tl.log2(tl.where(m_nz, b_l, 1.0)), float("-inf"))
    tl.store(LSE + i_bh * N + o_i, b_lse, mask=m_i)


@triton.jit
def _small_attn_kernel(
    Q,
    K,
    V,
    R,
    VT,
    MEMB,
    O,
    LSE,
    ROUTE,
    N,
    M,
    H,
    SB,
    SH,
    SN,
    scale_log2,
    sscale_log2,
    S: tl.constexpr,
    SHARED: tl.constexpr,
    D: tl.constexpr,
    MP: tl.constexpr,
    NP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    TQ: tl.constexpr,
    BT: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
    EXACT: tl.constexpr,
):
    """BM queries (the last program: TQ, when TQ > 0): routing, then one online softmax over [m landmarks ; N keys
    weighted by their routed multiplicity], the keys in blocks of BN and a last block of BT."""
    i0 = tl.program_id(0) * BM
    i_bh = tl.program_id(1).to(tl.int64)
    if TQ > 0:
        if i0 + BM > N:
            _attn_rows(
                Q, K, V, R, VT, MEMB, O, LSE, ROUTE, i0, i_bh, N, M, H, SB, SH, SN, scale_log2, sscale_log2,
                S, SHARED, D, MP, NP, TQ, BN, BT, PREC, UP, EXACT,
            )  # fmt: skip
        else:
            _attn_rows(
                Q, K, V, R, VT, MEMB, O, LSE, ROUTE, i0, i_bh, N, M, H, SB, SH, SN, scale_log2, sscale_log2,
                S, SHARED, D, MP, NP, BM, BN, BT, PREC, UP, EXACT,
            )  # fmt: skip
    else:
        _attn_rows(
            Q, K, V, R, VT, MEMB, O, LSE, ROUTE, i0, i_bh, N, M, H, SB, SH, SN, scale_log2, sscale_log2,
            S, SHARED, D, MP, NP, BM, BN, BT, PREC, UP, EXACT,
        )  # fmt: skip


def small_fwd(q, k, v, r, key_valid, topk: int, S: int, shared: bool, scale: float, sscale: float):
    """Forward. q, k, v ``[BH, N, d]`` or ``[B, H, N, d]`` in one layout (``heads_layout``: read in place), r
    ``[BH, m, d]``, key_valid ``[BH, N]`` bool or int8 (1 = valid) or None.

    Returns:
        ``(o, lse, memb, route, vt, lvlse)``: output shaped as q in q's dtype, stored in ``[B, N, H, d]`` order
        (``out_layout``), float32 LSE (log2 units), the [BH, MP, NP] int8 membership of keys in each landmark's
        top-k, the [BH, N, S] int32 routes, the landmark values (r's dtype) and their float32 LSE.
    """
    lay = heads_layout(q, k, v)
    BH, M, D = r.shape
    N = q.shape[-2]
    dev = q.device
    NP, MP = _pads(N, M)
    o = out_layout(q)
    lse = torch.empty(BH, N, device=dev, dtype=torch.float32)
    memb = torch.empty(BH, MP, NP, device=dev, dtype=torch.int8)
    route = torch.empty(BH, N, S, device=dev, dtype=torch.int32)
    vt = torch.empty_like(r) if shared else r
    lvlse = torch.empty(BH, M, device=dev, dtype=torch.float32) if shared else lse
    kv = key_valid.to(torch.int8).contiguous() if key_valid is not None else q
    kk = _valid_counts(key_valid, topk) if key_valid is not None else q
    has_kv = key_valid is not None
    common = dict(
        SHARED=shared,
        D=D,
        MP=MP,
        NP=NP,
        PREC=_prec(q.dtype),
        UP=_upcast(q.dtype),
        EXACT=interpreting(),
    )
    cr, ca = _cfg("route", min(NP, MP)), _cfg("attn", NP)
    fast(_small_route_kernel)[(MP // cr["BS"], BH)](
        r, k, v, kv, kk, memb, vt, lvlse, N, M, topk, *lay, scale * LOG2E, HAS_KV=has_kv, **common, **cr
    )
    fast(_small_attn_kernel)[(_cdiv(N, ca["BM"]), BH)](
        q, k, v, r, vt, memb, o, lse, route, N, M, *lay, scale * LOG2E, sscale * LOG2E, S=S,
        TQ=_tail(N, ca["BM"], "attn"), BT=_tail(N, ca["BN"], "attn"), **common, **ca,
    )  # fmt: skip
    return o, lse, memb, route, vt, lvlse
