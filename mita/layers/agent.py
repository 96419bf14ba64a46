"""Agent Attention (Han et al., "Agent Attention: On the Integration of Softmax and Linear Attention", ECCV 2024)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mita.layers.base import AttentionBase
from mita.layers.full import nonempty_key_padding_mask
from mita.ops.landmarks import adaptive_pool_matrix
from mita.registry import register_attention


def segment_membership_1d(valid: torch.Tensor, n: int) -> torch.Tensor:
    """Adaptive-pooling windows over the valid tokens of each sequence, wherever they sit.

    Args:
        valid: [B, N] bool, True = valid token.
        n: number of segments.

    Returns:
        [B, n, N] bool: segment j of sequence b holds the valid tokens whose rank r among the valid tokens lies in
        [floor(j * L / n), ceil((j + 1) * L / n)), L = number of valid tokens.
    """
    rank = valid.long().cumsum(dim=-1) - 1
    length = valid.long().sum(dim=-1)[:, None, None]
    j = torch.arange(n, device=valid.device)[None, :, None]
    start = (j * length) // n
    end = ((j + 1) * length + n - 1) // n
    r = rank[:, None, :]
    return (r >= start) & (r < end) & valid[:, None, :]


def interpolate_bias_1d(bias: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Linearly interpolate a 1D bias to each sequence's valid tokens (align_corners=False, as F.interpolate).

    Args:
        bias: [H, n, L0] learned bias over L0 reference positions.
        valid: [B, N] bool.

    Returns:
        [B, H, n, N]: the bias at the relative position of each valid token (padded tokens get an arbitrary value).
    """
    l0 = bias.shape[-1]
    rank = (valid.long().cumsum(dim=-1) - 1).clamp(min=0).to(bias.dtype)
    length = valid.long().sum(dim=-1, keepdim=True).clamp(min=1).to(bias.dtype)
    u = ((rank + 0.5) * l0 / length - 0.5).clamp(0, l0 - 1)
    i0 = u.floor().long()
    i1 = (i0 + 1).clamp(max=l0 - 1)
    frac = (u - i0.to(u.dtype))[:, None, None, :]
    # bias[:, :, i] with i [B, N] is [H, n, B, N].
    lo = bias[:, :, i0].permute(2, 0, 1, 3)
    hi = bias[:, :, i1].permute(2, 0, 1, 3)
    return lo * (1 - frac) + hi * frac


