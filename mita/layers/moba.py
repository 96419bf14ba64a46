"""MoBA, Mixture of Block Attention (Lu et al., "MoBA: Mixture of Block Attention for Long-Context LLMs", 2025)."""

from __future__ import annotations

import torch
import torch.nn as nn

from mita.layers.base import AttentionBase
from mita.layers.full import nonempty_key_padding_mask
from mita.layers.topk import check_masked_sdpa_backend, masked_sdpa, query_chunk
from mita.registry import register_attention

PREFIX_MODES = ("always", "routed")


def moba_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    num_blocks: int,
    topk_blocks: int,
    *,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    dropout_p: float = 0.0,
    sdpa_backend: str = "auto",
) -> torch.Tensor:
    """Bidirectional MoBA: each query attends, with one softmax, to the tokens of its top-k key blocks.

    The block key is the mean of the block's valid keys; a query scores block j by ``q . mean_key_j`` and keeps
    the ``topk_blocks`` best blocks that hold at least one valid key. Tokens with ``block_ids < 0`` belong to no
    routed block and are attended by every query (e.g. a CLS token). Routing is a hard selection (no gradient, as
    in the paper). Queries are processed ``chunk_size`` at a time (memory O(B * H * chunk_size * N)), each chunk
    in one masked SDPA call; no host synchronisation. With ``topk_blocks >= num_blocks`` the result equals full
    softmax attention.

    Args:
        q, k, v: [B, H, N, d].
        block_ids: [N] long, the routed block of each key in [0, num_blocks), or -1 for always-attended keys.
        num_blocks: number of routed blocks.
        topk_blocks: blocks per query (>= 1); values above ``num_blocks`` are clamped.
        scale: score scale; None means d^-1/2.
        key_padding_mask: [B, N] bool, True = padding. Padded keys get no weight and do not enter block means;
            fully padded blocks are never chosen.
        chunk_size: queries per chunk; None picks the largest chunk within ``CHUNK_ELEMENTS`` mask entries.
        dropout_p: dropout on the attention probabilities (training only; the caller passes 0 in eval).
        sdpa_backend: the SDPA kernel of the masked attention (``mita.layers.topk.MASKED_SDPA_BACKENDS``).

    Returns:
        [B, H, N, d] in q's dtype.
    """
    if topk_blocks < 1:
        raise ValueError(f"topk_blocks must be >= 1, got {topk_blocks}")
    check_masked_sdpa_backend(sdpa_backend)
    B, H, N, _ = q.shape
    chunk = query_chunk(B * H, N, N, chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    key_padding_mask = nonempty_key_padding_mask(key_padding_mask)
    valid = torch.ones(B, N, dtype=torch.bool, device=q.device) if key_padding_mask is None else ~key_padding_mask
    always = block_ids < 0
    routed_ids = block_ids.clamp(min=0)

    # [B, nb, N]: membership of valid keys in each routed block.
    member = (block_ids[None, None, :] == torch.arange(num_blocks, device=q.device)[None, :, None]) & valid[:, None]
    count = member.sum(dim=-1)
    block_ok = count > 0
    member = member.to(k.dtype)
    # [B, H, nb, d]: mean of each block's valid keys (empty blocks give 0 and are never chosen).
    block_keys = torch.einsum("bjn,bhnd->bhjd", member, k) / count.clamp(min=1).to(k.dtype)[:, None, :, None]
    kk = min(topk_blocks, num_blocks)

    # Each key's column in a per-query table of additive biases: its routed block, ALWAYS (0: attended by every
    # query) or PADDED (-inf); [B, N], so one gather writes the chunk's [B, H, c, N] bias for SDPA (a float mask
    # runs faster there than a bool one, and the bool mask would be converted to it anyway).
    always_col, padded_col = num_blocks, num_blocks + 1
    columns = torch.where(valid, torch.where(always, always_col, routed_ids)[None, :], padded_col)
    outputs = []
    for q_chunk in q.split(chunk, dim=-2):
        c = q_chunk.shape[-2]
        table = torch.full((B, H, c, num_blocks + 2), float("-inf"), dtype=q.dtype, device=q.device)
        table[..., always_col] = 0.0
        if num_blocks > 0:
            # [B, H, c, nb]
            route = (q_chunk.detach() @ block_keys.detach().transpose(-2, -1)).masked_fill(
                ~block_ok[:, None, None, :], float("-inf")
            )
            idx = route.topk(kk, dim=-1).indices
            chosen = torch.zeros_like(route, dtype=torch.bool).scatter_(-1, idx, True) & block_ok[:, None, None, :]
            table[..., :num_blocks].masked_fill_(chosen, 0.0)
        bias = torch.gather(table, -1, columns[:, None, None, :].expand(B, H, c, N))
        outputs.append(masked_sdpa(q_chunk, k, v, bias, scale, dropout_p, sdpa_backend))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)


