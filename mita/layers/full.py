"""Full softmax attention (Vaswani et al., "Attention Is All You Need", NeurIPS 2017) on fused kernels."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mita.layers.base import AttentionBase
from mita.registry import register_attention

SDPA_BACKENDS: dict[str, SDPBackend | None] = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def nonempty_key_padding_mask(key_padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Unmask every key of a sequence that is padding only, so that no softmax row is empty.

    A fully padded sequence has no valid query, so its outputs may be anything finite; attending over its
    (padding) keys keeps them finite and keeps NaN out of the backward pass. Sequences with at least one valid
    token are returned unchanged. No host synchronisation.

    Args:
        key_padding_mask: [B, N] bool, True = padding, or None.

    Returns:
        [B, N] bool (or None), equal to the input except on rows that were all True, which become all False.
    """
    if key_padding_mask is None:
        return None
    return key_padding_mask & ~key_padding_mask.all(dim=-1, keepdim=True)


@register_attention("full")
class FullAttention(AttentionBase):
    """Full softmax attention on PyTorch SDPA (or FlashAttention) with a selectable kernel.

    Paper: Vaswani et al., "Attention Is All You Need", NeurIPS 2017; the speed baseline of the MiTA tables, which
    run it on FlashAttention (Dao, "FlashAttention-2", ICLR 2024).

    Args:
        dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer: as
            :class:`~mita.layers.base.AttentionBase`. ``attn_drop`` is SDPA's ``dropout_p`` in training.
        sdpa_backend: ``"auto"`` (PyTorch picks), or pin one kernel: ``"flash"``, ``"efficient"``, ``"cudnn"``,
            ``"math"``. A pinned kernel that cannot run the call raises PyTorch's RuntimeError ("No available
            kernel") instead of silently falling back.
        use_flash_attn: use the ``flash_attn`` package (optional extra ``mita[flash]``) for calls it can run
            (CUDA, fp16/bf16, no ``key_padding_mask``, head dim <= 256); other calls go to SDPA. ``None``: use it
            when it is importable and ``sdpa_backend == "auto"``; ``True``: require it (ImportError if missing);
            ``False``: never.
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
        sdpa_backend: str = "auto",
        use_flash_attn: bool | None = None,
        grid_size: tuple[int, int] | None = None,
        num_prefix_tokens: int = 1,
    ) -> None:
        super().__init__(
            dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer,
            grid_size=grid_size, num_prefix_tokens=num_prefix_tokens,
        )  # fmt: skip
        if sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"sdpa_backend must be one of {sorted(SDPA_BACKENDS)}, got {sdpa_backend!r}")
        self.sdpa_backend = sdpa_backend
        available = importlib.util.find_spec("flash_attn") is not None
        if use_flash_attn and not available:
            raise ImportError("use_flash_attn=True needs the flash_attn package (pip install 'mita[flash]')")
        self.use_flash_attn = available and sdpa_backend == "auto" if use_flash_attn is None else bool(use_flash_attn)

    def _flash_attn_eligible(self, q: torch.Tensor, key_padding_mask: torch.Tensor | None) -> bool:
        return (
            self.use_flash_attn
            and key_padding_mask is None
            and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)
            and self.head_dim <= 256
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Softmax attention on heads.

        Args:
            q, k, v: [B, H, N, d].
            key_padding_mask: [B, N] bool, True = padding (those keys get no weight).

        Returns:
            [B, H, N, d].
        """
        dropout_p = self.attn_drop_p if self.training else 0.0
        if self._flash_attn_eligible(q, key_padding_mask):
            from flash_attn import flash_attn_func

            # flash_attn takes [B, N, H, d].
            o = flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p, softmax_scale=self.scale
            )
            return o.transpose(1, 2)
        attn_mask = None
        key_padding_mask = nonempty_key_padding_mask(key_padding_mask)
        if key_padding_mask is not None:
            if self.sdpa_backend == "flash":
                raise ValueError("sdpa_backend='flash' cannot take a key_padding_mask; use 'efficient' or 'auto'")
            # SDPA's boolean mask marks keys that may be attended: [B, 1, 1, N] broadcasts over heads and queries.
            attn_mask = ~key_padding_mask[:, None, None, :]
        backend = SDPA_BACKENDS[self.sdpa_backend]
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=self.scale)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=self.scale)

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        grid: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Args:
            x: [B, N, C] tokens.
            key_padding_mask: [B, N] bool, True = padding.
            grid: unused (full attention has no token layout); accepted for the common signature.

        Returns:
            [B, N, C].
        """
        self.check_input(x, key_padding_mask)
        q, k, v = self.split_qkv(x)
        return self.output(self.merge_heads(self.attend(q, k, v, key_padding_mask)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sdpa_backend={self.sdpa_backend!r}, use_flash_attn={self.use_flash_attn}"