@register_attention("agent")
class AgentAttention(AttentionBase):
    """Agent Attention with agent bias and DWC.

    Paper: Han et al., "Agent Attention: On the Integration of Softmax and Linear Attention", ECCV 2024.
    ``n = agent_num`` agent tokens A are pooled from the queries; then ``V_A = softmax(A k^T s + B1) v`` and
    ``O = softmax(q A^T s + B2) V_A``, plus a depthwise convolution of v (DWC). Registered twice: ``"agent"``
    (bias and DWC, the paper's full model) and ``"agent_minus"`` (neither; the version the MiTA tables use).

    Layout: on images, agents are AdaptiveAvgPool2d of the patch queries to a sqrt(n) x sqrt(n) grid (prefix
    queries excluded, as in the reference code), the DWC runs on the patch value map, and prefix tokens are
    attended / attend with their own learned biases. When the layer has ``grid_size = None`` and
    ``num_prefix_tokens = 0`` (and no ``grid=`` is passed), the layout is 1D: agents are adaptive segment means
    over each sequence's valid tokens, the DWC is a depthwise conv1d, and the grid biases are read as 1D biases
    of length ``bias_grid ** 2`` interpolated to the valid length.

    Agent bias, simplified from the reference (which also adds separable row/column terms): B1 (agent -> key) is
    a learned per-head ``[n, bias_grid, bias_grid]`` grid bilinearly interpolated to the patch grid, with one
    learned bias per agent for prefix keys; B2 (query -> agent) likewise with its own parameters.
    Padding: padded tokens are excluded from agent pooling, get no weight as keys and are zeroed before the DWC.

    Args:
        dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer: as
            :class:`~mita.layers.base.AttentionBase`; ``attn_drop`` drops both attention maps (as the reference).
        agent_num: number of agent tokens n (a perfect square on images; default 49 = 7 x 7).
        agent_bias: learn the position biases B1 and B2.
        dwc: add the depthwise convolution of v.
        dwc_kernel: DWC kernel size (odd).
        bias_grid: side of the learned bias grids.
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
        agent_num: int = 49,
        agent_bias: bool = True,
        dwc: bool = True,
        dwc_kernel: int = 3,
        bias_grid: int = 7,
        grid_size: tuple[int, int] | None = None,
        num_prefix_tokens: int = 1,
    ) -> None:
        super().__init__(
            dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, proj_bias, norm_layer,
            grid_size=grid_size, num_prefix_tokens=num_prefix_tokens,
        )  # fmt: skip
        if agent_num < 1:
            raise ValueError(f"agent_num must be >= 1, got {agent_num}")
        if dwc_kernel < 1 or dwc_kernel % 2 == 0:
            raise ValueError(f"dwc_kernel must be a positive odd int, got {dwc_kernel}")
        if bias_grid < 1:
            raise ValueError(f"bias_grid must be >= 1, got {bias_grid}")
        self.agent_num = agent_num
        self.agent_bias = agent_bias
        self.use_dwc = dwc
        self.bias_grid = bias_grid
        if agent_bias:
            g = bias_grid
            self.an_bias = nn.Parameter(torch.zeros(num_heads, agent_num, g, g))
            self.na_bias = nn.Parameter(torch.zeros(num_heads, agent_num, g, g))
            self.ac_bias = nn.Parameter(torch.zeros(num_heads, agent_num, 1))
            self.ca_bias = nn.Parameter(torch.zeros(num_heads, 1, agent_num))
            for p in (self.an_bias, self.na_bias, self.ac_bias, self.ca_bias):
                nn.init.trunc_normal_(p, std=0.02)
        self.dwc = nn.Conv2d(dim, dim, dwc_kernel, padding=dwc_kernel // 2, groups=dim) if dwc else None

    def _is_1d(self, grid: tuple[int, int] | None) -> bool:
        return grid is None and self.grid_size is None and self.num_prefix_tokens == 0

    def _agents_and_biases_2d(
        self, q: torch.Tensor, valid: torch.Tensor, hw: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        B, H, N, d = q.shape
        p = self.num_prefix_tokens
        side = math.isqrt(self.agent_num)
        if side * side != self.agent_num:
            raise ValueError(f"agent_num must be a perfect square on an image grid, got {self.agent_num}")
        h, w = hw
        # [n, h * w]: AdaptiveAvgPool2d windows, restricted below to valid patches.
        pool = (
            (adaptive_pool_matrix(h, side, q.device) > 0)[:, None, :, None]
            & (adaptive_pool_matrix(w, side, q.device) > 0)[None, :, None, :]
        ).reshape(self.agent_num, h * w)
        member = pool[None] & valid[:, None, p:]
        agents = self._masked_mean(member, q[:, :, p:])
        if not self.agent_bias:
            return agents, None, None
        n = self.agent_num
        # [H, n, h * w] each.
        an = F.interpolate(self.an_bias, size=(h, w), mode="bilinear", align_corners=False).reshape(H, n, h * w)
        na = F.interpolate(self.na_bias, size=(h, w), mode="bilinear", align_corners=False).reshape(H, n, h * w)
        # B1 [1, H, n, N] (agent -> key) and B2 [1, H, N, n] (query -> agent); prefix tokens come first.
        b1 = torch.cat([self.ac_bias.expand(H, n, p), an], dim=-1)[None]
        b2 = torch.cat([self.ca_bias.expand(H, p, n), na.transpose(-2, -1)], dim=-2)[None]
        return agents, b1, b2

    def _agents_and_biases_1d(
        self, q: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        agents = self._masked_mean(segment_membership_1d(valid, self.agent_num), q)
        if not self.agent_bias:
            return agents, None, None
        H, n = self.num_heads, self.agent_num
        b1 = interpolate_bias_1d(self.an_bias.reshape(H, n, -1), valid)
        b2 = interpolate_bias_1d(self.na_bias.reshape(H, n, -1), valid).transpose(-2, -1)
        return agents, b1, b2

    @staticmethod
    def _masked_mean(member: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """member [B, n, N] bool, x [B, H, N, d] -> [B, H, n, d] means (an empty window gives 0)."""
        count = member.sum(dim=-1).clamp(min=1).to(x.dtype)
        return torch.einsum("bjn,bhnd->bhjd", member.to(x.dtype), x) / count[:, None, :, None]

    def _dwc(self, v: torch.Tensor, valid: torch.Tensor, hw: tuple[int, int] | None) -> torch.Tensor:
        """Depthwise conv of the value map: v [B, H, N, d] -> [B, N', C] for the patch tokens (N' = N - prefix)."""
        v = self.merge_heads(v).masked_fill(~valid[..., None], 0.0)
        B, N, C = v.shape
        if hw is None:
            # 1D: the kernel's centre row, i.e. the 2D conv applied to a 1 x N map.
            weight = self.dwc.weight[:, :, self.dwc.weight.shape[2] // 2, :]
            out = F.conv1d(v.transpose(1, 2), weight, self.dwc.bias, padding=weight.shape[-1] // 2, groups=C)
            return out.transpose(1, 2)
        h, w = hw
        p = self.num_prefix_tokens
        v_map = v[:, p:].transpose(1, 2).reshape(B, C, h, w)
        return self.dwc(v_map).reshape(B, C, h * w).transpose(1, 2)

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
        B, N, _ = x.shape
        q, k, v = self.split_qkv(x)
        key_padding_mask = nonempty_key_padding_mask(key_padding_mask)
        valid = torch.ones(B, N, dtype=torch.bool, device=x.device) if key_padding_mask is None else ~key_padding_mask
        hw = None if self._is_1d(grid) else self.resolve_grid(N, grid)
        if hw is None:
            agents, b1, b2 = self._agents_and_biases_1d(q, valid)
        else:
            agents, b1, b2 = self._agents_and_biases_2d(q, valid, hw)

        # Agent aggregation: [B, H, n, N] over the valid keys.
        agent_scores = (agents * self.scale) @ k.transpose(-2, -1)
        if b1 is not None:
            agent_scores = agent_scores + b1
        agent_attn = agent_scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(dim=-1)
        agent_v = self.attn_drop(agent_attn) @ v
        # Agent broadcast: [B, H, N, n].
        query_scores = (q * self.scale) @ agents.transpose(-2, -1)
        if b2 is not None:
            query_scores = query_scores + b2
        o = self.merge_heads(self.attn_drop(query_scores.softmax(dim=-1)) @ agent_v)

        if self.dwc is not None:
            p = 0 if hw is None else self.num_prefix_tokens
            o = torch.cat([o[:, :p], o[:, p:] + self._dwc(v, valid, hw)], dim=1)
        return self.output(o)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, agent_num={self.agent_num}, agent_bias={self.agent_bias}, dwc={self.use_dwc}"


@register_attention("agent_minus")
class AgentMinusAttention(AgentAttention):
    """Agent Attention without agent bias and without DWC ("Agent minus", the version the MiTA tables compare).

    Paper: Han et al., "Agent Attention", ECCV 2024. Same as :class:`AgentAttention` with other defaults; the
    options are the same.
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
        agent_num: int = 49,
        agent_bias: bool = False,
        dwc: bool = False,
        dwc_kernel: int = 3,
        bias_grid: int = 7,
        grid_size: tuple[int, int] | None = None,
        num_prefix_tokens: int = 1,
    ) -> None:
        super().__init__(
            dim,
            num_heads,
            qkv_bias,
            qk_norm,
            attn_drop,
            proj_drop,
            proj_bias,
            norm_layer,
            agent_num=agent_num,
            agent_bias=agent_bias,
            dwc=dwc,
            dwc_kernel=dwc_kernel,
            bias_grid=bias_grid,
            grid_size=grid_size,
            num_prefix_tokens=num_prefix_tokens,
        )
