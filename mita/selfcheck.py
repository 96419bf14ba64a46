"""Self-check: run every registered attention on the CPU and print a table.

For each attention: parameter count, output shape, whether the output is finite, whether the backward reaches
every parameter, and its agreement with a reference computed from the same weights:
MiTA layers against ``naive_mita`` (fp32 reference), and the layers that reduce to full attention in a
degenerate setting (``full``; ``topk`` with k = N; ``moba`` with every block selected) against plain softmax
attention. Exits non-zero if any check fails.

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


def _reference(name: str, layer: AttentionBase, x: torch.Tensor, n_tokens: int):
    """(description, reference output) for layers with an exact reference, else (reason, None)."""
    if name in ("mita", "mita_routing"):
        ref_layer = _clone64(layer)
        ref_layer.backend = "naive"
        return "naive_mita (fp64)", ref_layer(x.double())
    if name == "full":
        return "softmax attention", full_attention_reference(layer, x)
    if name == "topk":
        dense = _clone64(layer)
        dense.k = n_tokens
        return "k = N vs softmax attention", full_attention_reference(layer, x), dense
    if name == "moba":
        dense = _clone64(layer)
        dense.topk_blocks = 10**6
        return "all blocks vs softmax attention", full_attention_reference(layer, x), dense
    return "no exact reference", None


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
    if row["max_err"] is not None:
        row["ok"] = row["ok"] and row["max_err"] < 1e-4
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
