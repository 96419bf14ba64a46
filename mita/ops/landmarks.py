"""Landmarks: queries pooled on the image grid (2D) or into contiguous segments of the valid tokens (1D).

Pooling is a reshape-and-sum (1D, N divisible by m), one batched matmul of a cached ``[m, N]`` pooling
operator (2D layouts, other 1D sizes) or prefix sums (1D with padding) rather than ``nn.AdaptiveAvgPool{1,2}d``:
it is deterministic, and AdaptiveAvgPool1d's CUDA backward fails with a shared-memory assert for very long
sequences. Bins follow adaptive average pooling exactly: bin i of p over length L covers
``[floor(i L / p), ceil((i + 1) L / p))``. Sums are float32 (or float64) whatever the input dtype; bfloat16
results are rounded once, and on CUDA bfloat16 inputs are not copied to float32 (see ``_PoolBF16``; one Triton
launch per direction there, ``mita/ops/mita/triton/pool.py``). On CUDA, outside torch.compile, 1D means of fp16 /
bf16 inputs without padding (N divisible by m) are one Triton launch (``_Pool1D``: float32 sums rounded once), and
1D means with padding of fp16 / bf16 / fp32 inputs one launch each way (``_Pool1DMasked``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from mita.utils.tensor_cache import outside_inference_mode

LAYOUTS = ("official", "patches", "1d")
# Tokens summed per run in the first stage of long 1D segment means (see _pool_1d).
_POOL_RUN = 32


@functools.lru_cache(maxsize=64)
@outside_inference_mode
def adaptive_pool_matrix(length: int, bins: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[bins, length]`` matrix whose row i averages adaptive-pooling bin i of a length-``length`` axis.

    Cached per (length, bins, device, dtype): a layer calls it every forward with the same sizes."""
    i = torch.arange(bins, device=device)
    start = (i * length) // bins
    end = ((i + 1) * length + bins - 1) // bins
    pos = torch.arange(length, device=device)
    member = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
    return member.to(dtype) / (end - start)[:, None].to(dtype)


def resolve_patch_grid(n_tokens: int, num_prefix_tokens: int, grid: tuple[int, int] | None) -> tuple[int, int]:
    """The patch grid (h, w) of ``n_tokens`` tokens after ``num_prefix_tokens`` prefix tokens: ``grid`` checked
    against the token count, or a square inferred from it when ``grid`` is None."""
    n_patches = n_tokens - num_prefix_tokens
    if grid is None:
        side = math.isqrt(max(n_patches, 0))
        if side * side != n_patches or side == 0:
            raise ValueError(
                f"grid: cannot infer a square patch grid from N={n_tokens} tokens with {num_prefix_tokens} prefix "
                "tokens; pass grid=(h, w)"
            )
        return side, side
    h, w = int(grid[0]), int(grid[1])
    if h * w != n_patches:
        raise ValueError(
            f"grid: {h}x{w}={h * w} patches does not match N={n_tokens} tokens minus {num_prefix_tokens} prefix "
            f"tokens ({n_patches})"
        )
    return h, w


def landmark_grid(m: int | tuple[int, int]) -> tuple[int, int]:
    """The (ph, pw) landmark grid for ``m`` landmarks: a perfect square m, or an explicit tuple."""
    if isinstance(m, (tuple, list)):
        ph, pw = int(m[0]), int(m[1])
    else:
        side = math.isqrt(int(m)) if int(m) > 0 else 0
        if side * side != m:
            raise ValueError(f"m: 2D landmarks need a perfect square m (p x p grid) or a (ph, pw) tuple, got m={m}")
        ph = pw = side
    if ph < 1 or pw < 1:
        raise ValueError(f"m: landmark grid must be at least 1x1, got {ph}x{pw}")
    return ph, pw


