"""Which keys MiTA selects: the routed experts' key positions per layer (the paper's "emergent token pruning").

Every :class:`~mita.layers.mita.MiTAAttention` can record the key indices of its routed experts
(``record_selection``). This module switches the recording on for a whole model, turns the indices into counts on
the patch grid, and summarises how concentrated the selection is per layer::

    maps = selection_maps(model, images)          # maps.patches: [layers, B, h, w] counts
    stats = concentration_stats(maps, foreground)  # one dict per layer

Counts aggregate over heads and landmarks: with k <= N every image contributes ``H * m * k`` selections per layer,
split between the patch grid and the prefix tokens (CLS, registers). Unselected keys still reach every query
through the shared (compressed) expert; the maps show only the routed part.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from mita.layers.mita import MiTAAttention


def mita_layers(model: nn.Module) -> list[tuple[str, MiTAAttention]]:
    """The MiTA attention layers of ``model`` in forward (module) order, with their qualified names."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MiTAAttention)]


@dataclass
class RoutingRecord:
    """What :func:`record_routing` collected.

    Attributes:
        names: qualified names of the MiTA layers, in module order.
        layers: the layers themselves.
        selections: after the ``with`` block, each layer's ``[B, H, m, k]`` indices of its last forward (None for a
            layer that did not run); inside the block, read :meth:`current`.
    """

    names: list[str]
    layers: list[MiTAAttention]
    selections: list[torch.Tensor | None] = field(default_factory=list)

    def current(self) -> list[torch.Tensor | None]:
        """The layers' selections of their most recent forward (inside the ``with`` block)."""
        return [layer.last_selection for layer in self.layers]


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecord]:
    """Make every MiTA layer of ``model`` record its routed-expert key indices while the block runs.

    On exit the recording flags return to their previous values, the layers drop what they recorded, and the
    record keeps the last selection of each layer in ``record.selections``.

    Args:
        model: any module holding :class:`MiTAAttention` layers.

    Yields:
        A :class:`RoutingRecord`.

    Raises:
        ValueError: the model has no MiTA layer.
    """
    found = mita_layers(model)
    if not found:
        raise ValueError(f"model: {type(model).__name__} has no MiTAAttention layer to record")
    record = RoutingRecord(names=[n for n, _ in found], layers=[layer for _, layer in found])
    previous = [layer.record_selection for layer in record.layers]
    for layer in record.layers:
        layer.record_selection = True
        layer.last_selection = None
    try:
        yield record
    finally:
        record.selections = record.current()
        for layer, flag in zip(record.layers, previous):
            layer.record_selection = flag
            layer.last_selection = None


