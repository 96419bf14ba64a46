"""Exact top-k per landmark (host side): ``exact_topk`` and its settings ``SCAN_CONFIG``.

``exact_topk``: per landmark, the k keys with the largest raw score ``R_i . k_j`` (ties to the lower key index),
computed tile by tile. Each score is mapped to an order-preserving int32 key. Short rows (N <= ``SMALL_N``) keep a
[landmarks, N] tile on chip and find the k-th largest key by a four-way search over the row's key range (three
thresholds counted per step, in registers). Medium rows (N <= ``MEDIUM_N``): every order key goes to a scratch [BH, m,
N] buffer, and a few rows at a time come back as one tile for the same search; with the landmark values the key pass
also computes their split-key partials and the search's launch merges them. Long rows (the [m, N] scores are never
written): block tops (each key block's two largest scores and where its maximum sits); then one program per row (the
select kernel): a start threshold that at least k keys reach (bisection over group maxima), every key at or above it
into the row's [cap] candidate list in block order (each entry the packed int64 (order key, reversed index)), reading
the block tops: a block whose second score is below the threshold holds at most one such key, its maximum, so only
blocks with two or more are scored again; and, when they fit the list, the top-k of that list (bisection and one sort).
Rows with more than cap such keys (many ties, or a loose start) fall back on the device: 16-way refinement passes raise
the threshold until at most cap keys reach it (or until it is the k-th key itself), then a counting pass and an emitting
pass write the keys in key order (ties truncated to the lowest indices) and the top-k of those lists is selected, all in
one launch of persistent programs with grid barriers between the passes, which returns at once when no row needs it: no
host synchronisation, and the result is exact for any input. With the landmark values (``exact_topk(lv=...)``), the
block-top pass also computes their split-key partials and the select kernel merges them.

The kernels are in ``topk_scan.py`` (passes that score keys) and ``topk_select.py`` (per-row selection).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mita.ops.mita.triton.common import LOG2E, _cdiv, _next_pow2, _prec, _sm_count, _upcast, heads_layout
from mita.ops.mita.triton.landmark_values import landmark_values_fwd, lv_partials
from mita.ops.mita.triton.launch import fast, interpreting
from mita.ops.mita.triton.topk_scan import (
    _P,
    _PASSES,
    _topk_keys_kernel,
    _topk_rows_kernel,
    _topk_scan_kernel,
    _topk_small_kernel,
)
from mita.ops.mita.triton.topk_select import _topk_fallback_kernel, _topk_select_kernel

# Rows up to this length take the on-chip top-k (if the [N, d] key tile stays within _SMALL_BYTES).
SMALL_N = 512
_SMALL_BYTES = 1 << 16
# Rows up to this length (and above the short rows') take the medium-row path: order keys through a scratch buffer.
MEDIUM_N = 2048
# Entries of the medium-row search's tile ([rows, next power of 2 >= N]) and its warps: 2048 and 2 took exact_topk
# 17-20% below 4096 and 4 at Segmenter 512, LRA Image and ListOps on the H100 (the sweep of 2048-8192 entries and
# 2-8 warps: notes/kernels-notes.md).
_MEDIUM_TILE = 2048
_MEDIUM_WARPS = 2
# Programs of a long-row scan pass (landmark tiles x key chunks), a few waves on 132 SMs.
_SCAN_PROGRAMS = 2048
# Long-row top-k settings (measurements behind each default: notes/kernels-notes.md). bn: keys per step (at most
# 128: where a block's maximum sits is kept as an int8); bs: landmarks per tile
# (None: 64 for d <= 64, else 32); num_warps: warps of the passes that score keys (one setting for all: the passes
# that score keys again must reproduce the block-top pass's scores to the bit). block_top t > 1: the block-top pass
# keeps the t largest scores of each key block and the start threshold is the kk-th largest of all of them (None:
# _block_top: 1, 2, or at least 8 where rows have fewer key blocks than topk).
# emit_top 3: the block-top pass also keeps each block's third largest score and where its second sits, so the select
# kernel's emission scores again only blocks with three or more candidates; 2: with two or more (None: _emit_top);
# where block_top is a power of 2 above 3 the emission reads all of them instead (and the pass keeps where the keys of
# all but the last sit), so only blocks with block_top candidates or more are scored again.
# lv_div: with the landmark values (exact_topk(lv=...), computed by the block-top pass from its scores and merged by the
# select kernel), key chunks number at most N / (lv_div * m), so the float32 partials take at most 2 / lv_div of k's
# memory. The final selection orders the chosen indices by one tl.sort. lv_lazy: the landmark values' softmax, 1
# _softmax_lazy, 2 _softmax_fma (None: 2 up to 256K keys, else 1). start_steps: bisection steps of the start threshold
# (32: the exact kk-th largest block top; fewer: a looser lower bound). start_narrow / final_narrow: the start and final
# bisections over [min, max + 1) of the row's keys (final_narrow 2: the threshold from one descending sort; None: 2 for
# lists of <= 256 entries, else 1). The fallback rows (more candidates than the list holds) take one launch of
# persistent programs with grid barriers (_topk_fallback_kernel), which returns at once when no row overflows and also
# selects those rows' top-k: fb_spin sets how its barrier polls, fb_programs caps its programs (None: as many as the SMs
# hold at once; on a GPU share that reports more SMs than it runs, set it to what it holds). select_eb: key blocks per
# step of the select kernel's emission (None: up to 1024).
SCAN_CONFIG = dict(
    bn=64, bs=None, num_warps=4, block_top=None, emit_top=None, lv_div=8, lv_lazy=None, start_steps=20,
    start_narrow=1, final_narrow=None, fb_spin=0, fb_programs=None, select_eb=None,
)  # fmt: skip
# Entries (block maxima, or block tops) the start holds per row; beyond it it takes maxima of groups.
_START_ENTRIES = 8192
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


def _final_narrow(cap: int) -> int:
    """SCAN_CONFIG["final_narrow"]: how the final per-row selection of a cap-entry list finds its threshold
    (_final_row); None: by a sort (2) for lists of at most 256 entries (faster there), else the narrowed bisection
    (1)."""
    v = SCAN_CONFIG["final_narrow"]
    if v is None:
        return 2 if cap <= 256 else 1
    if v not in (0, 1, 2):
        raise ValueError(f"SCAN_CONFIG['final_narrow'] must be 0, 1, 2 or None, got {v}")
    return int(v)


def _emit_top(N: int, topk: int, bn: int) -> int:
    """Default block tops the select kernel's emission reads (SCAN_CONFIG["emit_top"] None): 3 where blocks with two
    candidates are common, i.e. where a row's ~topk candidates among N / bn blocks often share one (topk >= N / (8
    bn)); else 2, which saves the block-top pass a reduction (timings: notes/kernels-notes.md)."""
    return 3 if topk * 8 * bn >= N else 2


def _block_top(NB: int, topk: int, bn: int) -> int:
    """Default block tops per key block (SCAN_CONFIG["block_top"] None): 1 where the start cannot hold two per block
    (NB * 2 > _START_ENTRIES: it then takes maxima of groups); 2 where blocks number topk or more; else (rows of
    fewer blocks than topk, which the select kernel's emission then reads every top of) at least 8 and enough for 2
    topk entries in all, a power of 2 at most bn. With 2 tops per block at N 1024 or 2000 and topk 64 (the LRA
    experiments) the start threshold, the topk-th largest entry, sat below most of the row's keys and nearly every row
    overflowed its candidate list into the fallback (counted on the LRA encoders' own keys); with 4 or fewer most
    blocks held as many candidates as tops and were scored again; 16 made the block-top pass spill at Segmenter 512
    and was slower than 8 there (timings: notes/kernels-notes.md)."""
    if NB * 2 > _START_ENTRIES:
        return 1
    if NB >= topk:
        return 2
    return min(bn, max(8, _next_pow2(_cdiv(2 * topk, NB))))


def _valid_counts(key_valid: torch.Tensor, topk: int) -> torch.Tensor:
    # Keys per landmark row: min(valid keys, topk), int32 (a bool or int8 mask of 1 = valid).
    return key_valid.sum(-1, dtype=torch.int32).clamp_(max=topk)


class _ScanPlan(NamedTuple):
    """Geometry and settings of the long-row path, from SCAN_CONFIG and the shapes (``_scan_plan``)."""

    bn: int  # keys per block
    bs: int  # landmarks per tile
    n_s: int  # landmark tiles
    NB: int  # key blocks per row
    topt: int  # block tops the start threshold reads
    planes: int  # block tops the block-top pass keeps
    et: int  # block tops the select kernel's emission reads (2, 3, or topt where topt > 3)
    steps: int  # bisection steps of the start threshold
    lvf: bool  # landmark values from the block-top pass
    lv_lazy: int  # the landmark values' online softmax (SCAN_CONFIG lv_lazy)
    G: int  # key chunks per row
    CH: int  # keys per chunk
    cap: int  # candidate-list length
    rows: int  # BH * M
    bg: int  # key blocks per step of the block-top pass
    even: bool  # the block-top pass without masks


def _key_chunks(N: int, bn: int, tiles: int, max_chunks: int | None = None) -> tuple[int, int]:
    """Key chunks of a pass over (landmark tile, key chunk, head) programs with ``tiles`` landmark tiles x heads:
    about ``_SCAN_PROGRAMS`` programs, at most one chunk per key block and at most ``max_chunks`` (at least 1).
    Returns ``(chunks, keys per chunk)``, the latter a multiple of bn."""
    g = max(1, min(_cdiv(N, bn), _cdiv(_SCAN_PROGRAMS, tiles)))
    if max_chunks is not None:
        g = max(1, min(g, max_chunks))
    ch = _cdiv(_cdiv(N, g), bn) * bn
    return _cdiv(N, ch), ch


def _scan_plan(BH: int, M: int, N: int, D: int, topk: int, cap: int | None, has_kv: bool, lvf: bool) -> _ScanPlan:
    """The long-row path's settings (SCAN_CONFIG checked), tiles and key chunks."""
    bn = SCAN_CONFIG["bn"]
    bs = SCAN_CONFIG["bs"] or (64 if D <= 64 else 32)
    n_s = _cdiv(M, bs)
    NB = _cdiv(N, bn)
    topt = SCAN_CONFIG.get("block_top")
    topt = int(topt) if topt is not None else _block_top(NB, topk, bn)
    if topt < 1 or topt > bn:
        raise ValueError(f"SCAN_CONFIG['block_top'] must be in [1, bn = {bn}], got {topt}")
    e_top = SCAN_CONFIG.get("emit_top")
    e_top = int(e_top) if e_top is not None else _emit_top(N, topk, bn)
    if e_top not in (2, 3):
        raise ValueError(f"SCAN_CONFIG['emit_top'] must be 2, 3 or None, got {e_top}")
    # Where the start takes more than three tops per block (rows of few blocks) the emission reads all of them.
    et = topt if topt > 3 and not topt & (topt - 1) else e_top
    steps = int(SCAN_CONFIG["start_steps"])
    if not 12 <= steps <= 32:
        raise ValueError(f"SCAN_CONFIG['start_steps'] must be in [12, 32], got {steps}")
    if not 16 <= bn <= 128:
        raise ValueError(f"SCAN_CONFIG['bn'] must be in [16, 128], got {bn}")
    lv_lazy = SCAN_CONFIG["lv_lazy"]
    if lv_lazy is None:
        # 2 was faster at 64K and 256K; 1M was not timed with it and keeps 1.
        lv_lazy = 2 if N <= 1 << 18 else 1
    if lv_lazy not in (0, 1, 2):
        raise ValueError(f"SCAN_CONFIG['lv_lazy'] must be 0, 1, 2 or None, got {lv_lazy}")
    max_chunks = None
    if lvf:
        if int(SCAN_CONFIG["lv_div"]) < 1:
            raise ValueError(f"SCAN_CONFIG['lv_div'] must be >= 1, got {SCAN_CONFIG['lv_div']}")
        max_chunks = N // (int(SCAN_CONFIG["lv_div"]) * M)
    G, CH = _key_chunks(N, bn, n_s * BH, max_chunks)
    cap = _next_pow2(max(cap or 2 * topk, topk, 64))
    _final_narrow(cap)
    # Key blocks per step of the block-top pass, at most a chunk's.
    bg = min(8, _next_pow2(CH // bn))
    # The block-top pass without masks: no padding, whole landmark tiles, whole steps of bg blocks in every chunk.
    even = not has_kv and M % bs == 0 and N % CH == 0 and CH % (bn * bg) == 0
    # Block tops: plane t = each key block's (t+1)-th largest score per row (at least the et the select kernel's
    # emission reads).
    planes = max(topt, et)
    return _ScanPlan(
        bn=bn, bs=bs, n_s=n_s, NB=NB, topt=topt, planes=planes, et=et, steps=steps, lvf=lvf, lv_lazy=lv_lazy, G=G,
        CH=CH, cap=cap, rows=BH * M, bg=bg, even=even,
    )  # fmt: skip


class _ScanBuffers(NamedTuple):
    """The long-row path's device buffers (``_scan_buffers``)."""

    cmax: torch.Tensor
    arg: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    done: torch.Tensor
    off: torch.Tensor
    cnt: torch.Tensor
    cand: torch.Tensor
    idx: torch.Tensor
    pm: torch.Tensor
    pl: torch.Tensor
    pacc: torch.Tensor
    vv: torch.Tensor
    lv_scale: float


def _scan_buffers(p: _ScanPlan, r: torch.Tensor, topk: int, lv: tuple | None) -> _ScanBuffers:
    """Allocate the long-row path's buffers (each written by a kernel before it is read)."""
    BH, M, D = r.shape
    dev, rows, G = r.device, p.rows, p.G
    # Block tops: planes [rows, NB] of scores, and where in the block the keys of the first et - 1 sit.
    cmax = torch.empty(p.planes, rows, p.NB, device=dev, dtype=torch.float32)
    arg = torch.empty(p.et - 1, rows, p.NB, device=dev, dtype=torch.int8)
    # State slot i = (lo, hi, done) of each row before refinement pass i; slot _PASSES: the final state.
    lo = torch.empty(_PASSES + 1, rows, device=dev, dtype=torch.int64)
    hi = torch.empty(_PASSES + 1, rows, device=dev, dtype=torch.int64)
    done = torch.empty(_PASSES + 1, rows, device=dev, dtype=torch.int32)
    # Per row: the count of keys >= the start threshold (the select kernel's); then the persistent fallback kernel's
    # barrier counter.
    off = torch.empty(rows + 1, device=dev, dtype=torch.int32)
    # Refinement counts [passes, rows, P], then the per-chunk counts of the fallback rows [rows, G, 2].
    cnt = torch.empty(_PASSES * rows * _P + rows * G * 2, device=dev, dtype=torch.int32)
    cand = torch.empty(rows, p.cap, device=dev, dtype=torch.int64)
    idx = torch.empty(BH, M, topk, device=dev, dtype=torch.int32)
    if p.lvf:
        # The landmark values' split-key partials, one per (key chunk, landmark), merged by the select kernel.
        pm = torch.empty(BH, G, M, device=dev, dtype=torch.float32)
        pl = torch.empty(BH, G, M, device=dev, dtype=torch.float32)
        pacc = torch.empty(BH, G, M, D, device=dev, dtype=torch.float32)
        vv, lv_scale = lv[0], lv[1] * LOG2E
    else:
        pm = pl = pacc = vv = r
        lv_scale = 1.0
    return _ScanBuffers(cmax, arg, lo, hi, done, off, cnt, cand, idx, pm, pl, pacc, vv, lv_scale)


def _topk_small(r, k, kv, kk, key_valid, topk: int, lay, NP: int, prec, up) -> torch.Tensor:
    """Short rows: the on-chip top-k (``_topk_small_kernel``), one program per (16 landmarks, head)."""
    BH, M, D = r.shape
    N = k.shape[-2]
    idx = torch.empty(BH, M, topk, device=r.device, dtype=torch.int32)
    bs = 16
    fast(_topk_small_kernel)[(_cdiv(M, bs), BH)](
        r,
        k,
        kv,
        kk,
        idx,
        N,
        M,
        topk,
        *lay,
        HAS_KV=key_valid is not None,
        D=D,
        BS=bs,
        NP=NP,
        KP=max(16, _next_pow2(topk)),
        PREC=prec,
        UP=up,
        EXACT=interpreting(),
        num_warps=4 if NP <= 256 else 8,
    )
    return idx


def _topk_medium(r, k, kv, kk, key_valid, topk: int, lay, NP: int, prec, up, lv=None, after_keys=None):
    """Medium rows: the order keys into a scratch ``[BH, m, N]`` int32 buffer (``_topk_keys_kernel``, one program
    per (landmark tile, key chunk, head); with ``lv = (v, scale)`` also the landmark values' split-key partials from
    the same scores), then the short rows' search on a few rows at a time (``_topk_rows_kernel``, which then merges
    the partials); ``after_keys()`` (when given) is called between the two launches. Returns the indices, or with
    ``lv`` ``(indices, vt, lse)`` as :func:`landmark_values_fwd` returns them."""
    BH, M, D = r.shape
    N = k.shape[-2]
    dev = r.device
    idx = torch.empty(BH, M, topk, device=dev, dtype=torch.int32)
    ns = _cdiv(N, 16) * 16
    scr = torch.empty(BH, M, ns, device=dev, dtype=torch.int32)
    bs, bn = (64 if D <= 64 else 32), 64
    n_s = _cdiv(M, bs)
    # With the landmark values at most N / (lv_div m) key chunks: the float32 partials stay within 2 / lv_div of k's
    # memory.
    g, ch = _key_chunks(N, bn, n_s * BH, None if lv is None else N // (int(SCAN_CONFIG["lv_div"]) * M))
    has_kv = key_valid is not None
    direct = lv is None or g == 1
    if lv is None:
        vv, scale, vt, lse = r, 1.0, r, r
    else:
        vv, scale = lv[0], lv[1] * LOG2E
        vt = torch.empty(BH, M, D, device=dev, dtype=r.dtype)
        lse = torch.empty(BH, M, device=dev, dtype=torch.float32)
    pm, pl, pacc = lv_partials(BH, g, M, D, dev, direct, lse)
    fast(_topk_keys_kernel)[(n_s, g, BH)](
        r, k, vv, kv, scr, pm, pl, pacc, vt, lse, scale, N, M, ch, ns, *lay, HAS_KV=has_kv, LV=lv is not None,
        DIRECT=direct, D=D, BS=bs, BN=bn, PREC=prec, UP=up, EXACT=interpreting(), num_warps=4,
    )  # fmt: skip
    if after_keys is not None:
        after_keys()
    # Rows a little longer than a power of 2 (Segmenter's 1025 tokens): that power of 2 as the main tile and the rest
    # as a tail of at most an eighth of it, instead of a tile twice as long.
    np1 = _next_pow2(N) // 2
    nt = max(16, _next_pow2(N - np1)) if N > np1 >= 256 and _next_pow2(N - np1) * 8 <= np1 else 0
    if nt:
        NP = np1
    rs = max(1, _MEDIUM_TILE // NP)
    fast(_topk_rows_kernel)[(_cdiv(M, rs), BH)](
        kv, kk, idx, scr, pm, pl, pacc, vt, lse, N, M, topk, ns, g, HAS_KV=has_kv, NP=NP, NT=nt, RS=rs,
        KP=max(16, _next_pow2(topk)), MERGE=not direct, D=D, BC=min(64, _next_pow2(g)), num_warps=_MEDIUM_WARPS,
    )  # fmt: skip
    return idx if lv is None else (idx, vt, lse)


def exact_topk(
    r: torch.Tensor,
    k: torch.Tensor,
    key_valid: torch.Tensor | None,
    topk: int,
    *,
    small_max_n: int = SMALL_N,
    medium_max_n: int | None = None,
    cap: int | None = None,
    timer=None,
    stats: dict | None = None,
    lv: tuple | None = None,
    after_scan=None,
):
    """Per landmark, the indices of the ``topk`` valid keys with the largest raw score, ties to the lower index.

    Args:
        r: ``[BH, m, d]`` landmarks.
        k: ``[BH, N, d]`` or ``[B, H, N, d]`` keys (same dtype as r; any layout :func:`heads_layout` takes).
        key_valid: ``[BH, N]`` bool or int8 (1 = valid), or None when every key is valid.
        topk: keys per landmark, ``1 <= topk <= N``.
        small_max_n: rows up to this length take the on-chip kernel (when the key tile fits in 64 KiB).
        medium_max_n: longer rows up to this length take the medium-row path (None: ``MEDIUM_N``); 0 sends every
            row beyond small_max_n to the long-row path.
        cap: candidate-list length of the long-row path (default ``2 topk``; at least ``max(topk, 64)``, rounded up
            to a power of 2). Rows with more keys above the start threshold than cap take the refinement passes.
        timer: None, or ``timer(name, fn)`` that runs ``fn()`` (profiling: each pass of the long-row path is one
            named call).
        stats: None, or a dict that receives (long-row path only) ``"cap"``, ``"counts"`` (``[BH * m]`` int32
            device tensor: keys at or above each row's start threshold), ``"overflow_rows"`` (device
            tensor: rows with more than cap such keys, which take the refinement passes). No host
            synchronisation; ``scripts/bench/sweep.py --model`` models the start threshold on the CPU.
        lv: None, or ``(v, scale)``: also compute the landmark values ``softmax(R k^T scale) v`` over the valid keys
            (v in k's layout), as :func:`landmark_values_fwd` does; on the medium- and long-row paths the pass
            that scores the keys computes them from the scores it already has.
        after_scan: None, or a callable called (no arguments) right after the long-row path's block-top pass is
            queued, or the medium-row path's key pass (the MiTA forward forks its routing onto a second stream
            there, FWD_CONFIG route_stream); not called on the on-chip path.

    Returns:
        ``[BH, m, topk]`` int32 key indices, ascending, then -1 for the slots a row has no valid key for. With lv:
        ``(indices, vt, lse)`` as :func:`landmark_values_fwd` returns them.
    """
    BH, M, D = r.shape
    N = k.shape[-2]
    lay = heads_layout(k) if lv is None else heads_layout(k, lv[0])
    kv = key_valid.to(torch.int8).contiguous() if key_valid is not None else r
    # Without padding every row keeps topk keys: no count tensor (the kernels take topk).
    kk = _valid_counts(key_valid, topk) if key_valid is not None else r
    NP = max(16, _next_pow2(N))
    if N <= small_max_n and NP * D * k.element_size() <= _SMALL_BYTES:
        idx = _topk_small(r, k, kv, kk, key_valid, topk, lay, NP, _prec(r.dtype), _upcast(r.dtype))
        return idx if lv is None else (idx, *landmark_values_fwd(r, k, lv[0], key_valid, lv[1]))
    if N <= (MEDIUM_N if medium_max_n is None else medium_max_n):
        return _topk_medium(r, k, kv, kk, key_valid, topk, lay, NP, _prec(r.dtype), _upcast(r.dtype), lv, after_scan)
    st = _settings(
        BH, M, N, D, topk, cap, key_valid is not None, lv is not None, r.dtype, r.device.index, interpreting(),
        _config_key(),
    )  # fmt: skip
    p = st.plan
    b = _scan_buffers(p, r, topk, lv)

    def run(name, fn):
        return fn() if timer is None else timer(name, fn)

    run(
        "block maxima" if not p.lvf else "block maxima + landmark values",
        lambda: fast(_topk_scan_kernel)[(p.n_s, p.G, BH)](
            r, k, kv, kk, b.lo, b.hi, b.done, b.cmax, b.arg, b.cnt, b.off, b.cand, b.vv, b.pm, b.pl, b.pacc, b.lv_scale,
            N, M, p.CH, p.G, p.NB, p.cap, topk, *lay, p.rows, 0,
            **st.scan_kw,
        ),
    )  # fmt: skip
    if after_scan is not None:
        after_scan()
    if p.lvf:
        vt = torch.empty(BH, M, D, device=r.device, dtype=r.dtype)
        lse = torch.empty(BH, M, device=r.device, dtype=torch.float32)
    else:
        vt = lse = r
    # Start threshold, count + emit and top-k of the candidate lists: one per-row kernel (the rows whose candidates
    # overflow the list are left to the fallback).
    run(
        "start + count + emit + top-k (per row)" + (" + landmark values merge" if p.lvf else ""),
        lambda: fast(_topk_select_kernel)[(p.rows,)](
            r, k, kv, b.cmax, b.arg, kk, b.lo, b.hi, b.off, b.cnt, b.cand, b.idx, b.pm, b.pl, b.pacc, vt, lse, N,
            M, p.NB * p.topt, p.NB, p.cap, topk, *lay, p.rows, p.G,
            **st.select_kw,
        ),
    )  # fmt: skip
    if stats is not None:
        stats["cap"] = p.cap
        stats["counts"] = b.off[: p.rows].clone()
        stats["overflow_rows"] = (b.off[: p.rows] > p.cap).sum()
    _fallback(st, b, r, k, kv, kk, topk, lay, run)
    if lv is None:
        return b.idx
    return b.idx, vt, lse


class _Settings(NamedTuple):
    """Everything the long-row path's launches take that depends on the shapes and SCAN_CONFIG alone
    (``_settings``)."""

    plan: _ScanPlan
    scan_kw: dict  # the block-top pass's constexprs and launch options
    select_kw: dict  # the select kernel's
    fb_kw: dict  # the fallback kernel's
    fb_key: tuple  # (device index, the fallback's constexprs): _FB_RESIDENT's key


def _config_key() -> tuple:
    """What :func:`_scan_plan` and :func:`_settings` read besides the shapes: the items of SCAN_CONFIG, _START_ENTRIES
    and _SCAN_PROGRAMS (part of ``_settings``' cache key, so that a changed setting is a new entry)."""
    return (*SCAN_CONFIG.items(), _START_ENTRIES, _SCAN_PROGRAMS)


@functools.lru_cache(maxsize=256)
def _settings(
    BH: int, M: int, N: int, D: int, topk: int, cap: int | None, has_kv: bool, lvf: bool, dtype: torch.dtype,
    dev_index: int | None, exact: bool, config: tuple,
) -> _Settings:  # fmt: skip
    """The long-row path's settings for one shape, computed once per shape and ``config`` (:func:`_config_key`).
    Raises on invalid settings (nothing cached)."""
    del config  # (part of the cache key only)
    p = _scan_plan(BH, M, N, D, topk, cap, has_kv, lvf)
    warps = SCAN_CONFIG["num_warps"]
    common = dict(HAS_KV=has_kv, D=D, BS=p.bs, BN=p.bn, PREC=_prec(dtype), UP=_upcast(dtype), EXACT=exact, P=_P)
    scan_kw = dict(
        MODE=0, SKIP=False, TOPT=p.planes, BG=p.bg, ET=p.et, LVF=p.lvf, EVEN=p.even,
        LAZY=int(p.lv_lazy) if p.lvf else 0, **common, num_warps=warps,
    )  # fmt: skip
    # Groups of f block entries keep the start's maxima in registers (<= _START_ENTRIES per row).
    f = _next_pow2(_cdiv(p.NB * p.topt, _START_ENTRIES))
    gp = _next_pow2(_cdiv(p.NB * p.topt, f))
    eb = SCAN_CONFIG["select_eb"] or max(16, min(1024, _next_pow2(p.NB)))
    if eb & (eb - 1) or eb < 16:
        raise ValueError(f"SCAN_CONFIG['select_eb'] must be a power of 2 >= 16 or None, got {eb}")
    select_kw = dict(
        F=f, GP=gp, ONE_PLANE=p.topt == 1, STEPS=p.steps, NARROW=bool(SCAN_CONFIG["start_narrow"]), ET=p.et,
        EB=eb, FNARROW=_final_narrow(p.cap), MERGE=p.lvf, BC=min(64, _next_pow2(p.G)), CP=p.cap, **common,
        num_warps=warps,
    )  # fmt: skip
    fb_kw = dict(
        **common, RB=min(4096, _next_pow2(p.rows)), SPIN=int(SCAN_CONFIG["fb_spin"]), FNARROW=_final_narrow(p.cap),
        CP=p.cap, num_warps=warps,
    )  # fmt: skip
    return _Settings(p, scan_kw, select_kw, fb_kw, (dev_index, tuple(sorted(fb_kw.items()))))


def _fallback(st: _Settings, b: _ScanBuffers, r, k, kv, kk, topk: int, lay, run) -> None:
    """The rows with more candidates than the list holds: refinement passes, recount, ordered emit and top-k in one
    launch of persistent programs (which returns at once when no row needs it)."""
    p = st.plan
    BH, M = r.shape[0], r.shape[1]
    N = k.shape[-2]
    dev = r.device
    okey = st.fb_key
    if interpreting():
        nprog = 1
    else:
        # As many programs as the SMs hold at once (_resident_per_sm; one per SM until the first launch of these
        # constexprs has compiled the kernel), so that every program is resident.
        nprog = min(p.n_s * p.G * BH, _sm_count(dev) * _FB_RESIDENT.get(okey, 1))
    if SCAN_CONFIG["fb_programs"]:
        nprog = min(nprog, int(SCAN_CONFIG["fb_programs"]))

    def fallback():
        compiled = fast(_topk_fallback_kernel)[(nprog,)](
            r, k, kv, kk, b.lo, b.hi, b.done, b.cnt, b.off, b.cand, b.idx, N, M, p.CH, p.G, p.NB, p.cap, topk, *lay,
            p.rows, p.n_s, BH, nprog,
            **st.fb_kw,
        )  # fmt: skip
        if not interpreting() and okey not in _FB_RESIDENT and compiled is not None:
            _FB_RESIDENT[okey] = _resident_per_sm(compiled, st.fb_kw["num_warps"], dev)

    run("fallback rows (refinement, recount, ordered emit, top-k; persistent)", fallback)


def _compile_cases() -> list:
    """Kernels and constexpr settings (bf16, d 64) for scripts/bench/compile_check.py beyond its own list: the
    top-k kernels."""
    common = dict(D=64, PREC="tf32", UP=False)
    i32, i64 = "*i32", "*i64"
    scan = dict(KK=i32, LO=i64, HI=i64, DONE=i32, CMAX="*fp32", ARG="*i8", CNT=i32, OFF=i32, CAND=i64)
    sc = dict(P=_P, HAS_KV=False, BS=64, BN=64, EXACT=False, LVF=0, EVEN=0, LAZY=0, **common)
    lvf = dict(scan, PM="*fp32", PL="*fp32", PACC="*fp32")
    sel = dict(lvf, IDX=i32)
    return [
        ("topk_scan mode 0 e3 + lv", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=3, BG=8, ET=3, **{**sc, "LVF": 1}), 4, lvf),
        ("topk_scan mode 0 + lv", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=2, BG=8, ET=2, **{**sc, "LVF": 1}), 4, lvf),
        ("topk_scan mode 0 e3 + lv even lazy", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=3, BG=8, ET=3, **{**sc, "LVF": 1, "EVEN": 1, "LAZY": 1}), 4, lvf),
        ("topk_scan mode 0 e3 + lv even fma", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=3, BG=8, ET=3, **{**sc, "LVF": 1, "EVEN": 1, "LAZY": 2}), 4, lvf),
        ("topk_scan mode 0 + lv even lazy", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=2, BG=8, ET=2, **{**sc, "LVF": 1, "EVEN": 1, "LAZY": 1}), 4, lvf),
        ("topk_scan mode 0 + lv even", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=2, BG=8, ET=2, **{**sc, "LVF": 1, "EVEN": 1}), 4, lvf),
        ("topk_scan mode 0 + lv bs 128", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=2, BG=8, ET=2, **{**sc, "LVF": 1, "BS": 128}), 8, lvf),
        ("topk_scan mode 0 top-4", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=4, BG=8, ET=2, **sc), 4, scan),
        ("topk_scan mode 0 e3", _topk_scan_kernel, dict(MODE=0, SKIP=False, TOPT=3, BG=8, ET=3, **sc), 4, scan),
        ("topk_scan mode 0 e3 top-4", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=4, BG=8, ET=3, **sc), 4, scan),
        ("topk_scan mode 1 skip", _topk_scan_kernel,
         dict(MODE=1, SKIP=True, TOPT=1, BG=1, ET=2, **sc), 4, scan),
        ("topk_scan mode 3 skip", _topk_scan_kernel,
         dict(MODE=3, SKIP=True, TOPT=1, BG=1, ET=2, **sc), 4, scan),
        ("topk_fallback (persistent)", _topk_fallback_kernel,
         dict(P=_P, HAS_KV=False, BS=64, BN=64, EXACT=False, RB=256, SPIN=0, CP=256, FNARROW=1, **common), 4,
         dict(scan, BH="i32", NPROG="i32", IDX=i32)),
        ("topk_fallback (persistent) 1M", _topk_fallback_kernel,
         dict(P=_P, HAS_KV=False, BS=64, BN=64, EXACT=False, RB=1024, SPIN=0, CP=1024, FNARROW=1, **common), 4,
         dict(scan, BH="i32", NPROG="i32", IDX=i32)),
        ("topk_fallback (persistent) kv", _topk_fallback_kernel,
         dict(P=_P, HAS_KV=True, BS=32, BN=64, EXACT=False, RB=4096, SPIN=1, CP=256, FNARROW=0, **common), 4,
         dict(scan, BH="i32", NPROG="i32", IDX=i32)),
        ("topk_select 64K e3 merge", _topk_select_kernel,
         dict(HAS_KV=False, F=1, GP=2048, P=_P, ONE_PLANE=False, STEPS=20, NARROW=1, BS=64, BN=64, EXACT=False, ET=3,
              EB=1024, CP=256, FNARROW=1, MERGE=1, BC=64, **common), 4,
         dict(sel, VT="*bf16")),
        ("topk_select 64K e3 merge sort-select", _topk_select_kernel,
         dict(HAS_KV=False, F=1, GP=2048, P=_P, ONE_PLANE=False, STEPS=20, NARROW=1, BS=64, BN=64, EXACT=False, ET=3,
              EB=1024, CP=256, FNARROW=2, MERGE=1, BC=64, **common), 4,
         dict(sel, VT="*bf16")),
        ("topk_select 1M", _topk_select_kernel,
         dict(HAS_KV=False, F=2, GP=8192, P=_P, ONE_PLANE=True, STEPS=20, NARROW=1, BS=64, BN=64, EXACT=False, ET=2,
              EB=1024, CP=1024, FNARROW=1, MERGE=1, BC=64, **common), 4,
         dict(sel, VT="*bf16")),
        ("topk_scan mode 0 top-8 wide emission + lv", _topk_scan_kernel,
         dict(MODE=0, SKIP=False, TOPT=8, BG=8, ET=8, **{**sc, "LVF": 1}), 4, lvf),
        ("topk_select N 1025 wide emission merge", _topk_select_kernel,
         dict(HAS_KV=False, F=1, GP=256, P=_P, ONE_PLANE=False, STEPS=20, NARROW=1, BS=64, BN=64, EXACT=False, ET=8,
              EB=32, CP=128, FNARROW=2, MERGE=1, BC=64, **common), 4,
         dict(sel, VT="*bf16")),
        ("topk_select kv", _topk_select_kernel,
         dict(HAS_KV=True, F=1, GP=1024, P=_P, ONE_PLANE=False, STEPS=32, NARROW=0, BS=32, BN=64, EXACT=False, ET=2,
              EB=512, CP=256, FNARROW=0, MERGE=0, BC=64, **common), 4,
         dict(sel, VT="*bf16")),
    ]  # fmt: skip
