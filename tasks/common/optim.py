"""Optimisers (timm's factory: AdamW, LAMB, SGD, ...) and step-wise learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from timm.optim import create_optimizer_v2


def build_optimizer(model: nn.Module, cfg: Mapping[str, Any], global_batch: int) -> torch.optim.Optimizer:
    """Build the optimiser from the ``optimizer`` config group.

    Weight decay skips biases, norm weights and the model's ``no_weight_decay()`` names (cls token, position
    embedding), as in DeiT.

    Args:
        model: the network.
        cfg: ``name`` (timm optimiser name: adamw, lamb, sgd, momentum, ...), ``lr``, ``weight_decay``,
            ``lr_batch_ref`` (None: use ``lr`` as is; else ``lr * global_batch / lr_batch_ref``, the DeiT rule
            5e-4 x batch / 512), and any further keyword of the optimiser (``betas``, ``eps``, ``momentum``).
        global_batch: samples per optimiser step over all devices (batch x devices x nodes x accumulation).

    Returns:
        The optimiser; its param groups start at the scaled learning rate.
    """
    cfg = dict(cfg)
    name = cfg.pop("name")
    lr = float(cfg.pop("lr"))
    ref = cfg.pop("lr_batch_ref", None)
    if ref:
        lr = lr * global_batch / float(ref)
    weight_decay = float(cfg.pop("weight_decay", 0.0))
    if "betas" in cfg and cfg["betas"] is not None:
        cfg["betas"] = tuple(cfg["betas"])
    return create_optimizer_v2(model, opt=name, lr=lr, weight_decay=weight_decay, **cfg)


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str, start: float, floor: float, power: float):
    """Multiplier of the base learning rate at optimiser step ``step``.

    Args:
        step: optimiser steps taken so far.
        total_steps: steps of the whole run.
        warmup_steps: linear warm-up from ``start`` to 1.
        schedule: ``"cosine"``, ``"linear"`` (to ``floor``), ``"poly"`` (power ``power``) or ``"constant"``.
        start: warm-up start as a fraction of the base rate.
        floor: final value as a fraction of the base rate.
        power: exponent of ``"poly"``.

    Returns:
        float.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return start + (1.0 - start) * step / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if schedule == "poly":
        return floor + (1.0 - floor) * (1.0 - progress) ** power
    raise ValueError(f"scheduler.name must be cosine, linear, poly or constant, got {schedule!r}")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: Mapping[str, Any], total_steps: int, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step schedule from the ``scheduler`` config group.

    Args:
        optimizer: its current learning rate is the base rate.
        cfg: ``name`` (cosine | linear | poly | constant), ``warmup_epochs`` or ``warmup_steps``, ``warmup_lr``
            (absolute start of the warm-up; DeiT: 1e-6), ``min_lr`` (absolute floor; DeiT: 1e-5), ``power``.
        total_steps: optimiser steps of the run.
        steps_per_epoch: optimiser steps per epoch (converts ``warmup_epochs``).

    Returns:
        A LambdaLR to step once per optimiser step.
    """
    base = optimizer.param_groups[0]["lr"]
    warmup = cfg.get("warmup_steps")
    if warmup is None:
        warmup = round(float(cfg.get("warmup_epochs", 0) or 0) * steps_per_epoch)
    warmup = min(int(warmup), max(total_steps - 1, 0))
    start = float(cfg.get("warmup_lr", 0.0) or 0.0) / base if base > 0 else 0.0
    floor = float(cfg.get("min_lr", 0.0) or 0.0) / base if base > 0 else 0.0
    schedule, power = str(cfg.get("name", "cosine")), float(cfg.get("power", 1.0))
    lr_factor(0, total_steps, warmup, schedule, start, floor, power)

    def factor(step: int) -> float:
        return lr_factor(step, total_steps, warmup, schedule, start, floor, power)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