def block_ids_1d(n_tokens: int, block_size: int, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Contiguous 1D blocks: token i is in block i // block_size.

    Returns:
        block_ids [N] long and the number of blocks ceil(N / block_size).
    """
    ids = torch.arange(n_tokens, device=device) // block_size
    return ids, -(-n_tokens // block_size)


def block_ids_2d(
    grid: tuple[int, int],
    window: tuple[int, int],
    num_prefix_tokens: int,
    prefix_block: str = "always",
    device: torch.device | None = None,
) -> tuple[torch.Tensor, int]:
    """2D windows of a row-major patch grid after ``num_prefix_tokens`` prefix tokens.

    Windows tile the grid from the top-left corner; windows on the bottom and right edges are smaller when the
    window does not divide the grid. Prefix tokens get id -1 (``prefix_block="always"``: attended by every query)
    or form block 0, routed like any other block (``"routed"``).

    Returns:
        block_ids [num_prefix_tokens + h * w] long and the number of routed blocks.
    """
    h, w = grid
    wh, ww = window
    nw = -(-w // ww)
    n_windows = -(-h // wh) * nw
    rows = torch.arange(h, device=device)[:, None] // wh
    cols = torch.arange(w, device=device)[None, :] // ww
    patch_ids = (rows * nw + cols).reshape(-1)
    if num_prefix_tokens == 0:
        return patch_ids, n_windows
    if prefix_block == "always":
        prefix_ids = torch.full((num_prefix_tokens,), -1, dtype=torch.long, device=device)
        return torch.cat([prefix_ids, patch_ids]), n_windows
    prefix_ids = torch.zeros(num_prefix_tokens, dtype=torch.long, device=device)
    return torch.cat([prefix_ids, patch_ids + 1]), n_windows + 1


@register_attention("moba")
class MoBAAttention(AttentionBase):
    """MoBA (Mixture of Block Attention), bidirectional, for encoders.

    Paper: Lu et al., "MoBA: Mixture of Block Attention for Long-Context LLMs", arXiv 2502.13189, 2025. The keys
    are split into blocks; the block key is the mean of the block's keys; each query attends, with one softmax, to
    the tokens of its top-``topk_blocks`` blocks by ``q . mean_key``. Differences from the paper's causal LLM
    setting: no causal mask and no forced "current block" (encoder tasks are bidirectional, as the MiTA paper
    compares); for images, blocks are 2D windows of the patch grid. The layer has no parameters of its own.

    Layout: 1D blocks of ``block_size`` tokens when the layer has ``grid_size = None`` and
    ``num_prefix_tokens = 0`` (and no ``grid=`` is passed); otherwise 2D windows of ``window_size`` patches.
    Prefix tokens (CLS, registers) form their own block, attended by every query (``prefix_block="always"``,
    the default: a global token should not depend on routing) or routed like any other block (``"routed"``).

    Args:
        dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer: as
            :class:`~mita.layers.base.AttentionBase`; ``attn_drop`` drops attention probabilities.
        block_size: tokens per block in 1D.
        window_size: (height, width) of a 2D window in patches (an int means square).
        topk_blocks: routed blocks per query (the prefix block, when always attended, comes on top).
        prefix_block: ``"always"`` or ``"routed"``.
        chunk_size: queries per chunk (working memory O(chunk_size * N) per head); None (default) picks the
            largest chunk within ``CHUNK_ELEMENTS`` mask entries.
        sdpa_backend: SDPA kernel of the masked attention (``"auto"``, ``"efficient"``, ``"cudnn"``, ``"math"``).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        proj_bias: bool = True,
        norm_layer: type[nn.Module] = nn.LayerNorm,
        block_size: int = 64,
        window_size: int | tuple[int, int] = 4,
        topk_blocks: int = 3,
        prefix_block: str = "always",
        chunk_size: int | None = None,
        sdpa_backend: str = "auto",
        grid_size: tuple[int, int] | None = None,
        num_prefix_tokens: int = 1,
    ) -> None:
        super().__init__(
            dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer,
            grid_size=grid_size, num_prefix_tokens=num_prefix_tokens,
        )  # fmt: skip
        window_size = (window_size, window_size) if isinstance(window_size, int) else tuple(window_size)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if len(window_size) != 2 or min(window_size) < 1:
            raise ValueError(f"window_size must be a positive int or (h, w), got {window_size}")
        if topk_blocks < 1:
            raise ValueError(f"topk_blocks must be >= 1, got {topk_blocks}")
        if prefix_block not in PREFIX_MODES:
            raise ValueError(f"prefix_block must be one of {PREFIX_MODES}, got {prefix_block!r}")
        query_chunk(1, 1, 1, chunk_size)
        self.block_size = block_size
        self.window_size = (int(window_size[0]), int(window_size[1]))
        self.topk_blocks = topk_blocks
        self.prefix_block = prefix_block
        self.chunk_size = chunk_size
        self.sdpa_backend = check_masked_sdpa_backend(sdpa_backend)

    def block_ids(self, n_tokens: int, grid: tuple[int, int] | None, device: torch.device) -> tuple[torch.Tensor, int]:
        """Block of every token for this call's layout: ([N] long ids, -1 = always attended; number of blocks)."""
        if grid is None and self.grid_size is None and self.num_prefix_tokens == 0:
            return block_ids_1d(n_tokens, self.block_size, device)
        hw = self.resolve_grid(n_tokens, grid)
        return block_ids_2d(hw, self.window_size, self.num_prefix_tokens, self.prefix_block, device)

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        grid: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Args:
            x: [B, N, C] tokens.
            key_padding_mask: [B, N] bool, True = padding.
            grid: (h, w) patch grid for this call; overrides ``self.grid_size``.

        Returns:
            [B, N, C].
        """
        self.check_input(x, key_padding_mask)
        q, k, v = self.split_qkv(x)
        ids, n_blocks = self.block_ids(x.shape[1], grid, x.device)
        o = moba_attention(
            q,
            k,
            v,
            ids,
            n_blocks,
            self.topk_blocks,
            scale=self.scale,
            key_padding_mask=key_padding_mask,
            chunk_size=self.chunk_size,
            dropout_p=self.attn_drop_p if self.training else 0.0,
            sdpa_backend=self.sdpa_backend,
        )
        return self.output(self.merge_heads(o))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, block_size={self.block_size}, window_size={self.window_size}, "
            f"topk_blocks={self.topk_blocks}, prefix_block={self.prefix_block!r}, sdpa_backend={self.sdpa_backend!r}"
        )
