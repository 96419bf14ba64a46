"""The backward's per-key lists of routed rows (``_key_lists``): where ``BH * N * m * topk`` is large, the routed
dk / dv kernel writes each (expert, slot) row at its key's place, so that a key's rows are contiguous and in
ascending expert order, and the per-key reduction reads them as CSR ranges. The lists come from three launches:
the experts' bit masks per key (``_key_mask_kernel``; an OR of bits, the same whatever the programs' order), their
prefix counts (``_key_ptr_kernel``) and each slot's place (``_key_pos_kernel``). Smaller calls match each key
block against every expert's index list instead (no lists)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mita.ops.mita.triton.common import _cdiv, _next_pow2
from mita.ops.mita.triton.launch import fast


@triton.jit
def _popc32(x):
    # Set bits of each int32 (SWAR, on the unsigned word).
    u = x.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _expert_keys(IDX, i_bh, e, M, TOPK, KP: tl.constexpr):
    # Expert e's index list: slots [KP], their keys (0 where the slot has none) and which slots hold a key.
    o_p = tl.arange(0, KP)
    b_idx = tl.load(IDX + (i_bh * M + e) * TOPK + o_p, mask=o_p < TOPK, other=-1)
    m_p = b_idx >= 0
    return o_p, tl.where(m_p, b_idx, 0), m_p


@triton.jit
def _key_mask_kernel(IDX, MASK, N, M, TOPK, W: tl.constexpr, KP: tl.constexpr):
    # Per (expert, head): bit e % 32 of word e // 32 of each of the expert's keys (MASK [BH, N, W] int32, zeroed).
    # An OR is order-free, so the masks are the same whatever order the programs run in.
    e = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_p, j, m_p = _expert_keys(IDX, i_bh, e, M, TOPK, KP)
    at = MASK + (i_bh * N + j) * W + e // 32
    tl.atomic_or(at, tl.full([KP], 1, tl.int32) << (e % 32), mask=m_p)


@triton.jit
def _key_ptr_kernel(MASK, PTR, N, W: tl.constexpr, BC: tl.constexpr):
    # Per head: PTR[j] = routed (expert, slot) rows of the keys before j (the exclusive prefix of the masks' set
    # bits), PTR[N] = all of them.
    i_bh = tl.program_id(0).to(tl.int64)
    o_w = tl.arange(0, W)
    run = tl.zeros([], tl.int32)
    for n0 in range(0, N, BC):
        o_n = n0 + tl.arange(0, BC)
        m_n = o_n < N
        b_m = tl.load(MASK + (i_bh * N + o_n)[:, None] * W + o_w[None, :], mask=m_n[:, None], other=0)
        cnt = tl.sum(_popc32(b_m), 1)
        incl = tl.cumsum(cnt, 0)
        tl.store(PTR + i_bh * (N + 1) + o_n, run + incl - cnt, mask=m_n)
        run += tl.sum(cnt, 0)
    tl.store(PTR + i_bh * (N + 1) + N, run)


@triton.jit
def _key_pos_kernel(IDX, MASK, PTR, POS, N, M, TOPK, W: tl.constexpr, KP: tl.constexpr):
    # Per (expert, head): the place of slot (e, slot) holding key j in the keys' lists, POS[e * TOPK + slot] =
    # PTR[j] + (the experts below e that hold j): a key's rows in ascending expert order, as a stable sort of the
    # keys gives them. Slots without a key are not written.
    e = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_p, j, m_p = _expert_keys(IDX, i_bh, e, M, TOPK, KP)
    o_w = tl.arange(0, W)
    b_m = tl.load(MASK + (i_bh * N + j)[:, None] * W + o_w[None, :], mask=m_p[:, None], other=0)
    # The bits of the experts below e: whole words below e // 32, the low e % 32 bits of word e // 32.
    w_e = e // 32
    low = tl.where(o_w < w_e, -1, tl.where(o_w == w_e, (1 << (e % 32)) - 1, 0))
    rank = tl.sum(_popc32(b_m & low[None, :]), 1)
    pos = tl.load(PTR + i_bh * (N + 1) + j, mask=m_p, other=0) + rank
    tl.store(POS + (i_bh * M + e) * TOPK + o_p, pos, mask=m_p)


# Routed dk, dv rows are matched to their keys by comparing each key block with every expert's index list when
# BH * N * m * next_pow2(topk) is at most this; above it the CSR lists. On the H100 the lists took the backward of
# LRA ListOps (2.6e8) from 1.13 to 0.82 ms, of B 8 x H 2 x 4096 (6.7e7) from 0.26 to 0.19 and of 2 x 16K (1.3e8)
# from 0.23 to 0.17 (forward + backward, CUDA-graph replays); below 2^24 (two heads of up to 4K keys) the matching
# stays, untimed against the lists, which cost three more launches.
_MATCH_MAX = 1 << 24
# The lists' kernels up to this many keys (each head's prefix counts run in one program, a step per 1024 keys; at
# 2 x 16K they were timed above) and 128 experts; beyond, the places come from a stable sort of the keys, as the
# long-row benchmark (64K-1M) was timed with.
_LISTS_MAX_N = 16384


def _key_lists(idx: torch.Tensor, N: int):
    """How the per-key reduction finds a key's routed (expert, slot) rows -> (csr, ptr, pos, kp): by matching each
    key block against every expert's index list (csr False; the routed rows stay in (expert, slot) order; ptr and pos
    are idx, unused), or, when that costs more than ``_MATCH_MAX``, as CSR lists: the routed kernel writes slot
    (e, slot) to row ``pos[bh, e * topk + slot]`` (``[BH, m topk]`` int32), so key j's rows are rows ``ptr[bh, j]``
    to ``ptr[bh, j + 1]`` (``[BH, N + 1]`` int32), in ascending expert order. kp: the padded list length."""
    BH, m, topk = idx.shape
    kp = max(16, _next_pow2(topk))
    csr = BH * N * m * kp > _MATCH_MAX
    w = max(1, _next_pow2(_cdiv(m, 32)))
    dev = idx.device
    if csr and w <= 4 and N <= _LISTS_MAX_N:
        # Bit masks of the experts holding each key (m <= 128), their prefix counts, then each slot's place.
        mask = torch.zeros(BH, N, w, device=dev, dtype=torch.int32)
        ptr = torch.empty(BH, N + 1, device=dev, dtype=torch.int32)
        pos = torch.empty(BH, m * topk, device=dev, dtype=torch.int32)
        fast(_key_mask_kernel)[(m, BH)](idx, mask, N, m, topk, W=w, KP=kp, num_warps=2)
        fast(_key_ptr_kernel)[(BH,)](mask, ptr, N, W=w, BC=min(1024, max(16, _next_pow2(N))), num_warps=4)
        fast(_key_pos_kernel)[(m, BH)](idx, mask, ptr, pos, N, m, topk, W=w, KP=kp, num_warps=2)
    elif csr:
        # Long rows or more than 128 experts: the places from a stable sort of the keys.
        flat = idx.view(BH, m * topk).long()
        flat = torch.where(flat < 0, N, flat)
        sorted_idx, perm = torch.sort(flat, dim=-1, stable=True)
        ar = torch.arange(N + 1, device=dev, dtype=sorted_idx.dtype)
        ptr = torch.searchsorted(sorted_idx.contiguous(), ar.expand(BH, N + 1).contiguous()).to(torch.int32)
        pos = torch.empty(BH, m * topk, device=dev, dtype=torch.int32)
        pos.scatter_(1, perm, torch.arange(m * topk, device=dev, dtype=torch.int32).expand(BH, -1))
    else:
        ptr = pos = idx
    return csr, ptr, pos, kp
