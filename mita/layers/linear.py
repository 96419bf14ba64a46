"""ReLU linear attention (Katharopoulos et al., "Transformers are RNNs", ICML 2020, with phi = ReLU)."""

from __future__ import annotations

import torch
import torch.nn as nn

from mita.layers.base import AttentionBase
from mita.registry import register_attention


def relu_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Linear attention with the ReLU feature map, computed in fp32.

    ``o_i = phi(q_i) (sum_j phi(k_j)^T v_j) / (phi(q_i) . sum_j phi(k_j) + eps)`` with ``phi = relu`` and the sums
    over valid keys only. A query whose features are all zero (or a sequence with no valid key) gets output 0.

    Args:
        q, k, v: [B, H, N, d] (k and v may have another length M).
        key_padding_mask: [B, M] bool, True = padding (those keys contribute nothing).
        eps: added to the normaliser.

    Returns:
        [B, H, N, d] in q's dtype.
    """
    phi_q = torch.relu(q.float())
    phi_k = torch.relu(k.float())
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    # [B, H, d, d] and [B, H, d, 1]
    kv = phi_k.transpose(-2, -1) @ v.float()
    k_sum = phi_k.sum(dim=-2).unsqueeze(-1)
    o = (phi_q @ kv) / (phi_q @ k_sum + eps)
    return o.to(q.dtype)


@register_attention("linear")
class LinearAttention(AttentionBase):
    """ReLU linear attention: softmax(q k^T) replaced by relu(q) relu(k)^T, row-normalised; O(N d^2).

    Paper: Katharopoulos et al., "Transformers are RNNs: Fast Autoregressive Transformers with Linear Attention",
    ICML 2020 (kernelised attention), with the ReLU feature map used as the plain linear-attention baseline by
    Cai et al., "EfficientViT", ICCV 2023 and Han et al., "FLatten Transformer", ICCV 2023. The simplest
    compression baseline of the MiTA reference package.

    Args:
        dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer: as
            :class:`~mita.layers.base.AttentionBase`. There is no attention matrix to drop, so ``attn_drop`` must
            be 0 (ValueError otherwise).
        eps: added to the normaliser.
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
        eps: float = 1e-6,
        grid_size: tuple[int, int] | None = None,
        num_prefix_tokens: int = 1,
    ) -> None:
        if attn_drop != 0.0:
            raise ValueError(f"attn_drop: linear attention forms no attention matrix to drop, got {attn_drop}")
        super().__init__(
            dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer,
            grid_size=grid_size, num_prefix_tokens=num_prefix_tokens,
        )  # fmt: skip
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        grid: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Args:
            x: [B, N, C] tokens.
            key_padding_mask: [B, N] bool, True = padding.
            grid: unused; accepted for the common signature.

        Returns:
            [B, N, C].
        """
        self.check_input(x, key_padding_mask)
        q, k, v = self.split_qkv(x)
        o = relu_linear_attention(q, k, v, key_padding_mask=key_padding_mask, eps=self.eps)
        return self.output(self.merge_heads(o))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, eps={self.eps}"