def pool_landmarks(
    x: torch.Tensor,
    m: int | tuple[int, int],
    *,
    layout: str = "official",
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool token features (normally the queries) into ``m`` landmarks.

    Args:
        x: ``[B, H, N, d]`` (or ``[B, N, C]``; pooling is per channel, so before or after the head split is the
            same).
        m: number of landmarks. For 2D layouts a perfect square (p x p grid) or a ``(ph, pw)`` tuple.
        layout: ``"official"``: the reference code's grid, built from the first ``h * w`` tokens
            ``[CLS, patch_1 .. patch_{hw-1}]`` (CLS at cell (0, 0), every patch shifted by one cell, the last
            patch dropped). ``"patches"``: the patch tokens only, after ``num_prefix_tokens`` prefix tokens.
            ``"1d"``: contiguous segment means over each sequence's valid tokens (padding excluded).
        grid: patch grid ``(h, w)``; None infers a square grid from ``N - num_prefix_tokens``.
        num_prefix_tokens: tokens before the patches (CLS, registers). ``"official"`` needs at least 1.
        key_padding_mask: ``[B, N]`` bool, True marks padding. Only the ``"1d"`` layout accepts it; the 1D
            segments then split each sequence's valid tokens (in order, wherever the padding sits).

    Returns:
        ``[B, H, m, d]`` (or ``[B, m, C]``), in x's dtype.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    squeeze = x.dim() == 3
    if squeeze:
        x = x.unsqueeze(1)
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, N, d] or [B, N, C], got shape {tuple(x.shape)}")
    B, H, N, d = x.shape
    if layout == "1d":
        out = _pool_1d(x, m, key_padding_mask)
    else:
        if key_padding_mask is not None:
            raise ValueError(f"key_padding_mask: the {layout!r} image layout does not take padding; use layout='1d'")
        out = _pool_2d(x, m, layout, grid, num_prefix_tokens)
    return out.squeeze(1) if squeeze else out


def pool_operator_2d(
    n_tokens: int,
    m: int | tuple[int, int],
    *,
    layout: str = "official",
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    device: torch.device | str = "cpu",
) -> _PoolTables:
    """The cached bfloat16 pooling operator of a 2D layout (what :func:`pool_landmarks` applies to bf16 input):
    0/1 ``member [m, N]`` (bf16), float32 ``counts [m, 1]`` and float32 weights ``weights_t [N, m]``. Raises as
    pool_landmarks does for a layout, grid or m that does not fit N tokens."""
    if layout not in ("official", "patches"):
        raise ValueError(f"layout must be 'official' or 'patches' for a 2D pooling operator, got {layout!r}")
    start, h, w, ph, pw = _grid_2d(n_tokens, m, layout, grid, num_prefix_tokens)
    return _pool_tables(n_tokens, start, h, w, ph, pw, torch.device(device), torch.bfloat16)


def _grid_2d(
    N: int, m: int | tuple[int, int], layout: str, grid: tuple[int, int] | None, num_prefix_tokens: int
) -> tuple[int, int, int, int, int]:
    """``(start, h, w, ph, pw)``: first grid token, patch grid and landmark grid of a 2D layout, validated."""
    if num_prefix_tokens < 0 or (layout == "official" and num_prefix_tokens < 1):
        raise ValueError(
            f"num_prefix_tokens must be >= 1 for the 'official' layout and >= 0 otherwise, got {num_prefix_tokens}"
        )
    h, w = resolve_patch_grid(N, num_prefix_tokens, grid)
    ph, pw = landmark_grid(m)
    if ph > h or pw > w:
        raise ValueError(f"m: a {ph}x{pw} landmark grid does not fit the {h}x{w} patch grid")
    # "official" lays [CLS, patch_1 .. patch_{hw-1}] on the grid: the first h*w tokens.
    start = 0 if layout == "official" else num_prefix_tokens
    return start, h, w, ph, pw


def _pool_2d(
    x: torch.Tensor, m: int | tuple[int, int], layout: str, grid: tuple[int, int] | None, num_prefix_tokens: int
) -> torch.Tensor:
    return _pool_with_matrix(x, *_grid_2d(x.shape[2], m, layout, grid, num_prefix_tokens))


