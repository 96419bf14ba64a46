"""Triton kernels for MiTA's routing and landmark values: exact top-k, argmax routing, split-key landmark values.

- ``exact_topk``: per landmark, the k keys with the largest raw score ``R_i . k_j`` (ties to the lower key
  index), computed tile by tile without writing the [m, N] scores. Each score is mapped to an order-preserving
  int32 key. Short rows (N <= ``SMALL_N``) keep a [landmarks, N] tile on chip and find the k-th largest key by
  bisection over the 2^32 key range (32 counting steps in registers). Long rows: block tops (each key block's two
  largest scores and where its maximum sits); a start threshold that at least k keys reach (bisection over group
  maxima, one program per row); a sparse pass that gives every key at or above it a slot of its row's [cap]
  candidate list from a per-row atomic counter (the list's order does not matter: each entry is the packed int64
  (order key, reversed index)), reading the block tops: a block whose second score is below the threshold holds
  at most one such key, its maximum, so only blocks with two or more are scored again; a top-k of that list
  (bisection and one sort in one kernel). Rows with more than cap such keys (many ties, or a loose start) fall back
  on the device: 16-way refinement passes raise the threshold until at most cap keys reach it (or until it is the
  k-th key itself), then a counting pass and an emitting pass write the keys in key order (ties truncated to the lowest
  indices), all in one launch of persistent programs with grid barriers between the passes, which returns at once
  when no row needs it: no host synchronisation, and the result is exact for any input. With the landmark values
  (below), the final kernel also merges their partials.
- ``route_topk``: per query, the S landmarks with the largest ``q_n . R_i`` (first maximum on ties), in order.
- ``landmark_values``: ``softmax(R k^T s) v`` as a split-key (flash-decoding style) attention of m queries over
  N keys: each program takes a key chunk for a tile of landmarks and writes a partial (max, sum, accumulator);
  a merge kernel combines them. ``exact_topk(lv=...)`` computes the partials in its block-top pass instead, from
  the scores it already has. Its backward: one kernel for dk, dv (each key block loops over the landmarks),
  one for dR partials over key chunks, summed in a fixed order (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mita.ops.mita.launch import _interpreting, fast

LOG2E = 1.4426950408889634
# Rows up to this length take the on-chip top-k (if the [N, d] key tile stays within _SMALL_BYTES).
SMALL_N = 512
_SMALL_BYTES = 1 << 16
# Threshold candidates per refinement pass of the long-row top-k, and the number of passes (16^8 = 2^32).
_P = 16
_PASSES = 8
# Programs of a long-row scan pass (landmark tiles x key chunks), a few waves on 132 SMs.
_SCAN_PROGRAMS = 2048
# Long-row scan passes: keys per step (at most 128: where a block's maximum sits is kept as an int8), landmarks per
# tile (None: 64 for d <= 64, else 32), warps of the passes (one setting for all: the passes that score keys again
# must reproduce the block-top pass's scores to the bit; scripts/bench/tune_long.py sweeps them on the GPU).
# block_top = t > 1: the block-maximum pass keeps the t largest scores of each key block instead of its maximum, and
# the start threshold is the kk-th largest of all of them (still kk distinct keys reach it). When a landmark's top
# keys cluster in few blocks (neighbouring tokens alike) this start is much tighter. None (default): 2 when the
# start kernel takes every entry itself (N / bn * 2 <= _START_ENTRIES), else 1: beyond that it groups entries, which
# undoes the gain. Measured on the H200 (run 9, forward of B 1, H 2, d 64): AR(1)-correlated tokens (0.9) at 64K
# 1.49 -> 0.89 ms and at 256K 3.90 -> 1.87 ms (t = 2: no row overflows); i.i.d. tokens 0.91 -> 0.90 ms and
# 1.30 -> 1.36 ms; at 1M t = 2 and 4 were slower on both (the grouped start still overflows correlated rows).
# emit_top = 3: the block-top pass also keeps each block's third largest score and where its second sits, so the
# count + emit pass writes blocks with two keys at or above the start from the block tops too and scores again only
# blocks with three or more; 2: only blocks with one are written directly. None (default): _emit_top.
# maxnreg caps the block-top pass's registers per thread (more programs per SM; None: the compiler's choice; 96 and
# 80 changed nothing on the H200, run 15); start_warps / final_warps: warps of the start and final per-row kernels
# (None: by entries per row; 4 or 16 changed nothing), final_maxnreg the final kernel's register cap (None: 96 for
# lists of 128 to 512 entries, 4 warps: 161 -> 96 registers at 256 entries, 3 -> 5 programs per SM; top-k at 64K x
# 16 0.752 -> 0.731 ms; at 1M, 1024 entries and 8 warps, no gain; 0: none). emit_bb: key blocks whose tops the
# count + emit pass reads per step (None: up to 32, by chunk size; its block-top half then holds 255 registers with
# spills at 4 warps, 190 at 16; 16 and 8 timed in run 16: top-k at 64K x 16 -3%, at 1M +4%).
# final_sort: the final kernel orders the chosen indices by one tl.sort of its list (1) instead of ranks from
# pairwise comparisons (0; k^2 per row). Run 17: 107 -> 48 registers at 1M, top-k 1.555 -> 1.403 ms.
# lv_fused: when the caller wants the landmark values too (exact_topk(lv=...)), the block-top pass also computes
# their split-key partials from the same scores (one pass over the keys instead of two; 1, the default, or 0: the
# separate pass). The key chunks then number at most N / (lv_div * m), as the separate landmark-value pass's do, so
# the float32 partials take at most 2 / lv_div of k's memory. Run 17 on the H200, forward: 64K 0.222 -> 0.186 ms,
# 1M 4.678 -> 4.463; lv_div 8 the best of 2, 4, 8, 16.
# even (default 1): the block-top pass loads and reduces without masks when nothing needs one (no padding, whole
# tiles and steps: the same scores); run 18 on the H200 (CUDA graphs, one process), top-k 64K 0.112 -> 0.109 ms, 256K
# 0.339 -> 0.327, 1M 1.387 -> 1.267, 64K x 16 0.676 -> 0.646. lv_lazy (default 1): its landmark-value softmax
# rescales lazily (_softmax_lazy) with the scale in the exponent's FMA; top-k 1.267 -> 1.263 ms at 1M, 0.327 ->
# 0.322 at 256K, 0.109 -> 0.108 at 64K, 0.646 -> 0.644 at 64K x 16 (the same call).
# start_steps (default 20): bisection steps of the start threshold (32: the exact kk-th largest block top; fewer:
# that key rounded down to 2^(32 - steps) order-key units, i.e. by up to ~2^(9 - steps) of its value: a looser
# lower bound; keys at or above it are still >= kk, a few more of them are emitted). The start kernel's time is its
# steps (each a reduction over the row's entries); run 19 on the H200 (CUDA-graph forward, one process, i.i.d.
# tokens): 32 -> 20 steps 64K 0.164 -> 0.161 ms, 256K 0.710 -> 0.693, 1M 3.854 -> 3.802, 64K x 16 1.615 -> 1.589;
# AR(1) 0.9 tokens at 256K 0.998 -> 0.993, at 64K 0.293 -> 0.291 (1 of 256 rows overflowing with either, none
# elsewhere). 16 steps were no faster than 20 (call 2). start_narrow / final_narrow (default 1): the start and final
# kernels' bisections run over [min, max + 1) of the row's valid keys instead of the whole 32-bit range
# (_kth_largest_key_narrow): the same exact selection in fewer steps; run 19 call 3 (both off -> both on): 64K
# 0.164 -> 0.159-0.162 ms, 256K 0.694 -> 0.684-0.687, 1M 3.805 -> 3.789, 64K x 16 1.605 -> 1.568-1.582.
# fallback (default 1): the fallback rows' refinement passes, recount and ordered emit run in one launch of persistent
# programs with grid barriers (_topk_fallback_kernel), which returns at once when no row overflows; 0: ten launches
# of the scan kernel (each returning at once without overflow rows: ~2-3 us apiece inside a CUDA graph). fb_spin:
# how its grid barrier polls (_grid_barrier); fb_programs: at most this many programs (None: as many as the SMs hold
# at once, _resident_per_sm). The barrier needs every program resident at once: on a GPU share that reports more SMs
# than it runs (e.g. an MPS thread limit), set fb_programs to what it holds, or fallback 0.
# merge_in_final (default 1): with the fused landmark values, the final top-k kernel (one program per landmark)
# also merges their split-key partials (0: the merge kernel, one launch more).
# fused_select (default 1): the start, count + emit and final kernels as one kernel of one program per row
# (_topk_select_kernel): no atomics (each row's candidates go to its list in block order), two launches fewer; rows
# whose candidates overflow the list still take the fallback, then the final kernel for those rows only. 0: the
# three kernels. select_eb: blocks per step of its emission (None: up to 1024). Run 21 on the H200 (forward, CUDA
# graphs, one process, 0 -> 1): 64K 0.144 -> 0.128-0.129 ms, 256K 0.658 -> 0.619-0.626, 1M 3.742 -> 3.690-3.702;
# the three kernels took 37 us at 64K and 159 us at 256K (of which the count + emit pass 23 and 117; compiled for
# sm_90 it holds 255 registers with spills, and each candidate takes a slot by an atomic on its row's counter;
# which of the two costs more was not measured), the select kernel 19 and 116. AR(1) 0.9 tokens at 64K (one row
# overflows): 0.302 -> 0.308 ms.
# fb_final (with fused_select and the persistent fallback; 0: the final kernel for the fallback rows): 1: the
# fallback kernel also selects those rows' top-k after one more grid barrier, so no final kernel follows. Run 21 on
# the H200 (64K forward, CUDA graphs): 0.127-0.130 ms against 0.129 with the final kernel, i.e. level; run 22 (call
# 3, with the other run-22 defaults): 64K 0.115 -> 0.112, 256K 0.597 -> 0.590, 1M level; on by default since, its
# CUDA-graph replay test passed (call 4).
# tops_eq (default 1, run 22): the block-top pass takes each block top as a plain maximum, then the first key equal
# to it (_first_max), instead of one maximum-with-index reduction (whose combine compares values and indices per
# score), and with even and lv_lazy its landmark values reuse those maxima: the same tops and values to the bit;
# forward 64K 0.118 -> 0.115 ms, 256K 0.604 -> 0.599, 1M 3.648 -> 3.601. stages: the block-top pass's
# software-pipelining depth (None: Triton's default; 2 was slower, run 22). lv_lazy 2: the landmark values'
# softmax with the scale in the exponent's FMA, rescaled every block (_softmax_fma: no branch); None (default): 2
# up to 256K keys, else 1. final_narrow 2: the final per-row selection takes its threshold from one descending sort
# of the candidate list instead of a bisection (_final_row); None (default): 2 for lists of <= 256 entries.
SCAN_CONFIG = dict(
    bn=64, bs=None, num_warps=4, block_top=None, emit_top=None, maxnreg=None, start_warps=None, final_warps=None,
    final_maxnreg=None, emit_bb=None, lv_fused=1, lv_div=8, final_sort=1, even=1, lv_lazy=None, start_steps=20,
    start_narrow=1, final_narrow=None, fallback=1, merge_in_final=1, fb_spin=0,
    fb_programs=None, fused_select=1, select_eb=None, fb_final=1, tops_eq=1, stages=None,
)  # fmt: skip
# Entries (block maxima, or block tops) the start kernel holds per row; beyond it it takes maxima of groups.
_START_ENTRIES = 8192
# The routing kernel's tile (queries bm x landmarks bs) and warps; None: by S (route_topk). For GPU A/B runs
# (scripts/bench/ab_scan.py --sweep route.bm=64,128); every value gives the same routes.
# unmasked (default 1): loads without masks where N and m are multiples of the tiles (run 18, H200, forward as CUDA
# graphs in one process: 256K 0.720 -> 0.718 ms, 1M 3.891 -> 3.873, 64K x 16 1.635 -> 1.628, 64K 0.167 / 0.168).
# persistent (S = 1, one landmark tile, unmasked): programs per SM of a persistent routing kernel, each looping over
# query tiles with the landmark tile loaded once (0: one program per query tile), used where each program takes at
# most persistent_max tiles; stages: that loop's pipelining.
ROUTE_CONFIG = dict(
    bm=None, bs=None, num_warps=None, maxnreg=None, unmasked=1, persistent=2, persistent_max=4, stages=2
)  # fmt: skip
# Landmark-value forward kernel: warps (None: 8 for 128-landmark tiles, else 4) and register cap (None: the
# compiler's choice; 80 spilled in its key loop, 1.4-1.6x slower on the H200, run 15).
LV_CONFIG = dict(num_warps=None, maxnreg=None)


def _sm_count(dev: torch.device) -> int:
    # Streaming multiprocessors of a CUDA device (cached): the persistent fallback kernel's program count.
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(i)
    if n is None:
        n = _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return n


_SM_COUNT: dict = {}
# Programs of the persistent fallback kernel one SM holds at once, per device and constexpr settings
# (_resident_per_sm).
_FB_RESIDENT: dict = {}
_FB_RESIDENT_MAX = 2


def programs_per_sm(
    regs: int, smem: int, num_warps: int, sm_regs: int = 65536, sm_smem: int = 228 * 1024, sm_threads: int = 2048
) -> int:
    """Programs of a kernel (``regs`` registers per thread, ``smem`` bytes of shared memory, ``num_warps`` warps)
    that one SM holds at once: registers are allocated per warp in units of 256, each program reserves 1 KiB of
    shared memory besides its own, at most 32 programs; the defaults are an sm_90 SM's (H100 / H200)."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return min(sm_regs // (per_warp * num_warps), sm_smem // (smem + 1024), sm_threads // (32 * num_warps), 32)


