"""A tiny data set in the ADEChallengeData2016 release layout, for tests and ``reproduce.sh C --smoke``.

``python -m tasks.ade20k.fake ROOT`` writes ``ROOT/ADEChallengeData2016/{images,annotations}/{training,validation}``
and prints that folder; ``--weights-for EXPERIMENT`` writes a smoke-sized full-attention checkpoint instead, and
``--overrides`` prints the overrides of a smoke run on that folder (``reproduce.sh C --smoke``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

SPLIT_SIZES = {"training": 4, "validation": 2}


def _pair(rng: np.random.Generator, size: tuple[int, int], num_values: int) -> tuple[Image.Image, Image.Image]:
    # Rectangles of a few classes on "other" (0); pixel colours follow the class, so the labels can be learned.
    h, w = size
    label = np.zeros((h, w), dtype=np.uint8)
    for _ in range(4):
        value = int(rng.integers(1, num_values))
        top, left = int(rng.integers(0, h - 4)), int(rng.integers(0, w - 4))
        label[top : top + int(rng.integers(4, h)), left : left + int(rng.integers(4, w))] = value
    # The largest value always occurs once, so every file exercises the full 0..150 range.
    label[0, 0] = num_values - 1
    palette = rng.integers(0, 256, size=(num_values, 3)).astype(np.float32)
    pixels = palette[label] + rng.normal(0, 12, size=(h, w, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return image, Image.fromarray(label)


def write_fake_ade20k(
    root: str | Path, sizes: tuple[tuple[int, int], ...] = ((48, 64), (64, 40)), num_classes: int = 150, seed: int = 0
) -> Path:
    """Write ``root/ADEChallengeData2016`` with 4 training and 2 validation pairs (JPEG images, PNG labels with
    values 0..num_classes, 0 = other) of the given (height, width) sizes, alternating.

    Args:
        root: output folder.
        sizes: image sizes (height, width), used in turn; not square, as in ADE20K.
        num_classes: largest label value (150).
        seed: random seed.

    Returns:
        The ``ADEChallengeData2016`` folder (pass it as ``data.root``).
    """
    out = Path(root) / "ADEChallengeData2016"
    rng = np.random.default_rng(seed)
    for split, count in SPLIT_SIZES.items():
        (out / "images" / split).mkdir(parents=True, exist_ok=True)
        (out / "annotations" / split).mkdir(parents=True, exist_ok=True)
        prefix = "ADE_train" if split == "training" else "ADE_val"
        for i in range(count):
            image, label = _pair(rng, sizes[i % len(sizes)], num_classes + 1)
            name = f"{prefix}_{i + 1:08d}"
            image.save(out / "images" / split / f"{name}.jpg", quality=90)
            label.save(out / "annotations" / split / f"{name}.png")
    return out


# Overrides that shrink a Table C row for one CPU step: a 112 crop (a 7 x 7 patch grid, the smallest that holds
# MiTA's m = 49 landmarks) and validation images resized to a 112 shorter side (debug=smoke itself leaves one
# encoder block: model.depth=1).
SMOKE_OVERRIDES = ["data.crop_size=112", "data.scale=[448,112]"]


def write_fake_weights(path: str | Path, experiment: str) -> Path:
    """A full-attention ViT state dict shaped like the encoder of ``experiment``'s smoke-run network (keys
    ``encoder.blocks.0.attn.qkv.weight``, ...: a timm ViT state dict under the ``encoder.`` prefix), standing in
    for the ImageNet weights the Table C rows start from; the decoder is not in it, as in the real setting."""
    import torch
    from hydra.utils import instantiate

    from tasks.common.config import compose

    # The row's own network: MiTA adds no parameters, so its state dict is a full-attention one.
    cfg = compose([f"experiment={experiment}", "debug=smoke", *SMOKE_OVERRIDES])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({f"encoder.{k}": v for k, v in instantiate(cfg.model).encoder.state_dict().items()}, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root")
    parser.add_argument("--weights-for", metavar="EXPERIMENT", help="write smoke-sized weights for EXPERIMENT to root")
    parser.add_argument("--overrides", action="store_true", help="print the smoke overrides (with data.root=ROOT)")
    args = parser.parse_args()
    if args.overrides:
        print(" ".join([*SMOKE_OVERRIDES, f"data.root={Path(args.root) / 'ADEChallengeData2016'}"]))
        return
    if args.weights_for:
        print(write_fake_weights(args.root, args.weights_for))
        return
    print(write_fake_ade20k(args.root))


if __name__ == "__main__":
    main()
