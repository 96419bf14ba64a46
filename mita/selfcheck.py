"""Self-check: run every registered attention on the CPU and print a table.

For each attention: parameter count, output shape, whether the output is finite, whether the backward reaches
every parameter, and its agreement with a reference computed from the same weights in float64 by other code:
MiTA layers against the layer's projections, ``torch.nn.AdaptiveAvgPool2d`` landmarks and the dense rank-counting
formulation (``mita.ops.mita.dense_ref``); the layers that reduce to full attention in a degenerate setting
(``full``; ``topk`` with k = N; ``moba`` with every block selected) against plain softmax attention; Agent
attention against its published formula written out here; ReLU linear attention against its quadratic form.
Exits non-zero if any check fails; an attention with no reference shows "-" as its error and fails.

Usage: ``python -m mita.selfcheck [--dim 64] [--heads 4] [--grid 8] [--batch 2]``
"""

from __future__ import annotations

import argparse
import sys

import torch

from mita.layers.base import AttentionBase
from mita.registry import create_attention, list_attentions

# Per-attention options for a small 8 x 8 grid (N = 65 with CLS).
SMALL_OPTIONS: dict[str, dict] = {
    "mita": dict(m=16, k=16),
    "mita_routing": dict(m=16, k=32),
    "agent": dict(agent_num=16),
    "agent_minus": dict(agent_num=16),
    "moba": dict(window_size=4, topk_blocks=2),
    "topk": dict(k=16),
}


