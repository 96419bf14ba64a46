"""Per-query top-k attention (Gupta et al., "Memory-efficient Transformers via Top-k Attention", 2021)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from mita.layers.base import AttentionBase
from mita.layers.full import SDPA_BACKENDS, nonempty_key_padding_mask
from mita.ops import row_topk_bias
from mita.registry import register_attention

# Entries of one chunk's [B, H, c, M] score / mask tensors (2^28: 0.5 GiB of bf16 scores); sets the automatic
# query chunk, so a training step at Long Range Arena or DeiT sizes is one chunk.
CHUNK_ELEMENTS = 1 << 28


def query_chunk(batch_heads: int, n_queries: int, n_keys: int, chunk_size: int | None) -> int:
    """Queries per chunk: ``chunk_size``, or (None) as many as keep [B * H, c, M] under CHUNK_ELEMENTS."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
        return chunk_size
    return max(1, min(n_queries, CHUNK_ELEMENTS // max(1, batch_heads * n_keys)))


# SDPA kernels that take an additive mask: "auto" lets PyTorch pick (which one it picks depends on the GPU and
# the cuDNN version); a pinned kernel that cannot run the call raises PyTorch's RuntimeError.
MASKED_SDPA_BACKENDS = ("auto", "efficient", "cudnn", "math")


def check_masked_sdpa_backend(name: str) -> str:
    """``name`` if it is one of MASKED_SDPA_BACKENDS, else ValueError."""
    if name not in MASKED_SDPA_BACKENDS:
        raise ValueError(f"sdpa_backend must be one of {MASKED_SDPA_BACKENDS}, got {name!r}")
    return name


def masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    dropout_p: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax attention of q [B, H, c, d] over the keys whose additive ``bias`` [B, H, c, M] (q's dtype) is 0, not
    -inf, on SDPA's fused kernels (every row must allow at least one key); ``backend``: one of MASKED_SDPA_BACKENDS,
    checked by the caller (``topk_attention``, ``moba_attention``)."""
    with contextlib.nullcontext() if backend == "auto" else sdpa_kernel(SDPA_BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)


def topk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk: int,
    *,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    dropout_p: float = 0.0,
    sdpa_backend: str = "auto",
) -> torch.Tensor:
    """Each query attends, with one softmax, to its own ``topk`` highest-scoring valid keys.

    Scores are computed densely (quadratic time) to select the keys; the selection (:func:`mita.ops.row_topk_bias`:
    one Triton kernel on CUDA) writes an additive mask per chunk of queries, which SDPA applies (it computes q k^T
    again), so working
    memory is O(B * H * chunk * M). With ``topk >=`` the number of valid keys the
    result equals full softmax attention. The selection is not differentiated (as in the paper); gradients flow
    through the selected scores and values. Ties at the k-th score go to the lower key index. No host
    synchronisation.

    Args:
        q, k, v: [B, H, N, d] (k and v may have a different length M from q).
        topk: keys per query (>= 1); values above M are clamped to M.
        scale: score scale; None means d^-1/2.
        key_padding_mask: [B, M] bool, True = padding (never selected with a positive weight).
        chunk_size: queries per chunk; None picks the largest chunk within CHUNK_ELEMENTS entries.
        dropout_p: dropout on the attention probabilities (training only; the caller passes 0 in eval).
        sdpa_backend: the SDPA kernel of the masked attention, one of MASKED_SDPA_BACKENDS ("auto": PyTorch picks).

    Returns:
        [B, H, N, d] in q's dtype.
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    check_masked_sdpa_backend(sdpa_backend)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, N, _ = q.shape
    n_keys = k.shape[-2]
    kk = min(topk, n_keys)
    chunk = query_chunk(B * H, N, n_keys, chunk_size)
    key_padding_mask = nonempty_key_padding_mask(key_padding_mask)
    outputs = []
    for q_chunk in q.split(chunk, dim=-2):
        # [B, H, c, M], only to select the keys (not differentiated).
        with torch.no_grad():
            scores = q_chunk @ k.transpose(-2, -1)
        # Additive bias: 0 on the selected keys, -inf elsewhere (SDPA runs a float mask faster than a bool one);
        # padded keys are never selected.
        bias = row_topk_bias(scores, kk, dtype=scores.dtype, key_padding_mask=key_padding_mask)
        del scores
        outputs.append(masked_sdpa(q_chunk, k, v, bias.to(q.dtype), scale, dropout_p, sdpa_backend))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)


@register_attention("topk")
class TopkAttention(AttentionBase):
    """Per-query top-k attention: every query attends to its own k highest-scoring keys.

    Paper: Gupta et al., "Memory-efficient Transformers via Top-k Attention", SustaiNLP 2021 (the query-chunked,
    memory-bounded form used here). A baseline of the MiTA paper (arXiv 2602.01219).

    Args:
        dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer: as
            :class:`~mita.layers.base.AttentionBase`; ``attn_drop`` drops attention probabilities.
        k: keys per query; may be changed after construction (``layer.topk = ...``).
        chunk_size: queries per chunk (working memory O(chunk_size * N) per head); None (default) picks the
            largest chunk within ``CHUNK_ELEMENTS`` score entries.
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
        k: int = 64,
        chunk_size: int | None = None,
        sdpa_backend: str = "auto",
        grid_size: tuple[int, int] | None = None,
        num_prefix_tokens: int = 1,
    ) -> None:
        super().__init__(
            dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer,
            grid_size=grid_size, num_prefix_tokens=num_prefix_tokens,
        )  # fmt: skip
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        query_chunk(1, 1, 1, chunk_size)
        self.topk = k
        self.chunk_size = chunk_size
        self.sdpa_backend = check_masked_sdpa_backend(sdpa_backend)

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
            self.topk,
            scale=self.scale,
            key_padding_mask=key_padding_mask,
            chunk_size=self.chunk_size,
            dropout_p=self.attn_drop_p if self.training else 0.0,
            sdpa_backend=self.sdpa_backend,
        )
        return self.output(self.merge_heads(o))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, k={self.topk}, chunk_size={self.chunk_size}, sdpa_backend={self.sdpa_backend!r}"
        )
