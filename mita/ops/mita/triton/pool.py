"""Landmark pooling kernels, on CUDA.

bfloat16 2D pooling with a cached 0/1 operator (``mita.ops.landmarks._PoolBF16``), one launch per direction.
Forward: ``out[g, i] = sum_n member[i, n] x[g, n] / counts[i]``: bf16 tiles of the 0/1 membership times bf16 tiles
of x on tensor cores with float32 accumulation, divided in float32 and rounded once, written straight into the
landmarks' layout (``[G, H, m, d]`` for heads interleaved with channels, else ``[G, m, C]``). Backward:
``dx[g, n] = sum_i w[n, i] g[g, i]`` over the few landmarks i that average token n (at most 4 for adaptive bins:
a cached per-token table, ``_PoolTables.token_bins``), float32 weights (1/9 is not a bf16 number) and products,
rounded once into x's dtype (a dense product over all m landmarks computes 16 times the terms at m = 49). The
PyTorch formulation it replaces took a float32-output GEMM (a slow generic kernel), and in the backward a float32
GEMM, a float32 [G, N, C] buffer and a cast: about 0.2 ms of a DeiT-S layer's 2 ms on the H200
(notes/kernels-notes.md).

1D segment means without padding (``pool1d_fwd``, N divisible by m) and over the valid tokens of padded sequences
(``pool1d_masked_fwd`` / ``pool1d_masked_bwd``, ``mita.ops.landmarks._Pool1DMasked``): one launch each way where the
PyTorch form (prefix sums, searches and gathers) takes about 28 kernels forward and 14 backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mita.ops.mita.triton.common import _cdiv, _dot, _next_pow2
from mita.ops.mita.triton.launch import fast, interpreting

# Launch settings (tokens x channels per program).
CONFIG = {
    "fwd": dict(BN=64, BC=64, num_warps=4, num_stages=2),
    "bwd": dict(BN=32, BC=64, num_warps=4, num_stages=1),
}


@triton.jit
def _pool_fwd_kernel(
    X,
    MEMB,
    CNT,
    OUT,
    N,
    M,
    C,
    DH,
    SXG,
    SXN,
    MP: tl.constexpr,
    BN: tl.constexpr,
    BC: tl.constexpr,
    UP: tl.constexpr,
):
    """One (group, channel block): [MP, BC] float32 sums over every token block, divided by the counts."""
    i_g = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    o_i = tl.arange(0, MP)
    m_i = o_i < M
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    acc = tl.zeros([MP, BC], tl.float32)
    for n0 in range(0, N, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < N
        b_mb = tl.load(MEMB + o_i[:, None] * N + o_n[None, :], mask=m_i[:, None] & m_n[None, :], other=0.0)
        b_x = tl.load(X + i_g * SXG + o_n[:, None] * SXN + o_c[None, :], mask=m_n[:, None] & m_c[None, :], other=0.0)
        acc += _dot(b_mb, b_x, "tf32", UP)
    cnt = tl.load(CNT + o_i, mask=m_i, other=1.0)
    out = acc / cnt[:, None]
    # Channel c of landmark i goes to head c // DH, row i, column c % DH (DH = C: no heads).
    p_out = i_g * M * C + (o_c[None, :] // DH) * M * DH + o_i[:, None] * DH + (o_c[None, :] % DH)
    tl.store(OUT + p_out, out.to(OUT.dtype.element_ty), mask=m_i[:, None] & m_c[None, :])


@triton.jit
def _pool_bwd_kernel(
    G,
    BIDX,
    BW,
    DX,
    N,
    C,
    DH,
    SGG,
    SGH,
    SGM,
    KB: tl.constexpr,
    BN: tl.constexpr,
    BC: tl.constexpr,
):
    """One (group, token block, channel block): dx[n] = sum over the KB landmarks that average token n (BIDX, BW:
    [N, KB], weight 0 past a token's own) of weight x g[landmark], in float32 in that order, rounded once."""
    i_g = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1)
    i_c = tl.program_id(2)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    # g's channel c of landmark i: head c // DH, row i, column c % DH (its own strides; unit column stride). Offsets
    # within one group (int32: a group's g and dx hold fewer than 2^31 elements).
    G_g = G + i_g * SGG
    c_off = (o_c // DH) * SGH + o_c % DH
    acc = tl.zeros([BN, BC], tl.float32)
    for j in tl.static_range(KB):
        b_i = tl.load(BIDX + o_n * KB + j, mask=m_n, other=0)
        b_w = tl.load(BW + o_n * KB + j, mask=m_n, other=0.0)
        b_g = tl.load(G_g + (b_i[:, None] * SGM + c_off[None, :]), mask=m_n[:, None] & m_c[None, :], other=0.0)
        acc += b_w[:, None] * b_g.to(tl.float32)
    DX_g = DX + i_g * N * C
    tl.store(DX_g + (o_n[:, None] * C + o_c[None, :]), acc.to(DX.dtype.element_ty), mask=m_n[:, None] & m_c[None, :])


def pool_fwd(x3: torch.Tensor, member: torch.Tensor, counts: torch.Tensor, heads: int) -> torch.Tensor:
    """x3 ``[G, N, C]`` bf16 (unit channel stride), member ``[m, N]`` bf16 0/1, counts ``[m, 1]`` float32.

    Returns ``[G, heads, m, C // heads]`` (heads > 0) or ``[G, m, C]``, contiguous, in x3's dtype."""
    G, N, C = x3.shape
    M = member.shape[0]
    if x3.stride(2) != 1:
        x3 = x3.contiguous()
    dh = C // heads if heads else C
    out = x3.new_empty((G, heads, M, dh) if heads else (G, M, C))
    cfg = dict(CONFIG["fwd"])
    cfg["BC"] = min(cfg["BC"], max(16, _next_pow2(C)))
    fast(_pool_fwd_kernel)[(G, _cdiv(C, cfg["BC"]))](
        x3,
        member.contiguous(),
        counts.reshape(-1).contiguous(),
        out,
        N,
        M,
        C,
        dh,
        x3.stride(0),
        x3.stride(1),
        MP=max(16, _next_pow2(M)),
        UP=interpreting(),
        **cfg,
    )
    return out


def pool_bwd(g: torch.Tensor, token_bins: tuple[torch.Tensor, torch.Tensor], heads: int, dtype: torch.dtype):
    """g ``[G, heads, m, d]`` (heads > 0) or ``[G, m, C]``, any strides with a unit last one; token_bins: the
    landmarks that average each token and their weights, ``([N, kb] int32, [N, kb] float32)`` (weight 0 past a
    token's own: ``mita.ops.landmarks._PoolTables.token_bins``). Returns dx ``[G, N, C]`` contiguous in ``dtype``."""
    bidx, bw = token_bins
    N, kb = bidx.shape
    if g.stride(-1) != 1:
        g = g.contiguous()
    if heads:
        G, H, _, dh = g.shape
        C = H * dh
        sgg, sgh, sgm = g.stride(0), g.stride(1), g.stride(2)
    else:
        G, _, C = g.shape
        dh = C
        sgg, sgh, sgm = g.stride(0), 0, g.stride(1)
    dx = torch.empty(G, N, C, device=g.device, dtype=dtype)
    cfg = dict(CONFIG["bwd"])
    cfg["BC"] = min(cfg["BC"], max(16, _next_pow2(C)))
    fast(_pool_bwd_kernel)[(G, _cdiv(N, cfg["BN"]), _cdiv(C, cfg["BC"]))](
        g, bidx, bw, dx, N, C, dh, sgg, sgh, sgm, KB=kb, **cfg
    )
    return dx


# ----------------------------------------------------------------------------------------------------------------
# 1D landmarks: contiguous segment means (pool_landmarks(layout="1d") without padding, N divisible by m)
# ----------------------------------------------------------------------------------------------------------------

# Rows per step of the 1D pooling kernel, its warps, and loads without masks where the steps divide the segments.
# 128 rows at 8 warps were level with or faster than 64 rows at 4 warps from 64K to 1M on the H200, unmasked loads
# level with masked ones (notes/kernels-notes.md).
CONFIG["fwd1d"] = dict(BL=128, num_warps=8, unmasked=1)


@triton.jit
def _pool1d_fwd_kernel(X, OUT, H, M, L, SB, SH, SN, D: tl.constexpr, BL: tl.constexpr, EVEN: tl.constexpr):
    """One (landmark, batch-head): the float32 sum of its L rows, divided by L and rounded once. EVEN: L % BL == 0
    (loads without masks)."""
    i_i = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, D)
    X_h = X + (i_bh // H) * SB + (i_bh % H) * SH + i_i * L * SN
    acc = tl.zeros([BL, D], tl.float32)
    for l0 in range(0, L, BL):
        o_l = l0 + tl.arange(0, BL)
        if EVEN:
            acc += tl.load(X_h + o_l.to(tl.int64)[:, None] * SN + o_d[None, :]).to(tl.float32)
        else:
            p_x = X_h + o_l.to(tl.int64)[:, None] * SN + o_d[None, :]
            acc += tl.load(p_x, mask=(o_l < L)[:, None], other=0.0).to(tl.float32)
    out = tl.sum(acc, 0) / L
    tl.store(OUT + (i_bh * M + i_i) * D + o_d, out.to(OUT.dtype.element_ty))


def pool1d_supported(x: torch.Tensor, m: int) -> bool:
    """Whether :func:`pool1d_fwd` takes x ``[B, H, N, d]``: fp16 / bf16, d a power of 2 in [16, 256], unit feature
    stride, N divisible by m."""
    return (
        x.dim() == 4
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.shape[-1] in (16, 32, 64, 128, 256)
        and x.stride(-1) == 1
        and x.shape[2] % m == 0
    )


def pool1d_fwd(x: torch.Tensor, m: int) -> torch.Tensor:
    """Means of m contiguous segments of N / m rows of x ``[B, H, N, d]`` (any batch, head and row strides, unit
    feature stride): ``[B, H, m, d]`` contiguous in x's dtype, float32 sums divided by N / m and rounded once (the
    arithmetic of ``pool_landmarks(layout="1d")``'s PyTorch form, in another summation order)."""
    if not pool1d_supported(x, m):
        raise ValueError(f"pool1d_fwd: unsupported input {tuple(x.shape)} {x.dtype} strides {x.stride()} for m={m}")
    B, H, N, D = x.shape
    out = torch.empty(B, H, m, D, device=x.device, dtype=x.dtype)
    cfg = dict(CONFIG["fwd1d"])
    cfg["BL"] = min(cfg["BL"], max(16, _next_pow2(N // m)))
    even = bool(cfg.pop("unmasked", 1)) and (N // m) % cfg["BL"] == 0
    fast(_pool1d_fwd_kernel)[(m, B * H)](
        x, out, H, m, N // m, x.stride(0), x.stride(1), x.stride(2), D=D, EVEN=even, **cfg
    )
    return out


# ---- 1D landmarks over the valid tokens of padded sequences ---------------------------------------------------------


@triton.jit
def _valid(MASK, i_b, SMB, o_n, N):
    # 1 where position o_n of mask row i_b holds a valid token (MASK: 1 for padding, bool as uint8), else 0 (int32).
    return (tl.load(MASK + i_b * SMB + o_n, mask=o_n < N, other=1) == 0).to(tl.int32)


@triton.jit
def _valid_ranks(MASK, i_b, SMB, o_n, N, carry):
    # (_valid of positions o_n, each one's rank among the row's valid tokens given carry valid tokens before o_n[0]).
    b_v = _valid(MASK, i_b, SMB, o_n, N)
    return b_v, carry + tl.cumsum(b_v, 0) - b_v


@triton.jit
def _valid_counts(MASK, i_b, SMB, N, c0, BC: tl.constexpr):
    # (valid tokens of mask row i_b, valid tokens before position c0).
    total = 0
    before = 0
    for n0 in range(0, N, BC):
        o_n = n0 + tl.arange(0, BC)
        b_v = _valid(MASK, i_b, SMB, o_n, N)
        total += tl.sum(b_v, 0)
        before += tl.sum(tl.where(o_n < c0, b_v, 0), 0)
    return total, before


@triton.jit
def _bins(o_i, L, M):
    # Landmark i's ranks among the L valid tokens: [floor(i L / M), ceil((i + 1) L / M)) (int64 products), and its
    # token count (at least 1: an all-padding row averages nothing to 0).
    Li = L.to(tl.int64)
    start = (o_i.to(tl.int64) * Li) // M
    end = ((o_i.to(tl.int64) + 1) * Li + M - 1) // M
    return start.to(tl.int32), end.to(tl.int32), tl.maximum(end - start, 1).to(tl.float32)


@triton.jit
def _pool1d_masked_fwd_kernel(
    X, MASK, OUT, H, M, N, SB, SH, SN, SMB,
    D: tl.constexpr, BI: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
):  # fmt: skip
    """Program (BI landmarks, batch-head): each landmark's mean over the valid tokens of its rank range, float32 sums
    (0/1 weights times x on the tensor cores) divided by the count and rounded once. The scan over the row stops
    once the running rank passes the block's last range."""
    i_i = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    L, _ = _valid_counts(MASK, i_b, SMB, N, 0, BC)
    o_i = i_i * BI + tl.arange(0, BI)
    m_i = o_i < M
    start, end, cnt = _bins(o_i, L, M)
    hi = tl.max(tl.where(m_i, end, 0), 0)
    X_h = X + i_b * SB + (i_bh % H) * SH
    o_d = tl.arange(0, D)
    acc = tl.zeros([BI, D], tl.float32)
    carry = 0
    n0 = 0
    while (n0 < N) & (carry < hi):
        o_n = n0 + tl.arange(0, BN)
        b_v, b_r = _valid_ranks(MASK, i_b, SMB, o_n, N, carry)
        b_w = (b_r[None, :] >= start[:, None]) & (b_r[None, :] < end[:, None]) & (b_v[None, :] != 0)
        # Padding is never read (a NaN there cannot reach a landmark through a zero weight).
        b_x = tl.load(X_h + o_n.to(tl.int64)[:, None] * SN + o_d[None, :], mask=(b_v != 0)[:, None], other=0.0)
        acc += _dot(b_w.to(tl.float32).to(b_x.dtype), b_x, PREC, UP)
        carry += tl.sum(b_v, 0)
        n0 += BN
    out = acc / cnt[:, None]
    tl.store(OUT + (i_bh * M + o_i)[:, None] * D + o_d[None, :], out.to(OUT.dtype.element_ty), mask=m_i[:, None])


@triton.jit
def _pool1d_masked_bwd_kernel(
    G, MASK, DX, H, M, N, CH, SGB, SGH, SGM, SMB,
    D: tl.constexpr, BI: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Program (CH tokens, batch-head): dx of a valid token = sum over the landmarks whose rank range holds it of
    g / count (float32, rounded once); 0 for padding."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    c0 = i_c * CH
    L, carry = _valid_counts(MASK, i_b, SMB, N, c0, BC)
    G_h = G + i_b * SGB + (i_bh % H) * SGH
    o_d = tl.arange(0, D)
    for n0 in range(c0, tl.minimum(c0 + CH, N), BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < N
        b_v, b_r = _valid_ranks(MASK, i_b, SMB, o_n, N, carry)
        b_dx = tl.zeros([BN, D], tl.float32)
        for i0 in range(0, M, BI):
            o_i = i0 + tl.arange(0, BI)
            m_i = o_i < M
            start, end, cnt = _bins(o_i, L, M)
            b_w = (b_r[:, None] >= start[None, :]) & (b_r[:, None] < end[None, :]) & (b_v[:, None] != 0)
            b_g = tl.load(G_h + o_i[:, None] * SGM + o_d[None, :], mask=m_i[:, None], other=0.0).to(tl.float32)
            b_g = b_g / cnt[:, None]
            b_dx += tl.dot(tl.where(m_i[None, :], b_w, 0).to(tl.float32), b_g, input_precision="ieee")
        p_dx = DX + (i_bh * N + o_n.to(tl.int64))[:, None] * D + o_d[None, :]
        tl.store(p_dx, b_dx.to(DX.dtype.element_ty), mask=m_n[:, None])
        carry += tl.sum(b_v, 0)


def pool1d_masked_supported(x: torch.Tensor, m: int, key_padding_mask: torch.Tensor) -> bool:
    """Whether :func:`pool1d_masked_fwd` takes x ``[B, H, N, d]`` with this mask: fp16 / bf16 / fp32, d a power of 2
    in [16, 256], unit feature stride, a ``[B, N]`` bool mask on x's device with unit row stride."""
    return (
        x.dim() == 4
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and x.shape[-1] in (16, 32, 64, 128, 256)
        and x.stride(-1) == 1
        and 1 <= m <= x.shape[2]
        and key_padding_mask.dtype == torch.bool
        and key_padding_mask.shape == (x.shape[0], x.shape[2])
        and key_padding_mask.device == x.device
        and key_padding_mask.stride(-1) == 1
    )


def _masked_blocks(m: int, bn: int) -> dict:
    # BI landmarks per program, BN tokens per step, BC tokens per step of the valid-token count.
    return dict(BI=max(16, min(64, _next_pow2(m))), BN=bn, BC=1024)


def pool1d_masked_fwd(x: torch.Tensor, m: int, key_padding_mask: torch.Tensor) -> torch.Tensor:
    """``pool_landmarks(x, m, layout="1d", key_padding_mask=...)`` in one launch: landmark i of a sequence with L
    valid tokens is the mean of those of rank ``floor(i L / m)`` to ``ceil((i + 1) L / m) - 1`` (padding anywhere;
    an all-padding sequence gives 0). x ``[B, H, N, d]`` (any batch, head and row strides); returns ``[B, H, m, d]``
    contiguous in x's dtype (float32 sums rounded once)."""
    if not pool1d_masked_supported(x, m, key_padding_mask):
        raise ValueError(f"pool1d_masked_fwd: unsupported input {tuple(x.shape)} {x.dtype} for m={m}")
    B, H, N, D = x.shape
    out = torch.empty(B, H, m, D, device=x.device, dtype=x.dtype)
    mask = key_padding_mask.view(torch.uint8)
    # One program per (64 landmarks, batch-head) scans the row in order: 128 tokens per step halves its steps.
    blocks = _masked_blocks(m, 128)
    fast(_pool1d_masked_fwd_kernel)[(_cdiv(m, blocks["BI"]), B * H)](
        x, mask, out, H, m, N, x.stride(0), x.stride(1), x.stride(2), mask.stride(0),
        D=D, PREC="ieee" if x.dtype == torch.float32 else "tf32", UP=x.dtype == torch.bfloat16 and interpreting(),
        num_warps=4, **blocks,
    )  # fmt: skip
    return out


def pool1d_masked_bwd(g: torch.Tensor, key_padding_mask: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of :func:`pool1d_masked_fwd`: g ``[B, H, m, d]`` (unit feature stride) -> dx ``[B, H, n, d]``
    contiguous in ``dtype``."""
    B, H, m, D = g.shape
    if g.stride(-1) != 1:
        g = g.contiguous()
    dx = torch.empty(B, H, n, D, device=g.device, dtype=dtype)
    mask = key_padding_mask.view(torch.uint8)
    blocks = _masked_blocks(m, 64)
    # About 16 token chunks per row: each program first counts the valid tokens of the whole row.
    ch = blocks["BN"] * max(1, _cdiv(_cdiv(n, blocks["BN"]), 16))
    fast(_pool1d_masked_bwd_kernel)[(_cdiv(n, ch), B * H)](
        g, mask, dx, H, m, n, ch, g.stride(0), g.stride(1), g.stride(2), mask.stride(0), D=D, num_warps=4, **blocks
    )
    return dx
