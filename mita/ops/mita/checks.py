"""Argument checks shared by every MiTA backend: one clear ValueError naming the argument."""

from __future__ import annotations

import math

import torch


def check_mita_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    landmarks: torch.Tensor,
    topk: int,
    experts_per_query: int,
    shared: bool,
    shared_scale: float | None,
    scale: float | None,
    key_padding_mask: torch.Tensor | None,
) -> tuple[float, float]:
    """Validate MiTA arguments without synchronising the device.

    Returns:
        ``(scale, shared_scale)`` with the defaults resolved: ``scale = d ** -0.5`` and
        ``shared_scale = scale ** 2`` (the reference code's quirk).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("landmarks", landmarks)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, N, d], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got dtype {t.dtype}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k and v must have the same shape [B, H, N, d], got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    B, H, N, d = q.shape
    if N < 1 or d < 1:
        raise ValueError(f"q must have N >= 1 tokens and d >= 1, got shape {tuple(q.shape)}")
    if landmarks.shape[2] < 1:
        raise ValueError(f"landmarks: m must be >= 1, got m={landmarks.shape[2]}")
    if landmarks.shape[:2] != (B, H) or landmarks.shape[3] != d:
        raise ValueError(f"landmarks must be [B={B}, H={H}, m, d={d}], got shape {tuple(landmarks.shape)}")
    for name, t in (("k", k), ("v", v), ("landmarks", landmarks)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    m = landmarks.shape[2]
    S = experts_per_query
    if isinstance(S, bool) or not isinstance(S, int) or S < 1 or S > m:
        raise ValueError(f"experts_per_query must be an int in [1, m={m}], got {S!r}")
    if not isinstance(shared, bool):
        raise ValueError(f"shared must be a bool, got {shared!r}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise ValueError("key_padding_mask must be a bool tensor (True marks padding)")
        if key_padding_mask.shape != (B, N):
            raise ValueError(f"key_padding_mask must have shape [B={B}, N={N}], got {tuple(key_padding_mask.shape)}")
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask must be on q's device {q.device}, got {key_padding_mask.device}")
    if scale is None:
        scale = d**-0.5
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite float > 0 or None, got {scale!r}")
    if shared_scale is None:
        shared_scale = scale * scale
    if not (isinstance(shared_scale, (int, float)) and math.isfinite(shared_scale) and shared_scale > 0):
        raise ValueError(f"shared_scale must be a finite float > 0 or None, got {shared_scale!r}")
    return float(scale), float(shared_scale)
