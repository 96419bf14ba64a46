"""The Long Range Arena encoder with any registered attention (also used for arXiv long documents).

The recipe of the PyTorch LRA ports (Nystromformer / Skyformer) that gives about 58% average for softmax
attention: token + learned position embeddings, 2 pre-LN blocks of width 64 with 2 heads and an FFN of 128,
dropout 0.1, a final LayerNorm, MEAN pooling over the valid tokens and a Linear-ReLU-Linear head. Retrieval
is a dual encoder: one shared encoder for both documents, the head on ``[x1, x2, x1 * x2, x1 - x2]``.

The attention is built with :func:`mita.registry.create_attention` with ``grid_size=None``,
``num_prefix_tokens=0`` and its class's ``sequence_options``, so layers that pool (MiTA landmarks, Agent
agents, MoBA blocks) work on 1D segments of the valid tokens; the padding mask goes to every layer.

Padding may sit anywhere (the pixel tasks mask black pixels, as the PyTorch ports do): the encoder first moves
each sequence's valid tokens to the front, in order, each keeping its own position embedding, and cuts the batch
to its longest valid sequence rounded up to ``pad_multiple``. On right-padded input this changes no output
(every layer masks padded keys and the pooling skips padded queries) and spends no work on padding; with padding
inside a row, layers that group neighbouring tokens (landmarks, agents, MoBA blocks) group neighbouring valid
tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from mita.models.vit import split_attention_spec
from mita.registry import create_attention, get_attention_class


class FeedForward(nn.Sequential):
    """Linear(dim, hidden) - GELU - Dropout - Linear(hidden, dim) - Dropout."""

    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__(
            nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim), nn.Dropout(dropout)
        )


class Block(nn.Module):
    """Pre-LN Transformer block: ``x + attn(LN(x))`` then ``x + ffn(LN(x))``."""

    def __init__(self, dim: int, attn: nn.Module, mlp_dim: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn
        self.drop = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim, mlp_dim, dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), key_padding_mask=key_padding_mask))
        return x + self.mlp(self.norm2(x))


def compact_padding(
    x: torch.Tensor, key_padding_mask: torch.Tensor, multiple: int, valid_lengths: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Valid tokens first, trailing padding cut.

    Args:
        x: [B, N] token ids.
        key_padding_mask: [B, N] bool, True = padding, anywhere in a row.
        multiple: the kept length is the longest row's valid count rounded up to this (few distinct shapes),
            at most N.
        valid_lengths: (shortest, longest) valid-token count over the rows, when the caller knows them (the LRA
            collate counts them on the CPU); None reads them from the mask, one host synchronisation.

    Returns:
        (tokens [B, L], positions [B, L] (each token's index in x), padding mask [B, L], or None when no kept
        token is padding).
    """
    N = x.shape[1]
    if valid_lengths is None:
        counts = (~key_padding_mask).sum(dim=1)
        shortest, longest = torch.stack([counts.min(), counts.max()]).tolist()
    else:
        shortest, longest = (int(n) for n in valid_lengths)
        if not 0 <= shortest <= longest <= N:
            raise ValueError(f"valid_lengths must be (shortest, longest) with 0 <= shortest <= longest <= {N}, "
                             f"got {tuple(valid_lengths)}")  # fmt: skip
    length = min(N, -(-max(longest, 1) // multiple) * multiple)
    # A stable sort of the mask puts each row's valid tokens first, in their order.
    order = torch.sort(key_padding_mask.to(torch.uint8), dim=1, stable=True).indices[:, :length]
    mask = None if shortest >= length else key_padding_mask.gather(1, order)
    return x.gather(1, order), order, mask


def build_attention(name: str, dim: int, num_heads: int, **kwargs) -> nn.Module:
    """A registered attention laid out for 1D sequences: no grid, no prefix tokens, and the class's own
    ``sequence_options`` (MiTA: ``landmark_layout="1d"``, whatever the attention config group says, whose default
    is the 2D reference layout)."""
    cls = get_attention_class(name)
    kwargs = {**kwargs, **cls.sequence_options, "grid_size": None, "num_prefix_tokens": 0}
    return create_attention(name, dim, num_heads, **kwargs)


class LRAEncoder(nn.Module):
    """Token sequences -> class logits, with one attention type in every block.

    Args:
        vocab_size: number of token ids (0 is padding).
        max_length: longest sequence (size of the learned position table).
        num_classes: output classes.
        attention: registered attention name (``"full"``, ``"mita"``, ``"mita_routing"``, ``"agent_minus"``,
            ``"moba"``, ``"topk"``, ...) or a mapping ``{"name": "mita", "m": 32, "k": 64, ...}`` (the form of the
            ``attention`` config group).
        attention_kwargs: the layer's own options (MiTA: ``m``, ``k``, ``experts_per_query``, ``shared_scale``,
            ...), overriding the mapping's; ``qkv_bias``/``attn_drop`` may be given here too.
        dim: embedding width (64).
        depth: number of blocks (2).
        num_heads: heads (2, head dim 32).
        mlp_dim: FFN hidden width (128).
        dropout: dropout on embeddings, attention output, FFN (0.1).
        attn_drop: dropout on attention probabilities (0: MiTA's kernels have none, so every row uses none).
        head_dim: hidden width of the classifier head (128).
        dual: retrieval dual encoder (two inputs, head on ``[x1, x2, x1 * x2, x1 - x2]``).
        pad_multiple: padded batches are cut to their longest valid sequence rounded up to this
            (:func:`compact_padding`).
        init: ``"pytorch"`` (the ports' initialisation: token and position embeddings N(0, 0.02), every other
            layer as its constructor leaves it, i.e. PyTorch's default for ``nn.Linear``) or ``"trunc_normal"``
            (every Linear truncated-normal std 0.02, zero bias: the ViT convention; used by the 2026-11-30 GPU
            ListOps run in results/lra/).
    """

    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        num_classes: int,
        attention: str | Mapping[str, Any] = "full",
        attention_kwargs: Mapping[str, Any] | None = None,
        dim: int = 64,
        depth: int = 2,
        num_heads: int = 2,
        mlp_dim: int = 128,
        dropout: float = 0.1,
        attn_drop: float = 0.0,
        head_dim: int = 128,
        dual: bool = False,
        pad_multiple: int = 64,
        init: str = "pytorch",
    ) -> None:
        super().__init__()
        if init not in ("pytorch", "trunc_normal"):
            raise ValueError(f"init must be 'pytorch' or 'trunc_normal', got {init!r}")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
        self.max_length = max_length
        self.pad_multiple = pad_multiple
        self.dual = dual
        name, options = split_attention_spec(attention, attention_kwargs)
        self.attention = name
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Embedding(max_length, dim)
        self.drop = nn.Dropout(dropout)
        kwargs = {"qkv_bias": True, "attn_drop": attn_drop, **options}
        self.blocks = nn.ModuleList(
            Block(dim, build_attention(name, dim, num_heads, **kwargs), mlp_dim, dropout) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        features = 4 * dim if dual else dim
        self.head = nn.Sequential(nn.Linear(features, head_dim), nn.ReLU(), nn.Linear(head_dim, num_classes))
        if init == "trunc_normal":
            self.apply(self._init_trunc_normal)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos_embed.weight, std=0.02)

    @staticmethod
    def _init_trunc_normal(m: nn.Module) -> None:
        # A 0.02 Linear init is about 3.6x smaller than PyTorch's default at width 64 (std 1 / sqrt(3 * 64)); on
        # ListOps it leaves the model on the majority-class plateau longer (docs/lra.md).
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def encode(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        valid_lengths: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Pooled features of one batch of sequences.

        Args:
            x: [B, N] token ids, N <= max_length.
            key_padding_mask: [B, N] bool, True = padding, anywhere (None: no padding).
            valid_lengths: (shortest, longest) valid-token count over the rows if known (see
                :func:`compact_padding`); saves a host synchronisation.

        Returns:
            [B, dim] mean of the final token features over the valid tokens.
        """
        B, N = x.shape
        if N > self.max_length:
            raise ValueError(f"sequence length {N} exceeds max_length {self.max_length}")
        if key_padding_mask is None:
            pos = torch.arange(N, device=x.device)[None]
        else:
            x, pos, key_padding_mask = compact_padding(x, key_padding_mask, self.pad_multiple, valid_lengths)
        h = self.drop(self.embed(x) + self.pos_embed(pos))
        for block in self.blocks:
            h = block(h, key_padding_mask)
        h = self.norm(h)
        if key_padding_mask is None:
            return h.mean(dim=1)
        valid = (~key_padding_mask).to(h.dtype)[..., None]
        return (h * valid).sum(dim=1) / valid.sum(dim=1).clamp_min(1.0)

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        x2: torch.Tensor | None = None,
        key_padding_mask2: torch.Tensor | None = None,
        valid_lengths: tuple[int, int] | None = None,
        valid_lengths2: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Class logits [B, num_classes] of token ids ``x`` [B, N] with ``key_padding_mask`` [B, N] (True =
        padding); the dual encoder takes the second document as ``x2``/``key_padding_mask2``. ``valid_lengths`` /
        ``valid_lengths2``: (shortest, longest) valid-token count of each document's rows, when known (the LRA
        collate gives them): no host synchronisation in the forward."""
        f1 = self.encode(x, key_padding_mask, valid_lengths)
        if not self.dual:
            return self.head(f1)
        if x2 is None:
            raise ValueError("the retrieval dual encoder needs x2 (the second document)")
        f2 = self.encode(x2, key_padding_mask2, valid_lengths2)
        return self.head(torch.cat([f1, f2, f1 * f2, f1 - f2], dim=-1))
