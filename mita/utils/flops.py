"""Multiply-accumulate (MAC) counter over every matmul of a forward pass, routing and pooling included.

Counting rules:
- Every matmul-like aten op executed (``mm``, ``addmm``, ``bmm``, ``baddbmm``, convolutions, SDPA kernels) is
  counted from its shapes (one MAC per multiply-add; PyTorch's FLOP formulas count 2 per MAC).
- Attention layers with a registered *cost formula* (MiTA and routing-only MiTA) are counted by the operator's
  cost model instead of by their implementation, because implementations differ (the reference code computes
  ``R k^T`` twice; a fused kernel computes it once) and the paper's FLOPs follow the cost model
  (``docs``: ``mita-operator.md``, "Cost"). Their projections (``qkv``, ``proj``, the Gate's extra quarter of
  ``qkv``) and DWC convolutions are still counted from the executed ``nn.Linear`` / ``nn.Conv`` modules.
- Element-wise work (softmax, norms, activations, top-k selection) is not counted, as in the paper's numbers.

The counts per image this gives for DeiT at 224 x 224 (N = 197): DeiT-S full 4.60 G, MiTA-DeiT-S (m = k = 25)
4.42 G, MiTA-DeiT-T 1.17 G, the values the paper reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# layer, tokens per sequence (valid ones), batch -> MACs of the attention core (projections excluded).
CostFormula = Callable[[nn.Module, torch.Tensor, int], int]
_COST_FORMULAS: dict[str, CostFormula] = {}

# Modules whose matmuls are always counted, also inside an attention counted by formula.
_COUNTED_CHILDREN = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def register_cost_formula(name: str) -> Callable[[CostFormula], CostFormula]:
    """Decorator: count the core of the attention registered as ``name`` with a formula.

    The formula gets ``(layer, n_valid, batch)`` with ``n_valid`` a [B] int tensor of valid tokens per sequence
    and returns the MACs of everything in the layer that is not an ``nn.Linear`` / ``nn.Conv`` child.
    """

    def wrap(fn: CostFormula) -> CostFormula:
        _COST_FORMULAS[name] = fn
        return fn

    return wrap


def mita_core_macs(n: int, dim: int, m: int, k: int, experts_per_query: int = 1, routing_only: bool = False) -> int:
    """MACs of one MiTA attention core on one sequence, all heads together (width ``dim = H * d``).

    Per head (``mita-operator.md``, "Cost"): pooling the landmarks N d; ``R k^T`` for the top-k m N d; landmark
    values (scores and weighted sum) 2 m N d; routing scores m N d; the final attention 2 N (m + S k) d. The
    routing-only ablation has no shared expert: no landmark values and no shared entries.

    Args:
        n: valid tokens of the sequence.
        dim: model width C (all heads together).
        m: landmarks.
        k: keys per routed expert (capped at n).
        experts_per_query: S.
        routing_only: drop the shared expert.

    Returns:
        MACs (int).
    """
    k = min(k, n)
    pool = n * dim
    topk_scores = m * n * dim
    routing = m * n * dim
    if routing_only:
        return pool + topk_scores + routing + 2 * n * experts_per_query * k * dim
    landmark_values = 2 * m * n * dim
    final = 2 * n * (m + experts_per_query * k) * dim
    return pool + topk_scores + landmark_values + routing + final


def _landmark_count(m: Any) -> int:
    if isinstance(m, (tuple, list)):
        return int(m[0]) * int(m[1])
    return int(m)


@register_cost_formula("mita")
@register_cost_formula("mita_routing")
def _mita_cost(layer: nn.Module, n_valid: torch.Tensor, batch: int) -> int:
    m = _landmark_count(layer.m)
    s = int(getattr(layer, "experts_per_query", 1))
    routing_only = bool(getattr(layer, "routing_only", False))
    return sum(mita_core_macs(int(n), layer.dim, m, int(layer.topk), s, routing_only) for n in n_valid.tolist())


def _shape(x: Any) -> tuple[int, ...] | None:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else None


def _sdpa_cpu_macs(args: tuple, kwargs: dict) -> int:
    q, k, v = args[:3]
    b, h, n, d = q.shape
    m, dv = k.shape[-2], v.shape[-1]
    return b * h * n * m * (d + dv)


# SDPA kernels that have no formula in torch.utils.flop_counter (CPU flash kernel, math fallback pieces).
_EXTRA_OPS: dict[Any, Callable[[tuple, dict], int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_macs,
}


@dataclass
class MacCount:
    """Result of :func:`count_macs`.

    Attributes:
        total: MACs of the forward pass over the whole batch.
        by_module: MACs attributed to the outermost named module kinds (``"attention"`` cores, ``"other"``).
        batch: batch size of the counted input.
    """

    total: int = 0
    by_module: dict[str, int] = field(default_factory=dict)
    batch: int = 1

    @property
    def per_sample(self) -> float:
        """MACs per sample."""
        return self.total / max(self.batch, 1)


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by_kind: dict[str, int] = {}
        # Module stack entries: (is_formula_attention, is_counted_child).
        self.stack: list[tuple[bool, bool]] = []

    def counting(self) -> bool:
        inside_formula = any(f for f, _ in self.stack)
        return not inside_formula or (bool(self.stack) and self.stack[-1][1])

    def add(self, kind: str, macs: int) -> None:
        self.total += macs
        self.by_kind[kind] = self.by_kind.get(kind, 0) + macs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.counting():
            return out
        packet = func._overloadpacket
        if func in _EXTRA_OPS:
            self.add("matmul", _EXTRA_OPS[func](args, kwargs))
        elif packet in _EXTRA_OPS:
            self.add("matmul", _EXTRA_OPS[packet](args, kwargs))
        elif packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            self.add("matmul", int(flops) // 2)
        return out


def _attention_name(module: nn.Module) -> str | None:
    return getattr(type(module), "attention_name", None)


def count_macs(model: nn.Module, *inputs: Any, **kwargs: Any) -> MacCount:
    """Count the multiply-accumulates of ``model(*inputs, **kwargs)`` (forward, no gradients).

    Args:
        model: any module; attention layers registered in :mod:`mita.registry` with a cost formula are counted
            by formula (see the module docstring), everything else by the matmuls it executes.
        *inputs, **kwargs: the forward arguments, e.g. one image ``[1, 3, 224, 224]``.

    Returns:
        :class:`MacCount` (``total`` over the batch; ``per_sample``).
    """
    counter = _Counter()
    handles = []

    def pre_hook(module: nn.Module, args: tuple, kw: dict) -> None:
        name = _attention_name(module)
        formula = _COST_FORMULAS.get(name) if name else None
        if formula is not None and not any(f for f, _ in counter.stack):
            x = args[0] if args else kw["x"]
            batch, n = x.shape[0], x.shape[1]
            mask = kw.get("key_padding_mask", args[1] if len(args) > 1 else None)
            n_valid = (~mask).sum(-1) if mask is not None else torch.full((batch,), n)
            counter.add(f"attention:{name}", formula(module, n_valid, batch))
        counter.stack.append((formula is not None, isinstance(module, _COUNTED_CHILDREN)))

    def post_hook(module: nn.Module, args: tuple, kw: dict, out: Any) -> None:
        counter.stack.pop()

    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), counter:
            model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    batch = next((int(t.shape[0]) for t in inputs if isinstance(t, torch.Tensor)), 1)
    return MacCount(total=counter.total, by_module=dict(counter.by_kind), batch=batch)


def count_params(model: nn.Module) -> int:
    """Number of parameters (trainable or not; shared tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def model_gmacs(model: nn.Module, input_size: tuple[int, ...] = (3, 224, 224)) -> float:
    """GMACs per sample of an image model on one ``[1, *input_size]`` input.

    A model built under ``torch.device("meta")`` is counted without computing anything (fast; the counts need
    shapes only), otherwise one random input runs on the model's device.
    """
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    x = (
        torch.empty(1, *input_size, device=device)
        if device.type == "meta"
        else torch.randn(1, *input_size, device=device)
    )
    return count_macs(model, x).per_sample / 1e9
