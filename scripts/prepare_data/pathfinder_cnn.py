"""Learnability check of a Pathfinder set: train a small CNN on it and report validation accuracy over time.

A convolutional network solves Pathfinder-32 far more easily than a 2-layer Transformer, so a CNN that stays at
chance points at the data (generator or loader), and one that learns it clears them: the images carry the label.
Reads the set through ``tasks.lra.data.PathfinderDataModule`` (the loader the experiments use, same seeded split)
and never touches the test split.

    python scripts/prepare_data/pathfinder_cnn.py --root data/lra_release/pathfinder32 --seconds 180

Prints one line per evaluation (step, seconds, train loss, val accuracy) and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tasks.lra.data import PathfinderDataModule  # noqa: E402


def make_cnn(width: int = 64, depth: int = 8) -> nn.Sequential:
    """3x3 convolutions with growing dilation (the receptive field spans the 32 x 32 image), then global pooling."""
    layers: list[nn.Module] = [nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
    for i in range(depth - 1):
        dil = 2 ** (i % 4)
        layers += [nn.Conv2d(width, width, 3, padding=dil, dilation=dil), nn.BatchNorm2d(width), nn.ReLU()]
    layers += [nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(width, 2)]
    return nn.Sequential(*layers)


def images(split, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Tokens are pixel + 1 (0 is padding); back to [0, 1] grey levels.
    x = (split.tokens.to(device=device, dtype=torch.float32) - 1.0) / 255.0
    y = torch.as_tensor(split.labels, device=device, dtype=torch.long)
    return x.view(-1, 1, 32, 32), y


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 2048) -> float:
    model.eval()
    hits = sum((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum().item() for i in range(0, len(y), batch))
    model.train()
    return hits / len(y)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, type=Path, help="the release's pathfinder32 folder")
    ap.add_argument("--difficulty", default="curv_contour_length_14")
    ap.add_argument("--seconds", type=float, default=180.0, help="training time budget")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=500, help="steps between validation passes")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    parts = PathfinderDataModule(str(args.root), difficulty=args.difficulty, seed=0, zero_is_padding=False).load()
    xtr, ytr = images(parts["train"], device)
    xva, yva = images(parts["val"], device)
    model = make_cnn().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    t0, step, best, history = time.time(), 0, 0.0, []
    while time.time() - t0 < args.seconds:
        idx = torch.randint(0, len(ytr), (args.batch,), device=device)
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % args.eval_every == 0:
            acc = accuracy(model, xva, yva)
            best = max(best, acc)
            history.append((step, round(time.time() - t0, 1), round(loss.item(), 4), round(acc, 4)))
            print(f"step {step} {history[-1][1]} s loss {history[-1][2]} val_acc {acc:.4f}", flush=True)
    print(
        json.dumps(
            {
                "difficulty": args.difficulty,
                "train": len(ytr),
                "val": len(yva),
                "steps": step,
                "best_val_acc": best,
                "history": history,
            }
        )
    )


if __name__ == "__main__":
    main()
