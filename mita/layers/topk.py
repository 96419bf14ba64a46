"""Per-query top-k attention (Gupta et al., "Memory-efficient Transformers via Top-k Attention", 2021)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from mita.layers.base import AttentionBase
from mita.layers.full import nonempty_key_padding_mask
from mita.registry import register_attention


def topk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk: int,
    *,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int = 256,
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each query attends, with one softmax, to its own ``topk`` highest-scoring valid keys.

    Scores are computed densely (quadratic time) but queries are processed ``chunk_size`` at a time, so the
    working memory is O(B * H * chunk_size * N). With ``topk >= `` the number of valid keys the result equals
    full softmax attention. The selection is not differentiated (as in the paper); gradients flow through the
    selected scores and values. Ties are broken by ``torch.topk``. No host synchronisation.

    Args:
        q, k, v: [B, H, N, d] (k and v may have a different length M from q).
        topk: keys per query (>= 1); values above M are clamped to M.
        scale: score scale; None means d^-1/2.
        key_padding_mask: [B, M] bool, True = padding (never selected with a positive weight).
        chunk_size: queries per chunk.
        dropout: applied to the attention probabilities (e.g. an ``nn.Dropout``), or None.

    Returns:
        [B, H, N, d] in q's dtype.
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n_keys = k.shape[-2]
    kk = min(topk, n_keys)
    key_padding_mask = nonempty_key_padding_mask(key_padding_mask)
    outputs = []
    for q_chunk in q.split(chunk_size, dim=-2):
        # [B, H, c, M]
        scores = (q_chunk @ k.transpose(-2, -1)) * scale
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        # Padded keys score -inf, so they are picked only when fewer than kk keys are valid; they keep weight 0.
        idx = scores.detach().topk(kk, dim=-1).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)
        probs = scores.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        if dropout is not None:
            probs = dropout(probs)
        outputs.append(probs @ v)
    return torch.cat(outputs, dim=-2)


@register_attention("topk")
class TopkAttention(AttentionBase):
    """Per-query top-k attention: every query attends to its own k highest-scoring keys.

    Paper: Gupta et al., "Memory-efficient Transformers via Top-k Attention", SustaiNLP 2021 (the query-chunked,
    memory-bounded form used here). A baseline of the MiTA paper (arXiv 2602.01219).

    Args:
        dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer: as
            :class:`~mita.layers.base.AttentionBase`; ``attn_drop`` drops attention probabilities.
        k: keys per query; may be changed after construction (``layer.k = ...``).
        chunk_size: queries per chunk (working memory O(chunk_size * N) per head).
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
        k: int = 64,
        chunk_size: int = 256,
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.k = k
        self.chunk_size = chunk_size

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        grid: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Args:
            x: [B, N, C] tokens.
            key_padding_mask: [B, N] bool, True = padding.
            grid: unused (selection ignores the token layout); accepted for the common signature.

        Returns:
            [B, N, C].
        """
        self.check_input(x, key_padding_mask)
        q, k, v = self.split_qkv(x)
        o = topk_attention(
            q,
            k,
            v,
            self.k,
            scale=self.scale,
            key_padding_mask=key_padding_mask,
            chunk_size=self.chunk_size,
            dropout=self.attn_drop,
        )
        return self.output(self.merge_heads(o))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k={self.k}, chunk_size={self.chunk_size}"