class _PoolTables(NamedTuple):
    """Cached pooling operator of one (sizes, device, dtype)."""

    member: torch.Tensor  # [m, N] 0/1 in the matmul dtype: which tokens landmark i averages
    counts: torch.Tensor  # [m, 1] tokens per landmark, float32 (bfloat16 inputs) or the matmul dtype
    weights_t: torch.Tensor | None  # bfloat16 only: [N, m] float32 weights (member / counts) transposed
    # bfloat16 only: each token's nonzero weights, ([N, kb] landmark indices int32, [N, kb] weights float32), kb the
    # most landmarks one token belongs to (4 for 2D adaptive bins), padded with weight 0 (the Triton backward).
    token_bins: tuple[torch.Tensor, torch.Tensor] | None


@functools.lru_cache(maxsize=64)
@outside_inference_mode
def _pool_tables(
    n_tokens: int, start: int, h: int, w: int, ph: int, pw: int, device: torch.device, dtype: torch.dtype
) -> _PoolTables:
    """Pooling operator of an h x w grid (tokens ``start .. start + h*w`` of ``n_tokens``) into ph x pw bins.

    Built once per (sizes, device, dtype): a layer pools with the same sizes every forward. Token columns outside
    the grid stay zero, so the operator applies to all N tokens and autograd never sees a slice."""
    # [ph, h] and [pw, w] adaptive-pooling bins; a landmark's cell is a row bin x a column bin.
    rows, cols = adaptive_pool_matrix(h, ph, device) > 0, adaptive_pool_matrix(w, pw, device) > 0
    cells = (rows[:, None, :, None] & cols[None, :, None, :]).reshape(ph * pw, h * w)
    member = torch.zeros(ph * pw, n_tokens, dtype=torch.bool, device=device)
    member[:, start : start + h * w] = cells
    low = dtype == torch.bfloat16
    counts = member.sum(dim=1, keepdim=True).to(torch.float32 if low else dtype)
    if not low:
        return _PoolTables(member.to(dtype), counts, None, None)
    weights_t = (member.to(torch.float32) / counts).T.contiguous()
    # Ascending landmark order per token (a stable sort puts the nonzero weights first, in index order).
    kb = max(1, int(member.sum(dim=0).max()))
    order = torch.sort((weights_t == 0).to(torch.uint8), dim=1, stable=True).indices[:, :kb]
    token_bins = (order.to(torch.int32).contiguous(), weights_t.gather(1, order).contiguous())
    return _PoolTables(member.to(torch.bfloat16), counts, weights_t, token_bins)


# CUDA bfloat16 pooling in Triton (mita/ops/mita/triton/pool.py) when Triton imports; tests switch it off to
# compare with the PyTorch formulation.
TRITON_POOL = True


@functools.lru_cache(maxsize=1)
def _pool_kernels_module():
    try:
        from mita.ops.mita.triton import pool
    except ImportError:
        return None
    return pool


def _pool_kernels():
    return _pool_kernels_module() if TRITON_POOL else None


def _kernels_for(x: torch.Tensor):
    """The Triton pooling kernels for x: CUDA tensors outside torch.compile (whose generated code pools as well
    without them), else None (the PyTorch forms)."""
    return _pool_kernels() if x.is_cuda and not torch.compiler.is_compiling() else None