def full_attention_reference(layer: AttentionBase, x: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention with ``layer``'s own qkv and output projections (float64)."""
    layer64 = _clone64(layer)
    x = x.double()
    B, N, C = x.shape
    q, k, v = layer64.split_qkv(x)[:3]
    p = torch.softmax((q @ k.transpose(-1, -2)) * layer64.scale, dim=-1)
    return layer64.proj(layer64.merge_heads(p @ v))


def _clone64(layer: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(layer).double()


def _adaptive_pool_grid(q: torch.Tensor, start: int, grid: tuple[int, int], bins: tuple[int, int]) -> torch.Tensor:
    """``torch.nn.AdaptiveAvgPool2d`` of the h x w tokens of q [B, H, N, d] from ``start`` into ph x pw bins ->
    [B, H, ph * pw, d] (row-major bins)."""
    B, H, _, d = q.shape
    (h, w), (ph, pw) = grid, bins
    maps = q[:, :, start : start + h * w].reshape(B * H, h, w, d).permute(0, 3, 1, 2)
    return torch.nn.AdaptiveAvgPool2d((ph, pw))(maps).permute(0, 2, 3, 1).reshape(B, H, ph * pw, d)


def mita_layer_reference(layer: AttentionBase, x: torch.Tensor) -> torch.Tensor:
    """A MiTA layer's output from its own projections, adaptive-average-pooled landmarks and the dense formulation
    (float64); no code of the layer's forward, the pooling or the operator is shared."""
    from mita.ops.landmarks import landmark_grid
    from mita.ops.mita.dense_ref import dense_mita

    L = _clone64(layer)
    if L.dwc is not None or L.gate_proj is not None or L.landmark_layout == "1d":
        raise ValueError("mita_layer_reference: 2D landmarks without dwc or gate only")
    q, k, v = L.split_qkv(x.double())[:3]
    start = 0 if L.landmark_layout == "official" else L.num_prefix_tokens  # "official": the first h*w tokens
    R = _adaptive_pool_grid(q, start, L.grid_size, landmark_grid(L.m))
    o = dense_mita(
        q,
        k,
        v,
        R,
        L.topk,
        experts_per_query=L.experts_per_query,
        shared=not L.routing_only,
        shared_scale=L.shared_scale,
        scale=L.scale,
    )
    return L.output(L.merge_heads(o))


def agent_reference(layer: AttentionBase, x: torch.Tensor) -> tuple[torch.Tensor, AttentionBase]:
    """Agent attention (Han et al. 2024) written out: agents A = adaptive-average-pooled patch queries,
    O = softmax(Q A^T s) softmax(A K^T s) V, plus the depth-wise conv of the value map on the patches (``agent``).
    Returns (reference, the layer in float64 with its agent biases zeroed): the formula has no position biases.
    """
    import math

    L = _clone64(layer)
    if L.agent_bias:
        with torch.no_grad():
            for prm in (L.an_bias, L.na_bias, L.ac_bias, L.ca_bias):
                prm.zero_()
    q, k, v = L.split_qkv(x.double())[:3]
    B = q.shape[0]
    (h, w), p = L.grid_size, L.num_prefix_tokens
    side = math.isqrt(L.agent_num)
    agents = _adaptive_pool_grid(q, p, (h, w), (side, side))
    agent_v = torch.softmax(agents @ k.transpose(-1, -2) * L.scale, dim=-1) @ v
    o = L.merge_heads(torch.softmax(q @ agents.transpose(-1, -2) * L.scale, dim=-1) @ agent_v)
    if L.dwc is not None:
        v_map = L.merge_heads(v)[:, p:].transpose(1, 2).reshape(B, -1, h, w)
        o = torch.cat([o[:, :p], o[:, p:] + L.dwc(v_map).flatten(2).transpose(1, 2)], dim=1)
    return L.output(o), L


def linear_reference(layer: AttentionBase, x: torch.Tensor) -> torch.Tensor:
    """ReLU linear attention as the quadratic form: weights relu(q_i) . relu(k_j), each row divided by its sum
    plus eps (float64, N x N), from the layer's projections."""
    L = _clone64(layer)
    q, k, v = L.split_qkv(x.double())[:3]
    weights = torch.relu(q) @ torch.relu(k).transpose(-1, -2)
    o = (weights @ v) / (weights.sum(dim=-1, keepdim=True) + L.eps)
    return L.output(L.merge_heads(o))


def _reference(name: str, layer: AttentionBase, x: torch.Tensor, n_tokens: int):
    """(description, reference output) for layers with an exact reference, else (reason, None)."""
    if name in ("mita", "mita_routing"):
        return "pooled landmarks + dense MiTA (fp64)", mita_layer_reference(layer, x)
    if name == "full":
        return "softmax attention", full_attention_reference(layer, x)
    if name == "topk":
        dense = _clone64(layer)
        dense.topk = n_tokens
        return "k = N vs softmax attention", full_attention_reference(layer, x), dense
    if name == "moba":
        dense = _clone64(layer)
        dense.topk_blocks = 10**6
        return "all blocks vs softmax attention", full_attention_reference(layer, x), dense
    if name in ("agent", "agent_minus"):
        ref, zero_bias = agent_reference(layer, x)
        return "agent biases 0 vs the formula (fp64)", ref, zero_bias
    if name == "linear":
        return "N x N ReLU kernel form (fp64)", linear_reference(layer, x)
    return "no reference", None


def check_attention(name: str, dim: int, heads: int, grid: int, batch: int, seed: int = 0) -> dict:
    """Run one attention through forward, backward and its reference check; return a table row."""
    torch.manual_seed(seed)
    layer = create_attention(name, dim, heads, qkv_bias=True, **SMALL_OPTIONS.get(name, {}))
    layer.grid_size = (grid, grid)
    layer.num_prefix_tokens = 1
    n_tokens = 1 + grid * grid
    x = torch.randn(batch, n_tokens, dim)
    out = layer(x)
    out.square().mean().backward()
    no_grad = [n for n, p in layer.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    row = dict(
        attention=name,
        params=sum(p.numel() for p in layer.parameters()),
        shape=tuple(out.shape),
        finite=bool(torch.isfinite(out).all()),
        grads=not no_grad,
    )
    with torch.no_grad():
        ref = _reference(name, layer, x, n_tokens)
        if ref[1] is None:
            row.update(reference=ref[0], max_err=None)
        else:
            checked = ref[2](x.double()) if len(ref) == 3 else out.double()
            row.update(reference=ref[0], max_err=(checked - ref[1]).abs().max().item())
    row["ok"] = row["finite"] and row["grads"] and row["shape"] == (batch, n_tokens, dim)
    row["ok"] = row["ok"] and row["max_err"] is not None and row["max_err"] < 1e-4
    return row


def format_table(rows: list[dict]) -> str:
    """Markdown table of the rows."""
    head = "| attention | params | output shape | finite | grads | reference | max abs err | ok |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        err = "-" if r["max_err"] is None else f"{r['max_err']:.1e}"
        lines.append(
            f"| {r['attention']} | {r['params']:,} | {list(r['shape'])} | {r['finite']} | {r['grads']} | "
            f"{r['reference']} | {err} | {'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--grid", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    rows = [check_attention(n, args.dim, args.heads, args.grid, args.batch) for n in list_attentions()]
    print(
        f"Attention self-check on CPU: B={args.batch}, N={1 + args.grid**2} (CLS + {args.grid}x{args.grid}), "
        f"C={args.dim}, H={args.heads}, torch {torch.__version__}"
    )
    print(format_table(rows))
    failed = [r["attention"] for r in rows if not r["ok"]]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    print(f"all {len(rows)} attentions passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
