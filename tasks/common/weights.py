"""Initialise a network from a local checkpoint: a timm / torch state dict or a Lightning checkpoint of this
project. This is how full-attention weights become the start of a MiTA model (fine-tuning, Table B; the
Segmenter encoder) or are evaluated with MiTA swapped in at inference ("mutual compatibility").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn


class WeightsError(ValueError):
    """A checkpoint that cannot initialise the network (missing file, wrong shapes, unknown format)."""


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a ``.pth`` / ``.pt`` / ``.bin`` state dict (optionally under ``"model"`` or ``"state_dict"``),
    a ``.safetensors`` file, or a Lightning ``.ckpt`` of this project (keys ``net.*``, ``_orig_mod.`` stripped)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"init_weights: {path} is not a file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=False)
    for key in ("state_dict", "model", "module"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"init_weights: {path} holds no state dict of tensors")
    if any(k.startswith("net.") for k in state):
        state = {k[len("net.") :]: v for k, v in state.items() if k.startswith("net.")}
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}


def load_init_weights(
    net: nn.Module, path: str | Path, skip: Sequence[str] = (), prefix: str = ""
) -> dict[str, list[str]]:
    """Copy the checkpoint's tensors into ``net`` wherever names and shapes match.

    Args:
        net: the network.
        path: checkpoint file (see :func:`read_state_dict`).
        skip: key prefixes to leave at their initial values (e.g. ``["head."]`` for another number of classes).
        prefix: where a checkpoint of a sub-network goes (``"encoder."``: a timm ViT state dict into Segmenter's
            encoder); prepended to every key unless some key already starts with it (a checkpoint of ``net``).

    Returns:
        ``{"missing": [...], "unexpected": [...], "skipped": [...]}``: parameters the checkpoint did not provide
        (e.g. a DWC or gate added to a full-attention model), checkpoint keys the network does not have, and
        keys left out by ``skip``.

    Raises:
        WeightsError: the file is unreadable, a shared key has another shape (name it in ``skip`` to keep the
            network's), or no key at all matches.
    """
    state = read_state_dict(path)
    if prefix and not any(k.startswith(prefix) for k in state):
        state = {prefix + k: v for k, v in state.items()}
    own = net.state_dict()
    # A network that resamples position embeddings of another grid while loading (Segmenter's encoder) says so.
    resamples = getattr(net, "resamples_pos_embed", False)
    skipped = sorted(k for k in state if any(k.startswith(p) for p in skip))
    state = {k: v for k, v in state.items() if k not in skipped}
    mismatched = [
        f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape and not (resamples and k.endswith("pos_embed"))
    ]
    if mismatched:
        raise WeightsError(
            f"init_weights: {len(mismatched)} tensors have other shapes ({'; '.join(mismatched[:3])}); "
            "leave them out with init_weights_skip=[prefix, ...]"
        )
    shared = [k for k in state if k in own]
    if not shared:
        raise WeightsError(f"init_weights: no tensor of {path} matches the network's parameter names")
    result = net.load_state_dict({k: state[k] for k in shared}, strict=False)
    return {
        "missing": sorted(result.missing_keys),
        "unexpected": sorted(k for k in state if k not in own),
        "skipped": skipped,
    }