class _PoolBF16(torch.autograd.Function):
    """bfloat16 pooling ``[G, N, D] -> [G, m, D]`` with float32 sums, rounded once.

    Forward: 0/1 membership times x with float32 sums (CUDA: a bf16 GEMM with a float32 output, so x is never
    copied to float32; CPU: float32 operands), divided by the counts in float32, rounded once, written straight
    into the contiguous output. Backward: dx = W^T g in float32 (the operands W [N, m] and g [G, m, D] are small),
    rounded once; a bf16 GEMM with a bf16 output may sum split-K partials in bf16 under torch's default
    reduced-precision setting."""

    @staticmethod
    def forward(ctx, x3: torch.Tensor, member: torch.Tensor, counts: torch.Tensor, weights_t: torch.Tensor, heads: int,
                token_bins: tuple[torch.Tensor, torch.Tensor]):  # fmt: skip
        G, N, D = x3.shape
        m = member.shape[0]
        tp = _kernels_for(x3)
        ctx.triton = tp is not None
        ctx.save_for_backward(weights_t)
        ctx.heads, ctx.token_bins = heads, token_bins
        if tp is not None:
            return tp.pool_fwd(x3, member, counts, heads)
        if x3.is_cuda:
            # bf16 0/1 times bf16: exact products; a float32 output pins float32 accumulation.
            sums = torch.bmm(member.expand(G, m, N), x3, out_dtype=torch.float32)
        else:
            sums = torch.bmm(member.float().expand(G, m, N), x3.float())
        # Divide and round in one kernel; x3 = [B, N, H*d] is written straight into a contiguous [B, H, m, d].
        if heads == 0:
            return torch.div(sums, counts, out=x3.new_empty(G, m, D))
        out = x3.new_empty(G, heads, m, D // heads)
        torch.div(sums.view(G, m, heads, D // heads), counts[:, :, None], out=out.transpose(1, 2))
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (weights_t,) = ctx.saved_tensors
        if ctx.triton:
            return _pool_kernels().pool_bwd(g, ctx.token_bins, ctx.heads, g.dtype), None, None, None, None, None
        N, m = weights_t.shape
        G = g.shape[0]
        # [G, m, D] (or [B, m, H, d] from [B, H, m, d], matching x3 = [B, N, H*d]).
        gt = (g.transpose(1, 2) if ctx.heads else g).reshape(G, m, -1)
        dx = torch.bmm(weights_t.expand(G, N, m), gt.float()).to(g.dtype)
        return dx, None, None, None, None, None


class _Pool1D(torch.autograd.Function):
    """1D segment means ``[B, H, N, d] -> [B, H, m, d]`` by the Triton kernel (float32 sums, rounded once); its
    backward is the PyTorch form's: ``dx[n] = (g[n // L] / L)`` in float32, rounded once to x's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, m: int):
        ctx.shape = x.shape
        return _pool_kernels().pool1d_fwd(x, m)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        B, H, N, d = ctx.shape
        m = g.shape[2]
        L = N // m
        dx = (g.float() / L).to(g.dtype)[:, :, :, None, :].expand(B, H, m, L, d).reshape(B, H, N, d)
        return dx, None


class _Pool1DMasked(torch.autograd.Function):
    """1D landmarks over each sequence's valid tokens (``_pool_1d`` with a padding mask) by two Triton kernels: the
    same bins and float32 arithmetic as the PyTorch form (prefix sums there, direct sums here), rounded once to x's
    dtype each way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, m: int, key_padding_mask: torch.Tensor):
        ctx.save_for_backward(key_padding_mask)
        ctx.n, ctx.dtype = x.shape[2], x.dtype
        return _pool_kernels().pool1d_masked_fwd(x, m, key_padding_mask)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return _pool_kernels().pool1d_masked_bwd(g, mask, ctx.n, ctx.dtype), None, None


def pool_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(x3, heads)``: the rows a pooling operator applies to, for x ``[B, H, N, d]``. Heads interleaved with
    channels (q split from a fused qkv projection): ``[B, N, H*d]``, a view, and heads = H; otherwise
    ``[B*H, N, d]`` and heads = 0."""
    B, H, N, d = x.shape
    heads = H if H > 1 and x.stride(1) == d * x.stride(3) else 0
    return (x.transpose(1, 2).reshape(B, N, H * d) if heads else x.reshape(B * H, N, d)), heads


def _pool_with_matrix(x: torch.Tensor, start: int, h: int, w: int, ph: int, pw: int) -> torch.Tensor:
    """Adaptive-average-pool the h x w grid of tokens ``start .. start + h*w`` of x ([B, H, N, d]) into ph x pw
    bins, one batched matmul of a cached [m, N] operator on x's rows.

    Returns:
        ``[B, H, ph * pw, d]`` in x's dtype, contiguous.
    """
    B, H, N, d = x.shape
    m = ph * pw
    low = x.dtype == torch.bfloat16
    ct = torch.bfloat16 if low else torch.promote_types(x.dtype, torch.float32)
    tables = _pool_tables(N, start, h, w, ph, pw, x.device, ct)
    x3, heads = pool_rows(x)
    if low:
        out = _PoolBF16.apply(x3, tables.member, tables.counts, tables.weights_t, heads, tables.token_bins)
        return out if heads else out.view(B, H, m, d)
    sums = torch.bmm(tables.member.expand(x3.shape[0], m, N), x3.to(ct)) / tables.counts
    out = sums.view(B, m, H, d).transpose(1, 2) if heads else sums.view(B, H, m, d)
    return out.to(x.dtype).contiguous()


def _pool_1d(x: torch.Tensor, m: int, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    B, H, N, d = x.shape
    if isinstance(m, (tuple, list)) or int(m) < 1:
        raise ValueError(f"m: 1D landmarks need an int m >= 1, got {m!r}")
    m = int(m)
    if m > N:
        raise ValueError(f"m: cannot pool N={N} tokens into m={m} landmarks (m > N)")
    ct = torch.promote_types(x.dtype, torch.float32)
    if key_padding_mask is None:
        if N % m == 0:
            # sum(dtype=float32) reads bf16 directly on CUDA (no float32 copy), and its backward is one broadcast
            # cast back to x's dtype. Eager long segments are summed in two float32 stages (runs of 32 tokens, then
            # the runs): ATen's CUDA reduction over 1024-token segments of 256K tokens took a 144 MiB work buffer
            # (over twice its input; mem_profile.py), the two stages' partials take a sixteenth of the input. Under
            # torch.compile the generated reduction needs no such buffer and the single sum stays.
            L = N // m
            tp = _kernels_for(x)
            if tp is not None and tp.pool1d_supported(x, m):
                # CUDA fp16 / bf16: one Triton launch (float32 sums, rounded once) instead of three or four.
                return _Pool1D.apply(x, m)
            if L % _POOL_RUN == 0 and L > 2 * _POOL_RUN and not torch.compiler.is_compiling():
                runs = x.reshape(B, H, m, L // _POOL_RUN, _POOL_RUN, d).sum(dim=4, dtype=ct)
                return (runs.sum(dim=3) / L).to(x.dtype)
            return (x.reshape(B, H, m, L, d).sum(dim=3, dtype=ct) / L).to(x.dtype)
        return _pool_with_matrix(x, 0, 1, N, 1, m)
    if key_padding_mask.shape != (B, N) or key_padding_mask.dtype != torch.bool:
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape [{B}, {N}], got {tuple(key_padding_mask.shape)}"
        )
    tp = _kernels_for(x)
    if tp is not None and tp.pool1d_masked_supported(x, m, key_padding_mask):
        # CUDA: one Triton launch each way instead of about 28 PyTorch kernels forward and 14 backward.
        return _Pool1DMasked.apply(x, m, key_padding_mask)
    # Segment sums from prefix sums, by rank among the valid tokens (padding may sit anywhere); L is each
    # sequence's valid count, a tensor, so nothing synchronises. Adaptive bins [floor(iL/m), ceil((i+1)L/m)) are
    # never empty for L >= 1; a fully padded row (L = 0) averages nothing and gives 0.
    valid = (~key_padding_mask).to(x.device)
    L = valid.sum(dim=1)  # [B]
    i = torch.arange(m, device=x.device)
    start = (i[None, :] * L[:, None]) // m  # [B, m] ranks
    end = ((i[None, :] + 1) * L[:, None] + m - 1) // m
    # Position p whose prefix holds exactly r valid tokens: the first p with V[p] >= r (V rises by at most 1).
    V = torch.nn.functional.pad(valid.long().cumsum(dim=1), (1, 0))  # [B, N + 1]
    xv = x.to(ct) * valid[:, None, :, None]
    csum = torch.nn.functional.pad(xv.cumsum(dim=2), (0, 0, 1, 0))  # [B, H, N + 1, d]

    def take(rank: torch.Tensor) -> torch.Tensor:
        pos = torch.searchsorted(V, rank.contiguous())
        return torch.gather(csum, 2, pos[:, None, :, None].expand(B, H, m, d))

    counts = (end - start).clamp_min(1).to(ct)[:, None, :, None]
    return ((take(end) - take(start)) / counts).to(x.dtype)