def _resident_per_sm(compiled, num_warps: int, dev: torch.device) -> int:
    # Programs of a compiled kernel that one SM of dev holds at once, for every specialisation of its constexprs: 255
    # registers per thread (the most any specialisation can take; allocated per warp in units of 256), its shared
    # memory (set by the constexprs; 1 KiB reserved per program) and threads; at most _FB_RESIDENT_MAX; 1 when anything
    # needed is unknown.
    try:
        smem = int(compiled.metadata.shared)
        prop = torch.cuda.get_device_properties(dev)
        sm_regs, sm_smem = int(prop.regs_per_multiprocessor), int(prop.shared_memory_per_multiprocessor)
        sm_threads = int(prop.max_threads_per_multi_processor)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return 1
    return max(1, min(programs_per_sm(255, smem, num_warps, sm_regs, sm_smem, sm_threads), _FB_RESIDENT_MAX))


def regs_cap(maxnreg) -> dict:
    """Launch option capping a kernel's registers per thread (``maxnreg``), or none when the setting is None / 0."""
    return {"maxnreg": int(maxnreg)} if maxnreg else {}


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    # Host-side ceil division: triton.cdiv is a constexpr function in recent Triton, ~5 us per host call.
    return -(-a // b)


def heads_layout(*xs: torch.Tensor) -> tuple[int, int, int, int]:
    """``(H, sb, sh, sn)``: how the kernels find row n of head ``bh`` in tensors of one layout: at
    ``(bh // H) * sb + (bh % H) * sh + n * sn`` (elements; the feature dim is contiguous). Takes flattened heads
    ``[BH, N, d]`` (H = 1) or ``[B, H, N, d]`` with any batch, head and row strides, e.g. the q, k, v slices of a
    ``[B, N, 3, H, d]`` projection; every tensor given must have the same shape and strides."""
    x = xs[0]
    if any(y.shape != x.shape or y.stride() != x.stride() for y in xs[1:]) or x.stride(-1) != 1:
        raise ValueError("tensors of one layout must share shape and strides, with a contiguous last dim")
    if x.dim() == 3:
        return 1, x.stride(0), 0, x.stride(1)
    return x.shape[1], x.stride(0), x.stride(1), x.stride(2)


@triton.jit
def _head_ptr(X, i_bh, H, SB, SH):
    # First row of head i_bh (int64) in a tensor laid out as heads_layout describes.
    return X + (i_bh // H) * SB + (i_bh % H) * SH


@triton.jit
def _out_ptr(X, i_bh, H, N, D: tl.constexpr):
    # First row of head i_bh (int64) in an output stored in [B, N, H, D] order (rows H * D apart; flattened heads,
    # H = 1: [BH, N, D]).
    return X + (i_bh // H) * N * H * D + (i_bh % H) * D


def out_strides(q: torch.Tensor) -> tuple[int, ...]:
    """Strides of :func:`out_layout` for q's shape."""
    if q.dim() == 3:
        return (q.shape[1] * q.shape[2], q.shape[2], 1)
    B, H, N, D = q.shape
    return (N * H * D, D, H * D, 1)


def out_layout(q: torch.Tensor) -> torch.Tensor:
    """An empty output for queries q (``[BH, N, d]`` or ``[B, H, N, d]``) stored in ``[B, N, H, d]`` order, shaped
    as q: what _out_ptr addresses."""
    return q.new_empty_strided(q.shape, out_strides(q))


def grad_layouts(o: torch.Tensor, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """``(o, do, (sb, sh, sn))`` for the backward kernels: o in :func:`out_layout` (as the forward wrote it; a copy
    only if a caller changed its layout) and the upstream gradient read in place with its own batch, head and row
    strides (``_head_ptr``), copied only when its feature dim is not contiguous (e.g. an expanded scalar grad)."""
    if o.stride() != out_strides(o):
        o = out_layout(o).copy_(o)
    if do.stride(-1) != 1:
        do = do.contiguous()
    _, sb, sh, sn = heads_layout(do)
    return o, do, (sb, sh, sn)


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
def _softmax_step(b_s, b_v, b_m, b_l, b_acc, PREC: tl.constexpr, UP: tl.constexpr):
    # One key block of an online softmax in log2 units: logits b_s [X, Y] (-inf where masked), values b_v [Y, D],
    # running maximum b_m and sum b_l [X] and accumulator b_acc [X, D] -> (b_m, b_l, b_acc) after the block.
    b_mn = tl.maximum(b_m, tl.max(b_s, 1))
    b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    b_p = tl.exp2(b_s - b_ms[:, None])
    b_alpha = tl.exp2(b_m - b_ms)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v, PREC, UP)
    return b_mn, b_l, b_acc


@triton.jit
def _dot_acc(a, b, acc, PREC: tl.constexpr, UP: tl.constexpr):
    # acc + a @ b with the sum in the dot's accumulator.
    if UP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


# Lazy rescaling (_softmax_lazy): the reference maximum is raised only when a block's maximum passes it by more than
# this (log2 units), so unnormalised weights stay below 2^8.
_LAZY_TAU = tl.constexpr(8.0)


@triton.jit
def _softmax_lazy(b_s, scale, b_v, b_m, b_l, b_acc, PREC: tl.constexpr, UP: tl.constexpr):
    return _softmax_lazy_max(b_s, tl.max(b_s, 1), scale, b_v, b_m, b_l, b_acc, PREC, UP)


@triton.jit
def _softmax_lazy_max(b_s, b_smax, scale, b_v, b_m, b_l, b_acc, PREC: tl.constexpr, UP: tl.constexpr):
    # One key block of an online softmax in log2 units from raw scores b_s [X, Y] (-inf where masked) and a scale > 0
    # (logits b_s * scale: one FMA with the reference subtracted). The reference b_m [X] is raised, and b_l, b_acc
    # rescaled, only when some row's block maximum passes its reference by more than _LAZY_TAU: then every row takes
    # its running maximum. Otherwise the weights stay below 2^_LAZY_TAU and the [X, D] rescale is skipped. b_l and
    # b_acc are always relative to b_m, so (b_m, b_l, b_acc) is an exact state for any reference: output b_acc / b_l,
    # log-sum-exp b_m + log2(b_l), as _softmax_step's. b_smax: the row maxima of b_s (_softmax_lazy_max: from a
    # caller that has them).
    b_mx = b_smax * scale
    if tl.max((b_mx > b_m + _LAZY_TAU).to(tl.int32), 0) > 0:
        b_mn = tl.maximum(b_m, b_mx)
        b_alpha = tl.exp2(b_m - tl.where(b_mn == float("-inf"), 0.0, b_mn))
        b_l = b_l * b_alpha
        b_acc = b_acc * b_alpha[:, None]
        b_m = b_mn
    b_p = tl.exp2(b_s * scale - tl.where(b_m == float("-inf"), 0.0, b_m)[:, None])
    b_l = b_l + tl.sum(b_p, 1)
    b_acc = _dot_acc(b_p.to(b_v.dtype), b_v, b_acc, PREC, UP)
    return b_m, b_l, b_acc


@triton.jit
def _softmax_fma(b_s, scale, b_v, b_m, b_l, b_acc, PREC: tl.constexpr, UP: tl.constexpr):
    return _softmax_fma_max(b_s, tl.max(b_s, 1), scale, b_v, b_m, b_l, b_acc, PREC, UP)


@triton.jit
def _softmax_fma_max(b_s, b_smax, scale, b_v, b_m, b_l, b_acc, PREC: tl.constexpr, UP: tl.constexpr):
    # _softmax_step from raw scores b_s (-inf where masked) and a scale > 0: the running maximum is kept in logit
    # units (the raw row maximum times scale: the same value as the maximum of the scaled scores, as rounding is
    # monotone) and the scale goes into the exponent's FMA, so no per-score multiply; every block rescales. b_smax:
    # the row maxima of b_s (_softmax_fma_max: from a caller that has them).
    b_mn = tl.maximum(b_m, b_smax * scale)
    b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    b_p = tl.exp2(b_s * scale - b_ms[:, None])
    b_alpha = tl.exp2(b_m - b_ms)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v, PREC, UP)
    return b_mn, b_l, b_acc


@triton.jit
def _score(a, b, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr):
    # a [X, D] . b [Y, D] -> [X, Y] float32. EXACT (CPU interpreter): an elementwise product and sum, so equal
    # columns give bitwise-equal scores (a BLAS matmul need not); exact ties decide the top-k.
    if EXACT:
        return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], 2)
    else:
        return _dot(a, tl.trans(b), PREC, UP)


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
def _topk_select(b_key, m_v, m_j, kk):
    """Top-kk of each row of the int32 order keys b_key [R, L] among the entries m_v (rows m_j), ties to the lower
    column: a 0/1 [R, L] selection. The kk-th largest key is the largest t with count(key >= t) >= kk, found by
    bisection from [row min, row max + 1); a row stops as soon as count(key >= lo) == kk ({key >= lo} is then its
    top-kk), otherwise when hi = lo + 1, and the ties at lo are taken in column order."""
    lo = tl.min(tl.where(m_v, b_key, 2147483647), 1).to(tl.int64)
    hi = tl.max(tl.where(m_v, b_key, -2147483648), 1).to(tl.int64) + 1
    c_lo = tl.sum(m_v.to(tl.int32), 1)
    busy = m_j & (c_lo != kk) & (hi - lo > 1)
    while tl.max(busy.to(tl.int32), 0) > 0:
        mid = lo + (hi - lo) // 2
        c = tl.sum((m_v & (b_key >= mid[:, None])).to(tl.int32), 1)
        ok = busy & (c >= kk)
        lo = tl.where(ok, mid, lo)
        c_lo = tl.where(ok, c, c_lo)
        hi = tl.where(busy & (c < kk), mid, hi)
        busy = m_j & (c_lo != kk) & (hi - lo > 1)
    m_gt = m_v & (b_key > lo[:, None])
    m_eq = m_v & (b_key == lo[:, None])
    n_gt = tl.sum(m_gt.to(tl.int32), 1)
    tie_rank = tl.cumsum(m_eq.to(tl.int32), 1) - 1
    return m_gt | (m_eq & (tie_rank < (kk - n_gt)[:, None]))


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
    m_n = o_n < N
    if HAS_KV:
        m_n = m_n & (tl.load(KV + i_bh * N + o_n, mask=m_n, other=0) != 0)
    b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
    b_k = tl.load(
        _head_ptr(K, i_bh, H, SB, SH) + o_n.to(tl.int64)[:, None] * SN + o_d[None, :], mask=m_n[:, None], other=0.0
    )
    # [BS, NP] order keys of the raw scores; invalid keys take no part.
    b_key = _order_key(_score(b_r, b_k, PREC, UP, EXACT))
    m_v = m_n[None, :] & m_j[:, None]
    kk = _head_kk(KK, i_bh, KSEL, HAS_KV)
    sel = _topk_select(b_key, m_v, m_j, kk)
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

