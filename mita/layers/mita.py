"""MiTA attention layers: Mixture-of-Top-k Attention (Wen et al., arXiv 2602.01219, NeurIPS 2026)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mita.layers.base import AttentionBase
from mita.ops.landmarks import LAYOUTS, landmark_grid, pool_landmarks
from mita.ops.mita import mita_attention, mita_attention_pooled, stable_topk_indices
from mita.registry import register_attention


def _resolve_shared_scale(shared_scale: float | str | None, scale: float) -> float | None:
    if shared_scale is None or shared_scale == "reference":
        return None
    if shared_scale == "standard":
        return scale
    if isinstance(shared_scale, (int, float)) and not isinstance(shared_scale, bool) and shared_scale > 0:
        return float(shared_scale)
    raise ValueError(f"shared_scale must be None, 'reference', 'standard' or a float > 0, got {shared_scale!r}")


@register_attention("mita")
class MiTAAttention(AttentionBase):
    """Mixture-of-Top-k Attention as a drop-in replacement of timm's ``Attention``.

    Landmarks are pooled from the (normalised) queries; each landmark picks its top-k keys as a routed expert
    and summarises all keys as a shared expert; each query attends in one softmax to the m shared entries and
    its routed expert's k entries (see ``mita.mita_attention``). MiTA adds no parameters, so timm
    full-attention checkpoints load without key mapping; the DWC and Gate variants add their own modules.

    Args:
        dim, num_heads, qkv_bias, qk_norm, proj_drop, proj_bias, norm_layer: as timm's ``Attention``.
        attn_drop: must be 0 (the fused kernels have no dropout on attention probabilities).
        m: number of landmarks; a perfect square (or ``(ph, pw)``) for the 2D layouts. Changeable after
            construction (``set_budget``), e.g. to evaluate a trained model with another budget.
        k: keys per routed expert. Changeable after construction.
        experts_per_query: S, routed experts per query (the paper uses 1; S = 2 with k halved is an ablation).
        landmark_layout: ``"official"`` (the reference code's CLS-shifted grid), ``"patches"`` (patch tokens
            only, after the prefix tokens) or ``"1d"`` (segment means over the valid tokens of a sequence).
        shared_scale: ``None`` / ``"reference"`` (q.R / d, the reference code's quirk), ``"standard"``
            (q.R / sqrt(d)) or a float.
        routing_only: drop the shared expert (the routing-only ablation; give it twice the k for an equal
            per-query budget, as ``mita_routing`` does by default).
        dwc: add a depth-wise 3x3 convolution of the value map of the patch tokens (1D: kernel-3 conv1d over
            the sequence) to the attention output; prefix tokens get 0.
        gate: multiply (attention + DWC) by SiLU of an extra C -> C projection of the input.
        backend: MiTA backend (None: fastest available).

    Analysis hook (off by default, no effect on the output): with ``record_selection = True`` every forward
    stores ``last_selection``, the ``[B, H, m, k]`` key indices of each landmark's routed expert (the reference
    operator's selection; ``-1`` marks an empty slot when fewer than k keys are valid). See ``mita.analysis``.
    """

    sequence_options = {"landmark_layout": "1d"}

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        proj_bias: bool = True,
        norm_layer: type[nn.Module] | None = None,
        m: int | tuple[int, int] = 25,
        k: int = 25,
        experts_per_query: int = 1,
        landmark_layout: str = "official",
        shared_scale: float | str | None = None,
        routing_only: bool = False,
        dwc: bool = False,
        gate: bool = False,
        backend: str | None = None,
        grid_size: tuple[int, int] | None = None,
        num_prefix_tokens: int = 1,
    ) -> None:
        super().__init__(
            dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer,
            grid_size=grid_size, num_prefix_tokens=num_prefix_tokens,
        )  # fmt: skip
        if attn_drop:
            raise ValueError(
                f"attn_drop must be 0 for MiTA attention (no dropout on its probabilities), got {attn_drop}"
            )
        if landmark_layout not in LAYOUTS:
            raise ValueError(f"landmark_layout must be one of {LAYOUTS}, got {landmark_layout!r}")
        self.landmark_layout = landmark_layout
        self.experts_per_query = int(experts_per_query)
        self.routing_only = bool(routing_only)
        self.shared_scale = _resolve_shared_scale(shared_scale, self.scale)
        self.backend = backend
        self.set_budget(m=m, k=k)
        if landmark_layout == "1d":
            self.num_prefix_tokens = 0
        self.dwc = None
        if dwc:
            conv = nn.Conv1d if landmark_layout == "1d" else nn.Conv2d
            self.dwc = conv(dim, dim, kernel_size=3, padding=1, groups=dim)
        self.gate_proj = nn.Linear(dim, dim) if gate else None
        self.record_selection = False
        self.last_selection: torch.Tensor | None = None

    def set_budget(self, m: int | tuple[int, int] | None = None, k: int | None = None) -> None:
        """Change the number of landmarks and/or the expert width (no parameters depend on them)."""
        if m is not None:
            sizes = m if isinstance(m, (tuple, list)) else (m,)
            if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"m must be an int >= 1 or a (ph, pw) tuple of them, got {m!r}")
            self.m = tuple(m) if isinstance(m, (tuple, list)) else m
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"k must be an int >= 1, got {k!r}")
            self.topk = k
        if self.landmark_layout != "1d":
            landmark_grid(self.m)  # 2D layouts need a p x p or (ph, pw) landmark grid: say so now, not at forward
        n_landmarks = self.m[0] * self.m[1] if isinstance(self.m, tuple) else self.m
        if self.experts_per_query < 1 or self.experts_per_query > n_landmarks:
            raise ValueError(f"experts_per_query must be in [1, m={n_landmarks}], got {self.experts_per_query}")

    def _dwc(self, v: torch.Tensor, grid: tuple[int, int] | None, key_padding_mask: torch.Tensor | None):
        """Depth-wise conv of the value map: v [B, H, N, d] -> [B, N, C]; prefix tokens get 0."""
        B, H, N, d = v.shape
        v = self.merge_heads(v)
        if self.landmark_layout == "1d":
            if key_padding_mask is not None:
                v = v.masked_fill(key_padding_mask[..., None], 0.0)
            return self.dwc(v.transpose(1, 2)).transpose(1, 2)
        h, w = self.resolve_grid(N, grid)
        p = self.num_prefix_tokens
        patches = v[:, p:].transpose(1, 2).reshape(B, H * d, h, w)
        out = self.dwc(patches).flatten(2).transpose(1, 2)
        return F.pad(out, (0, 0, p, 0))

    def _routed_selection(
        self, k: torch.Tensor, landmarks: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """[B, H, m, min(k, N)] routed-expert key indices as naive_mita selects them (fp32 scores R k^T over the
        valid keys, ties to the lower index); slots beyond the valid keys hold -1."""
        ct = torch.float64 if k.dtype == torch.float64 else torch.float32
        scores = landmarks.to(ct) @ k.to(ct).transpose(-1, -2)  # [B, H, m, N]
        idx = stable_topk_indices(
            scores if key_padding_mask is None else scores.masked_fill(key_padding_mask[:, None, None], float("-inf")),
            min(self.topk, k.shape[2]),
        )
        if key_padding_mask is not None:
            idx = idx.masked_fill(torch.gather(key_padding_mask[:, None, None].expand_as(scores), 3, idx), -1)
        return idx

    def forward(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None, grid: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Args: x ``[B, N, C]``; key_padding_mask ``[B, N]`` bool (True = padding); grid ``(h, w)`` patch grid
        (default: the layer's ``grid_size`` or a square inferred from N). Returns ``[B, N, C]``."""
        self.check_input(x, key_padding_mask)
        q, k, v = self.split_qkv(x)
        # qk-norm and RoPE may promote q, k to float32 under autocast; the operator wants one dtype.
        q, k = q.to(v.dtype), k.to(v.dtype)
        # No copies here: the Triton backend reads the head split of the qkv projection in place (one layout for q,
        # k, v; qk-norm or RoPE output is copied once by the operator) and returns [B, N, H, d]-ordered output.
        pool_grid = None if self.landmark_layout == "1d" else self.resolve_grid(x.shape[1], grid)
        kwargs = dict(
            experts_per_query=self.experts_per_query,
            shared=not self.routing_only,
            shared_scale=self.shared_scale,
            scale=self.scale,
            key_padding_mask=key_padding_mask,
            backend=self.backend,
        )
        if self.record_selection:
            # The landmarks mita_attention_pooled would pool, kept for the selection record.
            landmarks = pool_landmarks(
                q, self.m, layout=self.landmark_layout, grid=pool_grid, num_prefix_tokens=self.num_prefix_tokens,
                key_padding_mask=key_padding_mask if self.landmark_layout == "1d" else None,
            )  # fmt: skip
            self.last_selection = self._routed_selection(k, landmarks, key_padding_mask)
            o = mita_attention(q, k, v, landmarks, self.topk, **kwargs)
        else:
            o = mita_attention_pooled(
                q, k, v, self.m, self.topk, layout=self.landmark_layout, grid=pool_grid,
                num_prefix_tokens=self.num_prefix_tokens, **kwargs,
            )  # fmt: skip
        return self._finish(o, x, v, grid, key_padding_mask)

    def _finish(self, o, x, v, grid, key_padding_mask) -> torch.Tensor:
        """Heads merged, DWC and gate applied, output projection."""
        o = self.merge_heads(o)
        if self.dwc is not None:
            o = o + self._dwc(v, grid, key_padding_mask)
        if self.gate_proj is not None:
            o = o * F.silu(self.gate_proj(x))
        return self.output(o)

    def extra_repr(self) -> str:
        extras = [f"m={self.m}", f"k={self.topk}", f"layout={self.landmark_layout}"]
        if self.experts_per_query != 1:
            extras.append(f"experts_per_query={self.experts_per_query}")
        if self.routing_only:
            extras.append("routing_only=True")
        return super().extra_repr() + ", " + ", ".join(extras)


@register_attention("mita_routing")
class MiTARoutingAttention(MiTAAttention):
    """Routing-only MiTA (the paper's ablation): no shared expert, k doubled for an equal per-query budget
    (50 = 2 x 25 entries against MiTA's 25 + 25). Same arguments as :class:`MiTAAttention`."""

    def __init__(self, dim: int, num_heads: int = 8, *, k: int = 50, **kwargs) -> None:
        kwargs.pop("routing_only", None)
        super().__init__(dim, num_heads, k=k, routing_only=True, **kwargs)