def selection_counts(
    selection: torch.Tensor, num_tokens: int, num_prefix_tokens: int, grid: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Count how often each key position is selected, over heads, landmarks and expert slots.

    Args:
        selection: ``[B, H, m, k]`` key indices (``-1``: empty slot, not counted).
        num_tokens: N, tokens per sequence (prefix + patches).
        num_prefix_tokens: P, tokens before the patches.
        grid: patch grid ``(h, w)`` with ``h * w == N - P``.

    Returns:
        (patch counts ``[B, h, w]``, prefix counts ``[B, P]``), float32.
    """
    h, w = grid
    if h * w + num_prefix_tokens != num_tokens:
        raise ValueError(f"grid: {h}x{w} patches + {num_prefix_tokens} prefix tokens != N={num_tokens}")
    B = selection.shape[0]
    flat = selection.reshape(B, -1)
    valid = flat >= 0
    counts = torch.zeros(B, num_tokens, dtype=torch.float32, device=selection.device)
    counts.scatter_add_(1, flat.clamp_min(0), valid.float())
    return counts[:, num_prefix_tokens:].reshape(B, h, w), counts[:, :num_prefix_tokens]


@dataclass
class SelectionMaps:
    """Per-layer selection counts of a batch of images.

    Attributes:
        patches: ``[L, B, h, w]`` selections of each patch position (all heads, landmarks and slots together).
        prefix: ``[L, B, P]`` selections of the prefix tokens (CLS, registers).
        names: the L layer names.
        heads, landmarks, k: per layer, H, m and the expert width used (``min(k, N)``).
    """

    patches: torch.Tensor
    prefix: torch.Tensor
    names: list[str]
    heads: list[int]
    landmarks: list[int]
    k: list[int]

    @property
    def totals(self) -> torch.Tensor:
        """``[L, B]`` selections per image and layer (``H * m * k`` when every slot holds a valid key)."""
        return self.patches.flatten(2).sum(-1) + self.prefix.sum(-1)


@torch.no_grad()
def selection_maps(model: nn.Module, images: torch.Tensor, **forward_kwargs: Any) -> SelectionMaps:
    """Run ``model`` on ``images`` (eval mode) and count, per MiTA layer, the selected key positions.

    Args:
        model: a backbone whose MiTA layers know their ``grid_size`` and ``num_prefix_tokens`` (the timm
            entrypoints of :mod:`mita.models.vit` set them).
        images: ``[B, 3, H_img, W_img]``, preprocessed as the model expects.
        **forward_kwargs: passed to ``model(images, ...)``.

    Returns:
        :class:`SelectionMaps` with ``patches [L, B, h, w]``.
    """
    was_training = model.training
    model.eval()
    try:
        with record_routing(model) as record:
            model(images, **forward_kwargs)
    finally:
        model.train(was_training)
    patches, prefix, heads, landmarks, widths = [], [], [], [], []
    for name, layer, sel in zip(record.names, record.layers, record.selections):
        if sel is None:
            raise RuntimeError(f"layer {name} did not run in the forward pass")
        num_prefix = layer.num_prefix_tokens
        grid = layer.grid_size
        if grid is None:
            raise ValueError(f"layer {name}: grid_size is None (a 1D model); selection maps need a patch grid")
        num_tokens = grid[0] * grid[1] + num_prefix
        p, c = selection_counts(sel, num_tokens, num_prefix, tuple(grid))
        patches.append(p)
        prefix.append(c)
        heads.append(sel.shape[1])
        landmarks.append(sel.shape[2])
        widths.append(sel.shape[3])
    return SelectionMaps(torch.stack(patches), torch.stack(prefix), record.names, heads, landmarks, widths)


def patch_mask(mask: torch.Tensor, grid: tuple[int, int], threshold: float = 0.5) -> torch.Tensor:
    """Pixel mask -> patch mask: a patch is True when at least ``threshold`` of its pixels are.

    Args:
        mask: ``[B, H_img, W_img]`` (bool or [0, 1] float), True = foreground.
        grid: patch grid ``(h, w)``; the image sides must be multiples of it.
        threshold: fraction of a patch's pixels that must be True.

    Returns:
        ``[B, h, w]`` bool.
    """
    h, w = grid
    if mask.shape[-2] % h or mask.shape[-1] % w:
        raise ValueError(f"mask: {tuple(mask.shape[-2:])} pixels do not split into a {h}x{w} patch grid")
    share = F.adaptive_avg_pool2d(mask.float()[:, None], (h, w))[:, 0]
    return share >= threshold


def concentration_stats(maps: SelectionMaps, foreground: torch.Tensor | None = None) -> list[dict[str, float]]:
    """Per-layer concentration of the selection, averaged over the images.

    Args:
        maps: from :func:`selection_maps`.
        foreground: optional ``[B, h, w]`` bool patch mask (True = object); adds the background share.

    Returns:
        One dict per layer: ``layer`` (index), ``name``, ``selections_per_image``, ``prefix_fraction`` (share of
        selections on prefix tokens), ``distinct_patch_fraction`` (share of patches selected at least once),
        ``entropy_nats`` of the patch histogram and ``normalized_entropy`` (divided by log(h w): 1 is uniform),
        and with a mask ``background_selection_fraction`` (share of the patch selections on background
        patches) beside ``background_patch_fraction`` (share of background patches: what a uniform selection
        would give).
    """
    L, B, h, w = maps.patches.shape
    flat = maps.patches.reshape(L, B, h * w)
    patch_total = flat.sum(-1)  # [L, B]
    probs = flat / patch_total.clamp_min(1e-12)[..., None]
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)  # [L, B]
    totals = maps.totals
    if foreground is not None:
        if foreground.shape != (B, h, w):
            raise ValueError(f"foreground: expected shape {(B, h, w)}, got {tuple(foreground.shape)}")
        background = (~foreground.bool()).reshape(1, B, h * w).float()
        bg_sel = (flat * background).sum(-1) / patch_total.clamp_min(1e-12)  # [L, B]
        bg_patch = background[0].mean(-1)  # [B]
    rows = []
    for i in range(L):
        row: dict[str, Any] = {
            "layer": i,
            "name": maps.names[i],
            "selections_per_image": totals[i].mean().item(),
            "prefix_fraction": (maps.prefix[i].sum(-1) / totals[i].clamp_min(1e-12)).mean().item(),
            "distinct_patch_fraction": (flat[i] > 0).float().mean().item(),
            "entropy_nats": entropy[i].mean().item(),
            "normalized_entropy": (entropy[i].mean() / math.log(h * w)).item() if h * w > 1 else 0.0,
        }
        if foreground is not None:
            row["background_selection_fraction"] = bg_sel[i].mean().item()
            row["background_patch_fraction"] = bg_patch.mean().item()
        rows.append(row)
    return rows


__all__ = [
    "RoutingRecord",
    "SelectionMaps",
    "concentration_stats",
    "mita_layers",
    "patch_mask",
    "record_routing",
    "selection_counts",
    "selection_maps",
]