# Device copies of the pass constants, the order key of -inf and the empty candidate-list entry.
_NPASS = tl.constexpr(_PASSES)
_KEY_NEG_INF = tl.constexpr(-2139095041)
_EMPTY = tl.constexpr(-(2**63))


@triton.jit
def _clear_list(CAND, row, CAP, CB: tl.constexpr):
    # Empty the row's [CAP] candidate list.
    for c0 in range(0, CAP, CB):
        o_e = c0 + tl.arange(0, CB)
        tl.store(CAND + row * CAP + o_e, tl.full([CB], _EMPTY, tl.int64), mask=o_e < CAP)


@triton.jit
def _head_kk(KK, i_bh, ksel, HAS_KV: tl.constexpr):
    # Keys each landmark of head i_bh keeps: the head's valid-key count clamped to ksel (KK) with padding, else ksel.
    if HAS_KV:
        kk = tl.load(KK + i_bh)
    else:
        kk = ksel
    return kk


@triton.jit
def _narrow(lo, hi, p, P: tl.constexpr):
    # [t_p, t_{p+1}) of the P sub-ranges of [lo, hi), t_p = lo + (hi - lo) * p // P (the last one ends at hi).
    t_lo = lo + ((hi - lo) * p) // P
    t_hi = tl.where(p + 1 < P, lo + ((hi - lo) * (p + 1)) // P, hi)
    return t_lo, t_hi


@triton.jit
def _kth_largest_key(key, valid, kk, LO: tl.constexpr, HI: tl.constexpr, STEPS: tl.constexpr):
    # The largest t in [LO, HI) (a range of 2^32 values: int32 order keys, or 32-bit words) with count(valid &
    # key >= t) >= kk, i.e. the kk-th largest key of the 1-D entries valid, by bisection (STEPS = 32 steps); LO when
    # fewer than kk entries are valid, HI - 1 when kk <= 0 (int64). With STEPS < 32 the bisection stops early: t is
    # then that key rounded down to a multiple of 2^(32 - STEPS) above LO (HI - 2^(32 - STEPS) when kk <= 0), still
    # with count(key >= t) >= kk: a lower bound, as the long-row top-k's start threshold may be. (A radix select by
    # four 8-bit tl.histogram rounds was slower on the H200: run 13.)
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
    CMAX, KK, LO, HI, CNT, row, M, NB, NBLK, ksel, nrows, HAS_KV: tl.constexpr, F: tl.constexpr, GP: tl.constexpr,
    P: tl.constexpr, ONE_PLANE: tl.constexpr, STEPS: tl.constexpr, NARROW: tl.constexpr,
):  # fmt: skip
    # Row row's start threshold lo = the largest order key t that kk maxima of groups of F entries reach (so kk
    # distinct keys reach it; rounded down when STEPS < 32, see _kth_largest_key), hi = just above the row maximum,
    # stored as state slot 0 of the refinement (LO, HI); its refinement counts start at zero. Entries: the NB = t *
    # NBLK first of the block-top planes (t = 1: the block maxima; t = 2: also each block's second largest score),
    # entry e in plane e // NBLK. Returns lo (int64).
    kk = _head_kk(KK, row // M, ksel, HAS_KV)
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
def _topk_start_kernel(
    CMAX, KK, LO, HI, OFF, CNT, CAND, M, NB, NBLK, CAP, ksel, nrows, HAS_KV: tl.constexpr, F: tl.constexpr,
    GP: tl.constexpr, P: tl.constexpr, CB: tl.constexpr, ONE_PLANE: tl.constexpr, STEPS: tl.constexpr,
    NARROW: tl.constexpr,
):  # fmt: skip
    # One row per program: the start threshold and state slot 0 (_start_row); the row's slot counter and candidate
    # list start empty.
    row = tl.program_id(0).to(tl.int64)
    _start_row(CMAX, KK, LO, HI, CNT, row, M, NB, NBLK, ksel, nrows, HAS_KV, F, GP, P, ONE_PLANE, STEPS, NARROW)
    tl.store(OFF + row, 0)
    if row == 0:
        # The persistent fallback kernel's barrier counter.
        tl.store(OFF + nrows, 0)
    _clear_list(CAND, row, CAP, CB)


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
    m_n = o_n < n1
    if HAS_KV:
        m_n = m_n & (tl.load(KV + i_bh * N + o_n, mask=m_n, other=0) != 0)
    b_k = tl.load(K_h + o_n.to(tl.int64)[:, None] * SN + o_d[None, :], mask=m_n[:, None], other=0.0)
    return m_n, _score(b_r, b_k, PREC, UP, EXACT)


@triton.jit
def _topk_scan_body(
    i_s,
    i_g,
    i_bh,
    R,
    K,
    KV,
    KK,
    LO,
    HI,
    DONE,
    CMAX,
    ARG,
    CNT,
    OFF,
    CAND,
    V,
    PM,
    PL,
    PACC,
    scale_log2,
    N,
    M,
    CH,
    G,
    NBLK,
    CAP,
    ksel,
    H,
    SB,
    SH,
    SN,
    nrows,
    i_pass,
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
    TOPT: tl.constexpr,
    BB: tl.constexpr,
    BG: tl.constexpr,
    E3: tl.constexpr,
    LVF: tl.constexpr,
    EVEN: tl.constexpr,
    LAZY: tl.constexpr,
    CM: tl.constexpr,
    EQ: tl.constexpr = 0,
):
    # One program per (landmark tile, key chunk, batch-head); rows are landmarks (row = bh * M + landmark).
    # EVEN (MODE 0): no padding, M % BS == 0 and every chunk a whole number of BG-block steps within N: the key
    # blocks load and the block tops reduce without masks. LAZY (MODE 0, LVF): the landmark values' online softmax is
    # _softmax_lazy's. EQ (MODE 0): each block top by a plain maximum and the first key equal to it (_first_max)
    # instead of one maximum-with-index reduction; with EVEN and LAZY the landmark values reuse the block maxima.
    # MODE 0: the TOPT >= 2 largest scores of each key block per landmark (ties: distinct keys) -> CMAX [TOPT,
    #         rows, NBLK] (plane t: the (t+1)-th largest), and where in its block the largest is -> ARG [rows, NBLK]
    #         (int8; the first such key). E3 (TOPT >= 3): also where the second largest is -> ARG plane 1.
    # MODE 4: every key >= lo (slot 0) takes a slot of its row's list from the row's atomic counter OFF and is
    #         written there as one packed int64 (slots past CAP are dropped; the counter ends as the count). The
    #         list's order does not matter: the final top-k orders by the packed value. Sparse: reads the block
    #         tops of BB blocks at a time, not the keys. A block whose second largest score is below the
    #         threshold holds at most one key at or above it, its maximum, written from (CMAX, ARG) as they are;
    #         only blocks whose second score reaches it are scored again (the same dot as MODE 0, so the same
    #         scores to the bit) for the rows that need it. E3: a block whose third largest score is below the
    #         threshold holds at most two such keys, also written from the block tops; only blocks with three or
    #         more are scored again.
    # LVF (MODE 0): the same scores also give the landmark values' split-key partials of this chunk, softmax(s *
    #         scale) v as (max, sum, accumulator) in log2 units -> PM, PL [BH, G, M], PACC [BH, G, M, D] (merged by
    #         _lv_merge_kernel), so the keys are scored once for both.
    # Rows with more than CAP such keys (fallback rows, OFF > CAP) then take the refinement path:
    # MODE 1: refinement pass i_pass: counts of keys >= each of P thresholds in [lo, hi) -> CNT[i_pass, row, P].
    # MODE 2: final state (slot i_pass: _NPASS, or the pass after the last one the persistent kernel ran), empty
    #         candidate lists, per key chunk the count of keys >= hi and of keys
    #         in [lo, hi) -> CNT tail [rows, G, 2].
    # MODE 3: from the final state (slot i_pass), write the candidates (>= hi first, then [lo, hi), both in key
    #         order, truncated at CAP).
    # SKIP (modes 1-3): landmark tiles without a fallback row do nothing.
    o_d = tl.arange(0, D)
    o_j = i_s * BS + tl.arange(0, BS)
    m_j = o_j < M
    row = i_bh * M + o_j
    active = tl.sum(m_j.to(tl.int32), 0) > 0
    if MODE != 0 and MODE != 4:
        fb = m_j & (tl.load(OFF + row, mask=m_j, other=0) > CAP)
        if SKIP:
            active = tl.sum(fb.to(tl.int32), 0) > 0
    if active:
        n0 = i_g * CH
        n1 = tl.minimum(n0 + CH, N)
        if MODE != 0:
            kk = _head_kk(KK, i_bh, ksel, HAS_KV)
            if MODE == 4:
                b_lo64 = tl.load(LO + row, mask=m_j, other=0)
                b_hi64 = b_lo64
                need = m_j
                b_tf = _key_threshold(b_lo64)
            elif MODE == 1:
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
                    for c0 in range(0, CAP, BN):
                        o_e = c0 + tl.arange(0, BN)
                        tl.store(
                            CAND + row[:, None] * CAP + o_e[None, :],
                            tl.full([BS, BN], _EMPTY, tl.int64),
                            mask=fb[:, None] & (o_e < CAP)[None, :],
                        )
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
        if MODE == 3:
            # This chunk's write offsets: the counts of the earlier chunks (keys >= hi of all chunks come first).
            CC = CNT + _NPASS * nrows * P
            w_hi = tl.zeros([BS], tl.int32)
            w_band = tl.zeros([BS], tl.int32)
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
        if active:
            b_r = tl.load(R + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None], other=0.0)
            K_h = _head_ptr(K, i_bh, H, SB, SH)
            PS = (i_bh * 0 + nrows) * NBLK  # plane stride of CMAX (int64: rows x blocks may pass 2^31)
            if MODE == 4:
                t_f = b_tf[:, None]
                for b0 in range(n0 // BN, (n1 + BN - 1) // BN, BB):
                    o_b = b0 + tl.arange(0, BB)
                    m_e = need[:, None] & (o_b < (n1 + BN - 1) // BN)[None, :]
                    e_at = row[:, None] * NBLK + o_b[None, :]
                    e_max = tl.load(CMAX + e_at, mask=m_e, other=float("-inf"))
                    e_sec = tl.load(CMAX + PS + e_at, mask=m_e, other=float("-inf"))
                    # Blocks with exactly one key >= t: their maximum (the first key holding it; unique, as the
                    # second score is below it). (The offset of masked-off lanes only keeps the pointer tile from
                    # being a broadcast, which triton 3.8 rejects for atomics.)
                    one = m_e & (e_max >= t_f) & (e_sec < t_f)
                    e_n = o_b[None, :] * BN + tl.load(ARG + e_at, mask=m_e, other=0).to(tl.int32)
                    packed = _pack_key(e_max, e_n)
                    if E3:
                        # ... and blocks with exactly two: their maximum and their second (two slots at once).
                        e_thr = tl.load(CMAX + 2 * PS + e_at, mask=m_e, other=float("-inf"))
                        two = m_e & (e_sec >= t_f) & (e_thr < t_f)
                        emit = one | two
                        slot = tl.atomic_add(
                            OFF + row[:, None] + tl.where(emit, 0, o_b[None, :]),
                            tl.where(two, 2, 1),
                            mask=emit,
                            sem="relaxed",
                        )
                        tl.store(CAND + row[:, None] * CAP + slot, packed, mask=emit & (slot < CAP))
                        e_n2 = o_b[None, :] * BN + tl.load(ARG + PS + e_at, mask=m_e, other=0).to(tl.int32)
                        packed2 = _pack_key(e_sec, e_n2)
                        tl.store(CAND + row[:, None] * CAP + slot + 1, packed2, mask=two & (slot + 1 < CAP))
                        # Blocks with three or more: score them again, for the rows that need it.
                        more = (m_e & (e_thr >= t_f)).to(tl.int32)
                    else:
                        slot = tl.atomic_add(
                            OFF + row[:, None] + tl.where(one, 0, o_b[None, :]), 1, mask=one, sem="relaxed"
                        )
                        tl.store(CAND + row[:, None] * CAP + slot, packed, mask=one & (slot < CAP))
                        # Blocks with two or more: score them again, for the rows that need it.
                        more = (m_e & (e_sec >= t_f)).to(tl.int32)
                    b_more = tl.max(more, 0)  # [BB]: does any row need block j scored again
                    if tl.max(b_more, 0) > 0:
                        o_c = tl.arange(0, BB)
                        for j in range(BB):
                            if tl.max(tl.where(o_c == j, b_more, 0), 0) > 0:
                                m_row = tl.max(tl.where(o_c[None, :] == j, more, 0), 1) > 0
                                o_n = (b0 + j) * BN + tl.arange(0, BN)
                                m_n, b_sc = _key_block_scores(
                                    b_r, K_h, KV, i_bh, N, o_n, n1, SN, o_d, HAS_KV, PREC, UP, EXACT
                                )
                                m_c = m_row[:, None] & m_n[None, :] & (b_sc >= t_f)
                                r_slot = tl.atomic_add(
                                    OFF + row[:, None] + tl.where(m_c, 0, o_n[None, :]), 1, mask=m_c, sem="relaxed"
                                )
                                r_packed = _pack_key(b_sc, o_n[None, :])
                                tl.store(CAND + row[:, None] * CAP + r_slot, r_packed, mask=m_c & (r_slot < CAP))
            if MODE == 0:
                # BG key blocks per step: their tops gather in [BS, BG] registers and are stored at once (one store
                # per row and plane instead of one per block).
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
                    if E3:
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
                            if EQ:
                                b_max = tl.max(b_x, 1)
                            if LVF:
                                b_v = tl.load(V_h + o_n.to(tl.int64)[:, None] * SN + o_d[None, :])
                                if LAZY == 2 and EQ:
                                    l_m, l_l, l_acc = _softmax_fma_max(
                                        b_sc, b_max, scale_log2, b_v, l_m, l_l, l_acc, PREC, UP
                                    )
                                elif LAZY == 2:
                                    l_m, l_l, l_acc = _softmax_fma(b_sc, scale_log2, b_v, l_m, l_l, l_acc, PREC, UP)
                                elif LAZY and EQ:
                                    l_m, l_l, l_acc = _softmax_lazy_max(
                                        b_sc, b_max, scale_log2, b_v, l_m, l_l, l_acc, PREC, UP
                                    )
                                elif LAZY:
                                    l_m, l_l, l_acc = _softmax_lazy(b_sc, scale_log2, b_v, l_m, l_l, l_acc, PREC, UP)
                                else:
                                    l_m, l_l, l_acc = _softmax_step(b_sc * scale_log2, b_v, l_m, l_l, l_acc, PREC, UP)
                        else:
                            m_n, b_sc = _key_block_scores(
                                b_r, K_h, KV, i_bh, N, o_n, n1, SN, o_d, HAS_KV, PREC, UP, EXACT
                            )
                            if LVF:
                                b_v = tl.load(V_h + o_n.to(tl.int64)[:, None] * SN + o_d[None, :], mask=m_n[:, None],
                                              other=0.0)  # fmt: skip
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
                            if EQ:
                                b_max = tl.max(b_x, 1)
                        # The maximum and the first key holding it; that key dropped, the second largest (ties count
                        # as the keys they are).
                        o_k = tl.arange(0, BN)
                        if EQ:
                            c_i = _first_max(b_x, b_max, o_k, BN)
                        else:
                            b_max, c_i = tl.max(b_x, 1, return_indices=True, return_indices_tie_break_left=True)
                        b_x = tl.where(o_k[None, :] == c_i[:, None], float("-inf"), b_x)
                        sel = o_c[None, :] == j
                        if E3:
                            # The second with its position; that key dropped too, the third.
                            if EQ:
                                b_sec = tl.max(b_x, 1)
                                c_2 = _first_max(b_x, b_sec, o_k, BN)
                            else:
                                b_sec, c_2 = tl.max(b_x, 1, return_indices=True, return_indices_tie_break_left=True)
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
                        for t in tl.static_range(2 + E3, TOPT):
                            # Further planes (block_top > 2): stored per block.
                            c_n = tl.min(tl.where(b_x == b_top[:, None], o_n[None, :], N), 1)
                            b_x = tl.where(o_n[None, :] == c_n[:, None], float("-inf"), b_x)
                            b_top = tl.max(b_x, 1)
                            tl.store(CMAX + t * PS + row * NBLK + n_b // BN, b_top, mask=m_j & (n_b < n1))
                    o_e = g0 // BN + o_c
                    e_at = row[:, None] * NBLK + o_e[None, :]
                    m_e = m_j[:, None] & (o_e < nb1)[None, :]
                    tl.store(CMAX + e_at, a_max, mask=m_e)
                    tl.store(CMAX + PS + e_at, a_sec, mask=m_e)
                    tl.store(ARG + e_at, a_arg.to(tl.int8), mask=m_e)
                    if E3:
                        tl.store(CMAX + 2 * PS + e_at, a_thr, mask=m_e)
                        tl.store(ARG + PS + e_at, a_arg2.to(tl.int8), mask=m_e)
                if LVF:
                    o_w = (i_bh * G + i_g) * M + o_j
                    tl.store(PM + o_w, l_m, mask=m_j)
                    tl.store(PL + o_w, l_l, mask=m_j)
                    tl.store(PACC + o_w[:, None] * D + o_d[None, :], l_acc, mask=m_j[:, None])
            if MODE != 4 and MODE != 0:
                for n_b in range(n0, n1, BN):
                    o_n = n_b + tl.arange(0, BN)
                    m_n, b_sc = _key_block_scores(b_r, K_h, KV, i_bh, N, o_n, n1, SN, o_d, HAS_KV, PREC, UP, EXACT)
                    b_key = _order_key(b_sc)
                    m_lo = need[:, None] & m_n[None, :] & (b_key >= b_lo[:, None])
                    if tl.sum(m_lo.to(tl.int32)) > 0:
                        # (order key, reversed index): one int64 whose order is score desc, index asc.
                        packed = (b_key.to(tl.int64) << 32) + (0xFFFFFFFF - o_n.to(tl.int64))[None, :]
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
                                tl.store(CAND + row[:, None] * CAP + pos, packed, mask=m_lo & (pos < CAP))
                            c_hi += tl.sum(m_hi.to(tl.int32), 1)
                            c_band += tl.sum(m_band.to(tl.int32), 1)
            if MODE == 1:
                o_p2 = tl.arange(0, P)
                tl.atomic_add(
                    CNT + (i_pass * nrows + row)[:, None] * P + o_p2[None, :],
                    b_cnt,
                    mask=need[:, None],
                    sem="relaxed",
                )
            if MODE == 2:
                CC2 = CNT + _NPASS * nrows * P
                tl.store(CC2 + (row * G + i_g) * 2, c_hi, mask=need)
                tl.store(CC2 + (row * G + i_g) * 2 + 1, c_band, mask=need)


@triton.jit
def _topk_scan_kernel(
    R, K, KV, KK, LO, HI, DONE, CMAX, ARG, CNT, OFF, CAND, V, PM, PL, PACC, scale_log2, N, M, CH, G, NBLK, CAP, ksel,
    H, SB, SH, SN, nrows, i_pass, MODE: tl.constexpr, P: tl.constexpr, SKIP: tl.constexpr, HAS_KV: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr,
    TOPT: tl.constexpr, BB: tl.constexpr, BG: tl.constexpr, E3: tl.constexpr, LVF: tl.constexpr, EVEN: tl.constexpr,
    LAZY: tl.constexpr, EQ: tl.constexpr = 0,
):  # fmt: skip
    # One program per (landmark tile, key chunk, batch-head): _topk_scan_body.
    _topk_scan_body(
        tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64), R, K, KV, KK, LO, HI, DONE, CMAX, ARG, CNT,
        OFF, CAND, V, PM, PL, PACC, scale_log2, N, M, CH, G, NBLK, CAP, ksel, H, SB, SH, SN, nrows, i_pass, MODE, P,
        SKIP, HAS_KV, D, BS, BN, PREC, UP, EXACT, TOPT, BB, BG, E3, LVF, EVEN, LAZY, "", EQ,
    )  # fmt: skip


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
    pid, NPROG, n_s, BH, R, K, KV, KK, LO, HI, DONE, CNT, OFF, CAND, N, M, CH, G, NBLK, CAP, ksel, H, SB, SH, SN, nrows,
    i_pass, MODE: tl.constexpr, P: tl.constexpr, HAS_KV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    # One fallback pass (_topk_scan_body's MODE 1, 2 or 3) over program pid's share of the (landmark tile, key chunk,
    # batch-head) items, items pid, pid + NPROG, ...; the state other programs wrote is read from L2 (".cg").
    for it in range(pid, n_s * G * BH, NPROG):
        _topk_scan_body(
            (it // G) % n_s, it % G, (it // (G * n_s)).to(tl.int64), R, K, KV, KK, LO, HI, DONE, R, R, CNT, OFF, CAND,
            R, R, R, R, 1.0, N, M, CH, G, NBLK, CAP, ksel, H, SB, SH, SN, nrows, i_pass, MODE, P, True, HAS_KV, D, BS,
            BN, PREC, UP, EXACT, 1, 2, 1, 0, False, False, False, ".cg",
        )  # fmt: skip


@triton.jit
def _topk_fallback_kernel(
    R, K, KV, KK, LO, HI, DONE, CNT, OFF, CAND, IDX, N, M, CH, G, NBLK, CAP, ksel, H, SB, SH, SN, nrows, n_s, BH,
    NPROG, P: tl.constexpr, HAS_KV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr, RB: tl.constexpr, SPIN: tl.constexpr,
    FINAL: tl.constexpr, CP: tl.constexpr, KP: tl.constexpr, CB: tl.constexpr, SORT: tl.constexpr,
    FNARROW: tl.constexpr,
):  # fmt: skip
    # The long-row top-k's fallback (refinement passes, recount, ordered emit: _topk_scan_body's modes 1-3) in one
    # launch of NPROG persistent programs (no more than the SMs hold at once, so all are resident; 1 under the
    # interpreter, which runs programs one after another). Each program first checks every row's count (OFF, final
    # since the count + emit pass): when no row has more than CAP, all return at once, which is the common case.
    # Otherwise the programs take the (landmark tile, key chunk, batch-head) items of each pass in turn, with a grid
    # barrier between passes (the counter is OFF[nrows], zeroed by the start kernel); every program passes every
    # barrier.
    # The refinement stops after the first pass whose state has every fallback row done (the recount and the
    # ordered emit then read the slot after it), so a row that settles in a few passes costs a few barriers.
    # FINAL (with the select kernel): after one more barrier the programs also select the fallback rows' top-k
    # (_final_row; CP, KP, CB, SORT, FNARROW as the final kernel's), so no final kernel follows.
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
                pid, NPROG, n_s, BH, R, K, KV, KK, LO, HI, DONE, CNT, OFF, CAND, N, M, CH, G, NBLK, CAP, ksel, H, SB,
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
            pid, NPROG, n_s, BH, R, K, KV, KK, LO, HI, DONE, CNT, OFF, CAND, N, M, CH, G, NBLK, CAP, ksel, H, SB, SH,
            SN, nrows, fin, 2, P, HAS_KV, D, BS, BN, PREC, UP, EXACT,
        )  # fmt: skip
        _grid_barrier(BAR, n_bar + NPROG, SPIN)
        _fallback_items(
            pid, NPROG, n_s, BH, R, K, KV, KK, LO, HI, DONE, CNT, OFF, CAND, N, M, CH, G, NBLK, CAP, ksel, H, SB, SH,
            SN, nrows, fin, 3, P, HAS_KV, D, BS, BN, PREC, UP, EXACT,
        )  # fmt: skip
        if FINAL:
            # The fallback rows' top-k (the select kernel did the others'), rows in turn, once every list is
            # written; other programs wrote them: loaded from L2.
            _grid_barrier(BAR, n_bar + 2 * NPROG, SPIN)
            for r_i in range(pid, nrows, NPROG):
                row = r_i + tl.zeros([], tl.int64)
                if tl.load(OFF + row) > CAP:
                    _final_row(CAND, IDX, row, CAP, ksel, CAP, CP, KP, CB, SORT, FNARROW, ".cg")


@triton.jit
def _final_row(
    CAND, IDX, row, LIM, KSEL, CAP, CP: tl.constexpr, KP: tl.constexpr, CB: tl.constexpr, SORT: tl.constexpr,
    NARROW: tl.constexpr, CM: tl.constexpr,
):  # fmt: skip
    # Row row's KSEL largest packed entries among the first min(LIM, CAP) of its candidate list (score desc, index
    # asc; fewer when the list holds fewer valid keys; the entries past them read as empty), their key indices
    # ascending, then -1. The selection (NARROW 0 / 1): the threshold key t (_kth_largest_key, over the whole range
    # or the list's own), then, unless every entry at t is taken, the lowest indices among them (the same helper on
    # the low word); NARROW 2: the KSEL-th largest packed entry from one descending sort. The order: one sort of
    # the list (SORT) or ranks from pairwise comparisons. CM: the list's cache modifier (".cg" where other programs
    # of the same launch wrote it).
    o_c = tl.arange(0, CP)
    c = tl.load(CAND + row * CAP + o_c, mask=o_c < tl.minimum(LIM, CAP), other=_EMPTY, cache_modifier=CM)
    valid = c != _EMPTY
    n_sel = tl.minimum(tl.sum(valid.to(tl.int32), 0), KSEL)
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
    base = IDX + row * KSEL
    if SORT:
        # The chosen indices ascending by one sort of the list (the others as INT32_MAX, after them), then -1.
        srt = tl.sort(tl.where(sel, (0xFFFFFFFF - c_low).to(tl.int32), 2147483647), 0)
        tl.store(base + o_c, tl.where(o_c < n_sel, srt, -1), mask=o_c < KSEL)
    else:
        # Compact the n_sel chosen indices into the output row (list order), then write each at its rank.
        pos = tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(base + pos, (0xFFFFFFFF - c_low).to(tl.int32), mask=sel)
        tl.debug_barrier()
        o_k = tl.arange(0, KP)
        x = tl.load(base + o_k, mask=o_k < n_sel, other=2147483647)
        rank = tl.zeros([KP], tl.int32)
        for j0 in range(0, n_sel, CB):
            o_i = j0 + tl.arange(0, CB)
            x_j = tl.load(base + o_i, mask=o_i < n_sel, other=2147483647)
            rank += tl.sum((x_j[None, :] < x[:, None]).to(tl.int32), 1)
        tl.debug_barrier()
        tl.store(base + rank, x, mask=o_k < n_sel)
        tl.store(base + o_k, tl.full([KP], -1, tl.int32), mask=(o_k >= n_sel) & (o_k < KSEL))


@triton.jit
def _topk_final_kernel(
    CAND, IDX, KSEL, CAP, PM, PL, PACC, VT, LSE, OFF, M, NC, CP: tl.constexpr, KP: tl.constexpr, CB: tl.constexpr,
    SORT: tl.constexpr, NARROW: tl.constexpr, MERGE: tl.constexpr, D: tl.constexpr, BC: tl.constexpr,
    FB_ONLY: tl.constexpr,
):  # fmt: skip
    # One row per program: the top-k of its candidate list (_final_row). MERGE: the row's landmark values from their
    # NC split-key partials first (_lv_merge_row: one launch fewer). FB_ONLY: only the rows with more than CAP
    # candidates (OFF; the others were selected by _topk_select_kernel).
    row = tl.program_id(0).to(tl.int64)
    if MERGE:
        _lv_merge_row(PM, PL, PACC, VT, LSE, row % M, row // M, M, NC, D, BC)
    take = True
    if FB_ONLY:
        take = tl.load(OFF + row) > CAP
    if take:
        _final_row(CAND, IDX, row, CAP, KSEL, CAP, CP, KP, CB, SORT, NARROW, "")


@triton.jit
def _emit_row(
    R, K, KV, CMAX, ARG, CAND, row, lo, N, M, NBLK, CAP, H, SB, SH, SN, nrows, HAS_KV: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr, E3: tl.constexpr,
    EB: tl.constexpr,
):  # fmt: skip
    # The count + emit pass (_topk_scan_body's MODE 4) for one row, without atomics: every key with order key >= lo
    # goes to the row's candidate list in block order (positions from prefix sums; those past CAP are dropped) and
    # the count is returned. A block whose second largest score is below the threshold holds at most one such key,
    # its maximum, written from the block tops (CMAX, ARG); E3: one whose third largest is below it at most two.
    # Only the other blocks are scored again, one after another, with the same dot of the same landmark tile as the
    # block-top pass (so the same scores to the bit: this kernel runs with the passes' warps), the row's scores
    # taken out of the tile's. EB blocks per step.
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
        e_max = tl.load(CMAX + e_at, mask=m_b, other=float("-inf"))
        e_sec = tl.load(CMAX + PS + e_at, mask=m_b, other=float("-inf"))
        one = m_b & (e_max >= t_f) & (e_sec < t_f)
        if E3:
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
        if E3:
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
    R, K, KV, CMAX, ARG, KK, LO, HI, OFF, CNT, CAND, IDX, PM, PL, PACC, VT, LSE, N, M, NB, NBLK, CAP, ksel, H, SB, SH,
    SN, nrows, NC, HAS_KV: tl.constexpr, F: tl.constexpr, GP: tl.constexpr, P: tl.constexpr,
    ONE_PLANE: tl.constexpr, STEPS: tl.constexpr, NARROW: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, EXACT: tl.constexpr, E3: tl.constexpr, EB: tl.constexpr,
    CP: tl.constexpr, KP: tl.constexpr, CB: tl.constexpr, SORT: tl.constexpr, FNARROW: tl.constexpr,
    MERGE: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    # The start, count + emit and final kernels of one row in one program (SCAN_CONFIG["fused_select"]): the start
    # threshold and state slot 0 (_start_row), the row's keys at or above it into its candidate list (_emit_row), and
    # when they fit the list (count <= CAP) its top-k (_final_row); OFF[row] = the count, so rows with more than CAP
    # take the fallback (then _topk_final_kernel with FB_ONLY). MERGE: the row's landmark values from their split-key
    # partials too.
    row = tl.program_id(0).to(tl.int64)
    if MERGE:
        _lv_merge_row(PM, PL, PACC, VT, LSE, row % M, row // M, M, NC, D, BC)
    lo = _start_row(CMAX, KK, LO, HI, CNT, row, M, NB, NBLK, ksel, nrows, HAS_KV, F, GP, P, ONE_PLANE, STEPS, NARROW)
    if row == 0:
        # The persistent fallback kernel's barrier counter.
        tl.store(OFF + nrows, 0)
    n = _emit_row(
        R, K, KV, CMAX, ARG, CAND, row, lo, N, M, NBLK, CAP, H, SB, SH, SN, nrows, HAS_KV, D, BS, BN, PREC, UP, EXACT,
        E3, EB,
    )  # fmt: skip
    tl.store(OFF + row, n)
    if n <= CAP:
        # The list's entries were written by this program's threads: make them visible to all of them.
        tl.debug_barrier()
        _final_row(CAND, IDX, row, n, ksel, CAP, CP, KP, CB, SORT, FNARROW, "")


def _final_narrow(cap: int) -> int:
    """SCAN_CONFIG["final_narrow"]: how the final per-row selection of a cap-entry list finds its threshold
    (_final_row); None: by a sort (2) for lists of at most 256 entries, else the narrowed bisection (1). Run 22 on
    the H200 (forward, CUDA graphs): 64K (256 entries) 0.115 -> 0.112 ms; 256K (512) 0.597 against 0.602."""
    v = SCAN_CONFIG["final_narrow"]
    if v is None:
        return 2 if cap <= 256 else 1
    if v not in (0, 1, 2):
        raise ValueError(f"SCAN_CONFIG['final_narrow'] must be 0, 1, 2 or None, got {v}")
    return int(v)


def _emit_top(N: int, ksel: int, bn: int) -> int:
    """Default block tops the count + emit pass reads (SCAN_CONFIG["emit_top"] None): 3 where blocks with two
    candidates are common, i.e. where a row's ~ksel candidates among N / bn blocks often share one (ksel >= N / (8
    bn)); else 2, which saves the block-top pass a reduction. Measured on the H200 (run 13, top-k, CUDA graphs): 3
    against 2 at 64K keys, m = k = 128: 0.116 against 0.123 ms (batch 1), 0.834 against 1.021 (batch 16); at 256K,
    m = k = 256: 0.434 against 0.422."""
    return 3 if ksel * 8 * bn >= N else 2


def _valid_counts(key_valid: torch.Tensor, ksel: int) -> torch.Tensor:
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
    stats: dict | None = None,
    lv: tuple | None = None,
    after_scan=None,
):
    """Per landmark, the indices of the ``ksel`` valid keys with the largest raw score, ties to the lower index.

    Args:
        r: ``[BH, m, d]`` landmarks.
        k: ``[BH, N, d]`` or ``[B, H, N, d]`` keys (same dtype as r; any layout :func:`heads_layout` takes).
        key_valid: ``[BH, N]`` bool, or None when every key is valid.
        ksel: keys per landmark, ``1 <= ksel <= N``.
        small_max_n: rows up to this length take the on-chip kernel (when the key tile fits in 64 KiB).
        cap: candidate-list length of the long-row path (default ``2 ksel``; at least ``max(ksel, 64)``, rounded up
            to a power of 2). Rows with more keys above the start threshold than cap take the refinement passes.
        timer: None, or ``timer(name, fn)`` that runs ``fn()`` (profiling: each pass of the long-row path is one
            named call).
        stats: None, or a dict that receives (long-row path only) ``"cap"``, ``"counts"`` (``[BH * m]`` int32
            device tensor: keys at or above each row's start threshold), ``"overflow_rows"`` (device
            tensor: rows with more than cap such keys, which take the refinement passes). No host
            synchronisation; scripts/bench/topk_overflow.py models the start threshold on the CPU.
        lv: None, or ``(v, scale)``: also compute the landmark values ``softmax(R k^T scale) v`` over the valid keys
            (v in k's layout), as :func:`landmark_values_fwd` does; on the long-row path with
            ``SCAN_CONFIG["lv_fused"]`` the block-top pass computes them from the scores it already has.
        after_scan: None, or a callable called (no arguments) right after the long-row path's block-top pass is
            queued (the MiTA forward forks its routing onto a second stream there, FWD_CONFIG route_stream); not
            called on the on-chip path.

    Returns:
        ``[BH, m, ksel]`` int32 key indices, ascending, then -1 for the slots a row has no valid key for. With lv:
        ``(indices, vt, lse)`` as :func:`landmark_values_fwd` returns them.
    """
    BH, M, D = r.shape
    N = k.shape[-2]
    lay = heads_layout(k) if lv is None else heads_layout(k, lv[0])
    dev = r.device
    kv = key_valid.to(torch.int8).contiguous() if key_valid is not None else r
    prec, up = _prec(r.dtype), _upcast(r.dtype)
    # Without padding every row keeps ksel keys: no count tensor (the kernels take ksel).
    kk = _valid_counts(key_valid, ksel) if key_valid is not None else r
    NP = max(16, _next_pow2(N))
    if N <= small_max_n and NP * D * k.element_size() <= _SMALL_BYTES:
        idx = torch.empty(BH, M, ksel, device=dev, dtype=torch.int32)
        bs = 16
        fast(_topk_small_kernel)[(_cdiv(M, bs), BH)](
            r,
            k,
            kv,
            kk,
            idx,
            N,
            M,
            ksel,
            *lay,
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
        return idx if lv is None else (idx, *landmark_values_fwd(r, k, lv[0], key_valid, lv[1]))
    bn = SCAN_CONFIG["bn"]
    bs = SCAN_CONFIG["bs"] or (64 if D <= 64 else 32)
    n_s = _cdiv(M, bs)
    NB = _cdiv(N, bn)
    topt = SCAN_CONFIG.get("block_top")
    topt = int(topt) if topt is not None else (2 if NB * 2 <= _START_ENTRIES else 1)
    if topt < 1 or topt > bn:
        raise ValueError(f"SCAN_CONFIG['block_top'] must be in [1, bn = {bn}], got {topt}")
    e_top = SCAN_CONFIG.get("emit_top")
    e_top = int(e_top) if e_top is not None else _emit_top(N, ksel, bn)
    if e_top not in (2, 3):
        raise ValueError(f"SCAN_CONFIG['emit_top'] must be 2, 3 or None, got {e_top}")
    e3 = int(e_top == 3)
    steps = int(SCAN_CONFIG["start_steps"])
    if not 12 <= steps <= 32:
        raise ValueError(f"SCAN_CONFIG['start_steps'] must be in [12, 32], got {steps}")
    if not 16 <= bn <= 128:
        raise ValueError(f"SCAN_CONFIG['bn'] must be in [16, 128], got {bn}")
    lvf = lv is not None and bool(SCAN_CONFIG["lv_fused"])
    lv_lazy = SCAN_CONFIG["lv_lazy"]
    if lv_lazy is None:
        # Measured on the H200 (run 22): 2 at 64K and 256K (forward 0.115 -> 0.110 ms, 0.597 -> 0.580); 1M was not
        # timed with it and keeps 1.
        lv_lazy = 2 if N <= 1 << 18 else 1
    if lv_lazy not in (0, 1, 2):
        raise ValueError(f"SCAN_CONFIG['lv_lazy'] must be 0, 1, 2 or None, got {lv_lazy}")
    if SCAN_CONFIG["fallback"] not in (0, 1):
        raise ValueError(f"SCAN_CONFIG['fallback'] must be 0 or 1, got {SCAN_CONFIG['fallback']}")
    persistent = bool(SCAN_CONFIG["fallback"])
    G = max(1, min(NB, _cdiv(_SCAN_PROGRAMS, n_s * BH)))
    if lvf:
        if int(SCAN_CONFIG["lv_div"]) < 1:
            raise ValueError(f"SCAN_CONFIG['lv_div'] must be >= 1, got {SCAN_CONFIG['lv_div']}")
        G = max(1, min(G, N // (int(SCAN_CONFIG["lv_div"]) * M)))
    CH = _cdiv(_cdiv(N, G), bn) * bn
    G = _cdiv(N, CH)
    cap = _next_pow2(max(cap or 2 * ksel, ksel, 64))
    _final_narrow(cap)
    rows = BH * M
    grid = (n_s, G, BH)
    # Key blocks per step of the block-top pass (bg) and of the sparse count + emit pass (bb), at most a chunk's.
    bg = min(8, _next_pow2(CH // bn))
    bb = SCAN_CONFIG["emit_bb"] or max(2, min(32, _next_pow2(CH // bn)))
    if bb & (bb - 1) or not 2 <= bb <= 32:
        raise ValueError(f"SCAN_CONFIG['emit_bb'] must be a power of 2 in [2, 32] or None, got {bb}")
    common = dict(HAS_KV=key_valid is not None, D=D, BS=bs, BN=bn, PREC=prec, UP=up, EXACT=_interpreting(), P=_P)
    # The block-top pass without masks: no padding, whole landmark tiles, whole steps of bg blocks in every chunk.
    even = bool(SCAN_CONFIG["even"]) and key_valid is None and M % bs == 0 and N % CH == 0 and CH % (bn * bg) == 0

    def run(name, fn):
        return fn() if timer is None else timer(name, fn)

    # Block tops: plane t = each key block's (t+1)-th largest score per row (at least two planes, three with emit_top
    # 3: the count + emit pass reads them), and where in the block the largest is (with emit_top 3 also the second).
    planes = max(topt, 2 + e3)
    cmax = torch.empty(planes, rows, NB, device=dev, dtype=torch.float32)
    arg = torch.empty(1 + e3, rows, NB, device=dev, dtype=torch.int8)
    # State slot i = (lo, hi, done) of each row before refinement pass i; slot _PASSES: the final state.
    lo = torch.empty(_PASSES + 1, rows, device=dev, dtype=torch.int64)
    hi = torch.empty(_PASSES + 1, rows, device=dev, dtype=torch.int64)
    done = torch.empty(_PASSES + 1, rows, device=dev, dtype=torch.int32)
    # Per row: the atomic slot counter of the candidate list (ends as the count of keys >= the start threshold);
    # then the persistent fallback kernel's barrier counter.
    off = torch.empty(rows + 1, device=dev, dtype=torch.int32)
    # Refinement counts [passes, rows, P], then the per-chunk counts of the fallback rows [rows, G, 2].
    cnt = torch.empty(_PASSES * rows * _P + rows * G * 2, device=dev, dtype=torch.int32)
    cand = torch.empty(rows, cap, device=dev, dtype=torch.int64)
    idx = torch.empty(BH, M, ksel, device=dev, dtype=torch.int32)
    if lvf:
        # The landmark values' split-key partials, one per (key chunk, landmark), merged below.
        pm = torch.empty(BH, G, M, device=dev, dtype=torch.float32)
        pl = torch.empty(BH, G, M, device=dev, dtype=torch.float32)
        pacc = torch.empty(BH, G, M, D, device=dev, dtype=torch.float32)
        vv, lv_scale = lv[0], lv[1] * LOG2E
    else:
        pm = pl = pacc = vv = r
        lv_scale = 1.0

    def scan(mode, i_pass=0):
        fast(_topk_scan_kernel)[grid](
            r, k, kv, kk, lo, hi, done, cmax, arg, cnt, off, cand, vv, pm, pl, pacc, lv_scale, N, M, CH, G, NB, cap,
            ksel, *lay, rows, i_pass,
            MODE=mode, SKIP=mode != 0 and mode != 4, TOPT=planes if mode == 0 else 1, BB=bb,
            BG=bg if mode == 0 else 1, E3=e3 if mode in (0, 4) else 0, LVF=lvf and mode == 0,
            EVEN=even and mode == 0, LAZY=int(lv_lazy) if lvf and mode == 0 else 0,
            EQ=mode == 0 and bool(SCAN_CONFIG["tops_eq"]), **common,
            num_warps=SCAN_CONFIG["num_warps"], **(regs_cap(SCAN_CONFIG["maxnreg"]) if mode == 0 else {}),
            **({"num_stages": int(SCAN_CONFIG["stages"])} if mode == 0 and SCAN_CONFIG["stages"] else {}),
        )  # fmt: skip

    run("block maxima" if not lvf else "block maxima + landmark values", lambda: scan(0))
    if after_scan is not None:
        after_scan()
    # Groups of f block entries keep the start kernel's maxima in registers (<= _START_ENTRIES per row).
    f = _next_pow2(_cdiv(NB * topt, _START_ENTRIES))
    gp = _next_pow2(_cdiv(NB * topt, f))
    kp = _next_pow2(ksel)
    merge = lvf and bool(SCAN_CONFIG["merge_in_final"])
    if lvf:
        vt = torch.empty(BH, M, D, device=dev, dtype=r.dtype)
        lse = torch.empty(BH, M, device=dev, dtype=torch.float32)
    else:
        vt = lse = r
    fused = bool(SCAN_CONFIG["fused_select"])
    final_kw = dict(CP=cap, KP=kp, CB=max(1, min(64, 8192 // kp)), SORT=bool(SCAN_CONFIG["final_sort"]))
    if fused:
        eb = SCAN_CONFIG["select_eb"] or max(16, min(1024, _next_pow2(NB)))
        if eb & (eb - 1) or eb < 16:
            raise ValueError(f"SCAN_CONFIG['select_eb'] must be a power of 2 >= 16 or None, got {eb}")
        run(
            "start + count + emit + top-k (per row)" + (" + landmark values merge" if merge else ""),
            lambda: fast(_topk_select_kernel)[(rows,)](
                r, k, kv, cmax, arg, kk, lo, hi, off, cnt, cand, idx, pm, pl, pacc, vt, lse, N, M, NB * topt, NB, cap,
                ksel, *lay, rows, G,
                HAS_KV=key_valid is not None, F=f, GP=gp, P=_P, ONE_PLANE=topt == 1, STEPS=steps,
                NARROW=bool(SCAN_CONFIG["start_narrow"]), D=D, BS=bs, BN=bn, PREC=prec, UP=up, EXACT=_interpreting(),
                E3=e3, EB=eb, FNARROW=_final_narrow(cap), MERGE=merge, BC=min(64, _next_pow2(G)),
                **final_kw, num_warps=SCAN_CONFIG["num_warps"],
            ),
        )  # fmt: skip
    else:
        run(
            "start threshold",
            lambda: fast(_topk_start_kernel)[(rows,)](
                cmax, kk, lo, hi, off, cnt, cand, M, NB * topt, NB, cap, ksel, rows,
                HAS_KV=key_valid is not None, F=f, GP=gp, P=_P, CB=min(cap, 1024), ONE_PLANE=topt == 1, STEPS=steps,
                NARROW=bool(SCAN_CONFIG["start_narrow"]),
                num_warps=SCAN_CONFIG["start_warps"] or (8 if gp * f >= 4096 else 4),
            ),
        )  # fmt: skip
        # Common case: every row's keys >= start fit the list; the passes below then exit at once on the device.
        run("count + emit (sparse, atomic slots)", lambda: scan(4))
    if stats is not None:
        stats["cap"] = cap
        stats["counts"] = off[:rows].clone()
        stats["overflow_rows"] = (off[:rows] > cap).sum()
    fb_final = persistent and fused and bool(SCAN_CONFIG["fb_final"])
    if persistent:
        fb_kw = dict(
            P=_P, HAS_KV=key_valid is not None, D=D, BS=bs, BN=bn, PREC=prec, UP=up, EXACT=_interpreting(),
            RB=min(4096, _next_pow2(rows)), SPIN=int(SCAN_CONFIG["fb_spin"]), FINAL=fb_final,
            FNARROW=_final_narrow(cap), **final_kw, num_warps=SCAN_CONFIG["num_warps"],
        )  # fmt: skip
        okey = (dev.index, tuple(sorted(fb_kw.items())))
        if _interpreting():
            nprog = 1
        else:
            # As many programs as the SMs hold at once (_resident_per_sm; one per SM until the first launch of these
            # constexprs has compiled the kernel), so that every program is resident.
            nprog = min(n_s * G * BH, _sm_count(dev) * _FB_RESIDENT.get(okey, 1))
        if SCAN_CONFIG["fb_programs"]:
            nprog = min(nprog, int(SCAN_CONFIG["fb_programs"]))

        def fallback():
            compiled = fast(_topk_fallback_kernel)[(nprog,)](
                r, k, kv, kk, lo, hi, done, cnt, off, cand, idx, N, M, CH, G, NB, cap, ksel, *lay, rows, n_s, BH, nprog,
                **fb_kw,
            )  # fmt: skip
            if not _interpreting() and okey not in _FB_RESIDENT and compiled is not None:
                _FB_RESIDENT[okey] = _resident_per_sm(compiled, fb_kw["num_warps"], dev)

        run(
            "fallback rows (refinement, recount, ordered emit" + (", top-k" if fb_final else "") + "; persistent)",
            fallback,
        )
    else:
        for i in range(_PASSES):
            run(f"refine pass {i} (fallback rows)", lambda i=i: scan(1, i))
        run("recount (fallback rows)", lambda: scan(2, _PASSES))
        run("ordered emit (fallback rows)", lambda: scan(3, _PASSES))
    final_cap = 96 if cap <= 512 and kp >= 64 else 0
    if not fb_final:
        run(
            ("top-k of the fallback rows' lists" if fused else "top-k of the candidate list")
            + (" + landmark values merge" if merge and not fused else ""),
            lambda: fast(_topk_final_kernel)[(rows,)](
                cand, idx, ksel, cap, pm, pl, pacc, vt, lse, off, M, G,
                NARROW=_final_narrow(cap), MERGE=merge and not fused, D=D, BC=min(64, _next_pow2(G)),
                FB_ONLY=fused, **final_kw, num_warps=SCAN_CONFIG["final_warps"] or (4 if cap <= 512 else 8),
                **regs_cap(SCAN_CONFIG["final_maxnreg"] if SCAN_CONFIG["final_maxnreg"] is not None else final_cap),
            ),
        )  # fmt: skip
    if lv is None:
        return idx
    if not lvf:
        return (idx, *run("landmark values", lambda: landmark_values_fwd(r, k, lv[0], key_valid, lv[1])))
    if merge:
        return idx, vt, lse
    run(
        "landmark values merge",
        lambda: fast(_lv_merge_kernel)[(M, BH)](
            pm, pl, pacc, vt, lse, M, G, D=D, BC=min(64, _next_pow2(G)), num_warps=4
        ),
    )
    return idx, vt, lse


# ----------------------------------------------------------------------------------------------------------------
# routing: top-S landmarks per query
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _route_kernel(
    Q,
    R,
    ROUTE,
    VT,
    O,
    LSE,
    N,
    M,
    H,
    SB,
    SH,
    SN,
    sscale_log2,
    S: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BS: tl.constexpr,
    PREC: tl.constexpr,
    UP: tl.constexpr,
    EXACT: tl.constexpr,
    SH_OUT: tl.constexpr,
    EVEN: tl.constexpr,
    PERSIST: tl.constexpr = 0,
    STAGES: tl.constexpr = 2,
):
    # EVEN: N % BM == 0 and M % BS == 0, so the query and landmark tiles load without masks.
    # PERSIST (S = 1 without SH_OUT, EVEN, M == BS): the grid's first axis is a number of persistent programs, each
    # with the landmark tile loaded once, looping over query tiles i_n, i_n + programs, ... (STAGES: the loop's
    # software pipelining, which loads the next query tiles during this one's scores).
    # Top-S landmarks of each query (ROUTE). SH_OUT (S = 1): from the same scores, also the query's attention over
    # the m shared entries (landmark keys R, values VT, logits scaled by sscale): its normalised output into O
    # ([B, N, H, D] order, _out_ptr) and its log-sum-exp (log2 units) into LSE [BH, N], the state the fused
    # attention (INIT) continues from.
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
        if SH_OUT:
            b_m = tl.full([BM], float("-inf"), tl.float32)
            b_l = tl.zeros([BM], tl.float32)
            b_acc = tl.zeros([BM, D], tl.float32)
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
            if SH_OUT:
                b_vt = tl.load(VT + i_bh * M * D + o_j[:, None] * D + o_d[None, :], mask=(o_j < M)[:, None], other=0.0)
                b_ss = tl.where((o_j < M)[None, :], b_sc * sscale_log2, float("-inf"))
                b_m, b_l, b_acc = _softmax_step(b_ss, b_vt, b_m, b_l, b_acc, PREC, UP)
        tl.store(ROUTE + i_bh * N + o_n.to(tl.int64), best_i, mask=m_n)
        if SH_OUT:
            O_h = _out_ptr(O, i_bh, H, N, D)
            b_o = b_acc / b_l[:, None]
            o_n64 = o_n.to(tl.int64)
            tl.store(O_h + o_n64[:, None] * (H * D) + o_d[None, :], b_o.to(O.dtype.element_ty), mask=m_n[:, None])
            tl.store(LSE + i_bh * N + o_n64, b_m + tl.log2(b_l), mask=m_n)
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


def route_topk(q: torch.Tensor, r: torch.Tensor, S: int, shared_out: tuple | None = None) -> torch.Tensor:
    """Per query, the S landmarks with the largest raw score ``q_n . R_i`` (ties to the lower index), best first.

    Args:
        q: ``[BH, N, d]`` or ``[B, H, N, d]`` queries (any layout :func:`heads_layout` takes).
        r: ``[BH, m, d]`` landmarks.
        S: experts per query, ``1 <= S <= m``.
        shared_out: None, or (S = 1) ``(vt [BH, m, d], o, lse [BH, N] float32, sscale)``: from the same scores, also
            each query's attention over the shared entries (keys r, values vt, logits ``q . R_i * sscale``): its
            output written into o (:func:`out_layout` of q) and its log-sum-exp (log2 units) into lse.

    Returns:
        ``[BH, N * S]`` int32: entry ``n * S + s`` is query n's s-th landmark.
    """
    BH, M, D = r.shape
    N = q.shape[-2]
    route = torch.empty(BH, N * S, device=q.device, dtype=torch.int32)
    if shared_out is not None and S != 1:
        raise ValueError(f"route_topk: shared_out needs S = 1, got S = {S}")
    vt, o, lse, sscale = shared_out if shared_out is not None else (r, route, route, 1.0)
    # S = 1: 128 queries x up to 128 landmarks per step (fewer reloads of R; a max and a first-index min per
    # score). S > 1: 64 x 64 (the ordered passes keep more state per score).
    bm = ROUTE_CONFIG["bm"] or (128 if S == 1 else 64)
    bs = int(min(ROUTE_CONFIG["bs"] or (128 if S == 1 else 64), max(16, _next_pow2(M))))
    warps = ROUTE_CONFIG["num_warps"] or (8 if bm * bs >= 128 * 128 else 4)
    even = bool(ROUTE_CONFIG["unmasked"]) and N % bm == 0 and M % bs == 0
    per_sm = int(ROUTE_CONFIG["persistent"] or 0)
    if per_sm < 0:
        raise ValueError(f"ROUTE_CONFIG['persistent'] must be >= 0, got {per_sm}")
    persist = per_sm > 0 and S == 1 and shared_out is None and even and M == bs
    grid = (_cdiv(N, bm), BH)
    if persist:
        # Persistent programs: per_sm per SM over all heads (two under the interpreter, to run the loop).
        progs = 2 if _interpreting() else _sm_count(q.device) * per_sm
        per_head = max(1, min(N // bm, _cdiv(progs, BH)))
        persist = _interpreting() or _cdiv(N // bm, per_head) <= int(ROUTE_CONFIG["persistent_max"])
        if persist:
            grid = (per_head, BH)
    fast(_route_kernel)[grid](
        q,
        r,
        route,
        vt,
        o,
        lse,
        N,
        M,
        *heads_layout(q),
        sscale * LOG2E,
        S=S,
        D=D,
        BM=bm,
        BS=bs,
        PREC=_prec(q.dtype),
        UP=_upcast(q.dtype),
        EXACT=_interpreting(),
        SH_OUT=shared_out is not None,
        EVEN=even,
        PERSIST=persist,
        STAGES=int(ROUTE_CONFIG["stages"]),
        num_warps=warps,
        **regs_cap(ROUTE_CONFIG["maxnreg"]),
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
    H,
    SB,
    SH,
    SN,
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
    K_h = _head_ptr(K, i_bh, H, SB, SH)
    V_h = _head_ptr(V, i_bh, H, SB, SH)
    for n_b in range(n0, n1, BN):
        o_n = n_b + tl.arange(0, BN)
        m_n = o_n < n1
        if HAS_KV:
            m_n = m_n & (tl.load(KV + i_bh * N + o_n, mask=m_n, other=0) != 0)
        o_kv = o_n.to(tl.int64)[:, None] * SN + o_d[None, :]
        b_k = tl.load(K_h + o_kv, mask=m_n[:, None], other=0.0)
        b_v = tl.load(V_h + o_kv, mask=m_n[:, None], other=0.0)
        b_s = _dot(b_r, tl.trans(b_k), PREC, UP) * scale_log2
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m, b_l, b_acc = _softmax_step(b_s, b_v, b_m, b_l, b_acc, PREC, UP)
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
def _lv_merge_kernel(PM, PL, PACC, VT, LSE, M, NC, D: tl.constexpr, BC: tl.constexpr):
    # One landmark per program.
    _lv_merge_row(PM, PL, PACC, VT, LSE, tl.program_id(0), tl.program_id(1).to(tl.int64), M, NC, D, BC)


@triton.jit
def _lv_merge_row(PM, PL, PACC, VT, LSE, i_j, i_bh, M, NC, D: tl.constexpr, BC: tl.constexpr):
    # Landmark i_j of head i_bh from its NC split-key partials, BC key chunks per step: the global maximum first,
    # then the rescaled sums.
    o_d = tl.arange(0, D)
    b_m = tl.full([BC], float("-inf"), tl.float32)
    for c0 in range(0, NC, BC):
        o_c = c0 + tl.arange(0, BC)
        b_m = tl.maximum(b_m, tl.load(PM + (i_bh * NC + o_c) * M + i_j, mask=o_c < NC, other=float("-inf")))
    g_m = tl.max(b_m, 0)
    g_ms = tl.where(g_m == float("-inf"), 0.0, g_m)
    b_l = tl.zeros([BC], tl.float32)
    b_acc = tl.zeros([BC, D], tl.float32)
    for c0 in range(0, NC, BC):
        o_c = c0 + tl.arange(0, BC)
        m_c = o_c < NC
        o_w = (i_bh * NC + o_c) * M + i_j
        a = tl.exp2(tl.load(PM + o_w, mask=m_c, other=float("-inf")) - g_ms)
        b_l += tl.load(PL + o_w, mask=m_c, other=0.0) * a
        b_acc += tl.load(PACC + o_w[:, None] * D + o_d[None, :], mask=m_c[:, None], other=0.0) * a[:, None]
    l_sum = tl.sum(b_l, 0)
    acc = tl.sum(b_acc, 0)
    nz = l_sum > 0
    tl.store(VT + (i_bh * M + i_j) * D + o_d, (acc / tl.where(nz, l_sum, 1.0)).to(VT.dtype.element_ty))
    tl.store(LSE + i_bh * M + i_j, tl.where(nz, g_m + tl.log2(tl.where(nz, l_sum, 1.0)), float("-inf")))


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
    H,
    SB,
    SH,
    SN,
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
        o_kv = o_n64[:, None] * SN + o_d[None, :]
        b_k = tl.load(_head_ptr(K, i_bh, H, SB, SH) + o_kv, mask=m_n[:, None], other=0.0)
        b_v = tl.load(_head_ptr(V, i_bh, H, SB, SH) + o_kv, mask=m_n[:, None], other=0.0)
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


def _n_chunks(N: int, M: int, n_s: int, BH: int, bn: int, target: int = 1024) -> tuple[int, int]:
    """``(chunks, keys per chunk)`` of a split-key pass over N keys with float32 partials of [M, d] per chunk:
    about ``target`` programs, at least 4 key blocks per chunk, and at most N / (8 M) chunks, so the partials
    take at most a quarter of the memory of k (two bytes per element) and never decide the call's peak."""
    nc = max(1, min(_cdiv(N, 4 * bn), _cdiv(target, n_s * BH), N // (8 * M)))
    ch = _cdiv(_cdiv(N, nc), bn) * bn
    return _cdiv(N, ch), ch


def landmark_values_fwd(r, k, v, key_valid, scale: float):
    """Forward of ``softmax(R k^T scale) v`` over valid keys. r ``[BH, m, d]``; k, v ``[BH, N, d]`` or
    ``[B, H, N, d]``, one layout (:func:`heads_layout`).

    Returns:
        ``(vt [BH, m, d] in r's dtype, lse [BH, m] float32 in log2 units; -inf for a row with no valid key)``.
    """
    BH, M, D = r.shape
    N = k.shape[-2]
    dev = r.device
    bs, bn = _lv_blocks(M, D)
    # 128 landmarks per program when there are that many (d <= 64): half the key/value reloads of 64.
    bs = 128 if M >= 128 and D <= 64 else bs
    n_s = _cdiv(M, bs)
    nc, ch = _n_chunks(N, M, n_s, BH, bn)
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
    fast(_lv_fwd_kernel)[(n_s, nc, BH)](
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
        *heads_layout(k, v),
        scale * LOG2E,
        HAS_KV=key_valid is not None,
        DIRECT=direct,
        D=D,
        BS=bs,
        BN=bn,
        PREC=_prec(r.dtype),
        UP=_upcast(r.dtype),
        num_warps=LV_CONFIG["num_warps"] or (8 if bs >= 128 else 4),
        **regs_cap(LV_CONFIG["maxnreg"]),
    )
    if not direct:
        fast(_lv_merge_kernel)[(M, BH)](pm, pl, pacc, vt, lse, M, nc, D=D, BC=min(64, _next_pow2(nc)), num_warps=4)
    return vt, lse


def landmark_values_bwd(dvt, r, k, v, key_valid, vt, lse, scale: float):
    """Backward of :func:`landmark_values_fwd`. Returns ``(dr, dk, dv)`` float32, shapes of r, k, v."""
    BH, M, D = r.shape
    N = k.shape[1]
    dev = r.device
    bs, bn = _lv_blocks(M, D)
    n_s = _cdiv(M, bs)
    dvt = dvt.to(r.dtype).contiguous()
    delta = (dvt.float() * vt.float()).sum(-1).contiguous()
    kv = key_valid.to(torch.int8).contiguous() if key_valid is not None else r
    prec, up = _prec(r.dtype), _upcast(r.dtype)
    has_kv = key_valid is not None
    dk = torch.empty(BH, N, D, device=dev, dtype=torch.float32)
    dv = torch.empty(BH, N, D, device=dev, dtype=torch.float32)
    fast(_lv_bwd_dkdv_kernel)[(_cdiv(N, bn), BH)](
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
    nc, ch = _n_chunks(N, M, n_s, BH, bn)
    dr = torch.empty(BH, nc, M, D, device=dev, dtype=torch.float32)
    fast(_lv_bwd_dr_kernel)[(n_s, nc, BH)](
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
        *heads_layout(k, v),
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


def _compile_cases() -> list:
    """Kernels and constexpr settings (bf16, d 64) for scripts/bench/compile_check.py beyond its own list."""
    common = dict(D=64, PREC="tf32", UP=False)
    i32, i64 = "*i32", "*i64"
    scan = dict(KK=i32, LO=i64, HI=i64, DONE=i32, CMAX="*fp32", ARG="*i8", CNT=i32, OFF=i32, CAND=i64)
    sc = dict(P=_P, HAS_KV=False, BS=64, BN=64, EXACT=False, LVF=0, EVEN=0, LAZY=0, **common)
    lvf = dict(scan, PM="*fp32", PL="*fp32", PACC="*fp32")
    sel = dict(lvf, IDX=i32)
    return [
        ("topk_scan mode 0 e3 + lv", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=3, BB=16, BG=8, E3=1, **{**sc, "LVF": 1}), 4, lvf),
        ("topk_scan mode 0 + lv", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=2, BB=16, BG=8, E3=0, **{**sc, "LVF": 1}), 4, lvf),
        ("topk_scan mode 0 e3 + lv even lazy", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=3, BB=16, BG=8, E3=1, **{**sc, "LVF": 1, "EVEN": 1, "LAZY": 1}), 4, lvf),
        ("topk_scan mode 0 e3 + lv even lazy eq", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=3, BB=16, BG=8, E3=1, **{**sc, "LVF": 1, "EVEN": 1, "LAZY": 1, "EQ": 1}), 4,
         lvf),
        ("topk_scan mode 0 e3 + lv even fma eq", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=3, BB=16, BG=8, E3=1, **{**sc, "LVF": 1, "EVEN": 1, "LAZY": 2, "EQ": 1}), 4,
         lvf),
        ("topk_scan mode 0 + lv even lazy eq", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=2, BB=16, BG=8, E3=0, **{**sc, "LVF": 1, "EVEN": 1, "LAZY": 1, "EQ": 1}), 4,
         lvf),
        ("topk_scan mode 0 e3 + lv eq", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=3, BB=16, BG=8, E3=1, **{**sc, "LVF": 1, "EQ": 1}), 4, lvf),
        ("topk_scan mode 0 + lv even lazy", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=2, BB=16, BG=8, E3=0, **{**sc, "LVF": 1, "EVEN": 1, "LAZY": 1}), 4, lvf),
        ("topk_scan mode 0 + lv even", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=2, BB=16, BG=8, E3=0, **{**sc, "LVF": 1, "EVEN": 1}), 4, lvf),
        ("topk_scan mode 0 + lv bs 128", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=2, BB=16, BG=8, E3=0, **{**sc, "LVF": 1, "BS": 128}), 8, lvf),
        ("topk_scan mode 4 bs 128", _topk_scan_kernel,
         dict(MODE=4, SKIP=False, TOPT=1, BB=32, BG=1, E3=0, **{**sc, "BS": 128}), 8, scan),
        ("topk_scan mode 0 top-4", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=4, BB=16, BG=8, E3=0, **sc), 4, scan),
        ("topk_scan mode 0 e3", _topk_scan_kernel, dict(MODE=0, SKIP=False, TOPT=3, BB=16, BG=8, E3=1, **sc), 4, scan),
        ("topk_scan mode 0 e3 top-4", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=4, BB=16, BG=8, E3=1, **sc), 4, scan),
        ("topk_scan mode 4", _topk_scan_kernel,
         dict(MODE=4, SKIP=False, TOPT=1, BB=16, BG=1, E3=0, **{**sc, "HAS_KV": True}), 4, scan),
        ("topk_scan mode 4 e3", _topk_scan_kernel, dict(MODE=4, SKIP=False, TOPT=1, BB=32, BG=1, E3=1, **sc), 4, scan),
        ("topk_scan mode 1 skip", _topk_scan_kernel,
         dict(MODE=1, SKIP=True, TOPT=1, BB=16, BG=1, E3=0, **sc), 4, scan),
        ("topk_scan mode 3 skip", _topk_scan_kernel,
         dict(MODE=3, SKIP=True, TOPT=1, BB=16, BG=1, E3=0, **sc), 4, scan),
        ("topk_fallback (persistent)", _topk_fallback_kernel,
         dict(P=_P, HAS_KV=False, BS=64, BN=64, EXACT=False, RB=256, SPIN=0, FINAL=1, CP=256, KP=128, CB=64, SORT=1,
              FNARROW=1, **common), 4,
         dict(scan, BH="i32", NPROG="i32", IDX=i32)),
        ("topk_fallback (persistent) 1M", _topk_fallback_kernel,
         dict(P=_P, HAS_KV=False, BS=64, BN=64, EXACT=False, RB=1024, SPIN=0, FINAL=1, CP=1024, KP=512, CB=16,
              SORT=1, FNARROW=1, **common), 4,
         dict(scan, BH="i32", NPROG="i32", IDX=i32)),
        ("topk_fallback (persistent) kv", _topk_fallback_kernel,
         dict(P=_P, HAS_KV=True, BS=32, BN=64, EXACT=False, RB=4096, SPIN=1, FINAL=0, CP=256, KP=128, CB=64, SORT=0,
              FNARROW=0, **common), 4,
         dict(scan, BH="i32", NPROG="i32", IDX=i32)),
        ("topk_start", _topk_start_kernel,
         dict(HAS_KV=False, F=2, GP=8192, P=_P, CB=1024, ONE_PLANE=True, STEPS=20, NARROW=1), 8,
         dict(CMAX="*fp32", KK=i32, LO=i64, HI=i64, OFF=i32, CNT=i32, CAND=i64)),
        ("topk_start kv", _topk_start_kernel,
         dict(HAS_KV=True, F=1, GP=1024, P=_P, CB=256, ONE_PLANE=False, STEPS=32, NARROW=0), 4,
         dict(CMAX="*fp32", KK=i32, LO=i64, HI=i64, OFF=i32, CNT=i32, CAND=i64)),
        ("topk_start 64K", _topk_start_kernel,
         dict(HAS_KV=False, F=1, GP=2048, P=_P, CB=256, ONE_PLANE=False, STEPS=20, NARROW=1), 4,
         dict(CMAX="*fp32", KK=i32, LO=i64, HI=i64, OFF=i32, CNT=i32, CAND=i64)),
        ("topk_final", _topk_final_kernel,
         dict(CP=1024, KP=512, CB=16, SORT=0, NARROW=0, MERGE=0, D=64, BC=64, FB_ONLY=0), 8, dict(CAND=i64, IDX=i32)),
        ("topk_final sort", _topk_final_kernel,
         dict(CP=1024, KP=512, CB=16, SORT=1, NARROW=1, MERGE=0, D=64, BC=64, FB_ONLY=0), 8, dict(CAND=i64, IDX=i32)),
        ("topk_final sort merge", _topk_final_kernel,
         dict(CP=1024, KP=512, CB=16, SORT=1, NARROW=1, MERGE=1, D=64, BC=64, FB_ONLY=0), 8,
         dict(CAND=i64, IDX=i32, VT="*bf16")),
        ("topk_final 64K", _topk_final_kernel,
         dict(CP=256, KP=128, CB=64, SORT=0, NARROW=0, MERGE=0, D=64, BC=64, FB_ONLY=0), dict(num_warps=4, maxnreg=96),
         dict(CAND=i64, IDX=i32)),
        ("topk_final 64K sort", _topk_final_kernel,
         dict(CP=256, KP=128, CB=64, SORT=1, NARROW=1, MERGE=0, D=64, BC=64, FB_ONLY=0), dict(num_warps=4, maxnreg=96),
         dict(CAND=i64, IDX=i32)),
        ("topk_final 64K sort merge", _topk_final_kernel,
         dict(CP=256, KP=128, CB=64, SORT=1, NARROW=1, MERGE=1, D=64, BC=64, FB_ONLY=0), dict(num_warps=4, maxnreg=96),
         dict(CAND=i64, IDX=i32, VT="*bf16")),
        ("topk_final 64K fb only", _topk_final_kernel,
         dict(CP=256, KP=128, CB=64, SORT=1, NARROW=1, MERGE=0, D=64, BC=64, FB_ONLY=1), dict(num_warps=4, maxnreg=96),
         dict(CAND=i64, IDX=i32, OFF=i32)),
        ("topk_select 64K e3 merge", _topk_select_kernel,
         dict(HAS_KV=False, F=1, GP=2048, P=_P, ONE_PLANE=False, STEPS=20, NARROW=1, BS=64, BN=64, EXACT=False, E3=1,
              EB=1024, CP=256, KP=128, CB=64, SORT=1, FNARROW=1, MERGE=1, BC=64, **common), 4,
         dict(sel, VT="*bf16")),
        ("topk_select 64K e3 merge sort-select", _topk_select_kernel,
         dict(HAS_KV=False, F=1, GP=2048, P=_P, ONE_PLANE=False, STEPS=20, NARROW=1, BS=64, BN=64, EXACT=False, E3=1,
              EB=1024, CP=256, KP=128, CB=64, SORT=1, FNARROW=2, MERGE=1, BC=64, **common), 4,
         dict(sel, VT="*bf16")),
        ("topk_select 1M", _topk_select_kernel,
         dict(HAS_KV=False, F=2, GP=8192, P=_P, ONE_PLANE=True, STEPS=20, NARROW=1, BS=64, BN=64, EXACT=False, E3=0,
              EB=1024, CP=1024, KP=512, CB=16, SORT=1, FNARROW=1, MERGE=1, BC=64, **common), 4,
         dict(sel, VT="*bf16")),
        ("topk_select kv", _topk_select_kernel,
         dict(HAS_KV=True, F=1, GP=1024, P=_P, ONE_PLANE=False, STEPS=32, NARROW=0, BS=32, BN=64, EXACT=False, E3=0,
              EB=512, CP=256, KP=128, CB=64, SORT=0, FNARROW=0, MERGE=0, BC=64, **common), 4,
         dict(sel, VT="*bf16")),
        ("route S=1", _route_kernel, dict(S=1, BM=128, BS=128, EXACT=False, SH_OUT=False, EVEN=0, **common), 8, None),
        ("route S=1 even", _route_kernel, dict(S=1, BM=128, BS=128, EXACT=False, SH_OUT=False, EVEN=1, **common), 8,
         None),
        ("route S=1 persistent", _route_kernel,
         dict(S=1, BM=128, BS=128, EXACT=False, SH_OUT=False, EVEN=1, PERSIST=1, STAGES=2, **common), 8, None),
        ("route S=1 shared", _route_kernel, dict(S=1, BM=128, BS=128, EXACT=False, SH_OUT=True, EVEN=0, **common), 8,
         dict(VT="*bf16", O="*bf16", LSE="*fp32", sscale_log2="fp32")),
        ("route S=2", _route_kernel, dict(S=2, BM=64, BS=64, EXACT=False, SH_OUT=False, EVEN=0, **common), 4, None),
        ("lv_fwd BS=128", _lv_fwd_kernel, dict(HAS_KV=False, DIRECT=False, BS=128, BN=64, **common), 8,
         dict(PM="*fp32", PL="*fp32", PACC="*fp32", VT="*bf16", LSE="*fp32")),
        ("lv_fwd BS=64 direct", _lv_fwd_kernel, dict(HAS_KV=True, DIRECT=True, BS=64, BN=64, **common), 4,
         dict(PM="*fp32", PL="*fp32", PACC="*fp32", VT="*bf16", LSE="*fp32")),
        ("lv_merge", _lv_merge_kernel, dict(D=64, BC=64), 4, dict(VT="*bf16")),
    ]  # fmt: skip
