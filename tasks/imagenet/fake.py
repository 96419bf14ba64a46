"""Tiny data sets in ImageNet's on-disk formats, for tests and ``reproduce.sh --smoke`` (no real images)."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
from PIL import Image


def _image(rng: np.random.Generator, label: int, size: tuple[int, int]) -> Image.Image:
    # A class-dependent tint plus noise, so a model can fit the labels.
    base = np.array([(label * 80) % 256, (label * 150) % 256, (label * 40 + 60) % 256], dtype=np.float32)
    pixels = base + rng.normal(0, 30, size=(size[0], size[1], 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_fake_imagefolder(
    root: str | Path, num_classes: int = 3, per_class: int = 4, size: tuple[int, int] = (40, 48), seed: int = 0
) -> Path:
    """Write ``root/{train,val}/n0000000<c>/<i>.JPEG`` (ImageNet's ImageFolder layout).

    Args:
        root: output folder.
        num_classes: classes (wnid-style names ``n00000000``, ``n00000001``, ...).
        per_class: images per class and split.
        size: image (height, width); images are not square, as in ImageNet.
        seed: random seed.

    Returns:
        ``root``.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        for c in range(num_classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                _image(rng, c, size).save(folder / f"{split}_{c}_{i}.JPEG", quality=90)
    return root


def write_fake_parquet(
    root: str | Path, num_classes: int = 3, per_class: int = 4, size: tuple[int, int] = (40, 48), seed: int = 0
) -> Path:
    """Write ``root/data/{train,validation}-00000-of-00001.parquet`` in the Hugging Face image format.

    Args:
        root: output folder.
        num_classes, per_class, size, seed: as :func:`write_fake_imagefolder`.

    Returns:
        ``root``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    (root / "data").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split in ("train", "validation"):
        images, labels = [], []
        for c in range(num_classes):
            for i in range(per_class):
                buf = io.BytesIO()
                _image(rng, c, size).save(buf, format="JPEG", quality=90)
                images.append({"bytes": buf.getvalue(), "path": f"{split}_{c}_{i}.JPEG"})
                labels.append(c)
        table = pa.table({"image": images, "label": pa.array(labels, type=pa.int64())})
        pq.write_table(table, root / "data" / f"{split}-00000-of-00001.parquet")
    return root


def write_fake_weights(path: str | Path, experiment: str, num_classes: int = 3) -> Path:
    """A full-attention state dict shaped like ``experiment``'s smoke-run network (``debug=smoke``), to stand in
    for the pretrained weights that rows with ``requires_init_weights`` start from."""
    import torch
    from hydra.utils import instantiate

    from tasks.common.config import compose

    cfg = compose([f"experiment={experiment}", "debug=smoke", f"data.num_classes={num_classes}", "attention=full"])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(instantiate(cfg.model).state_dict(), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root")
    parser.add_argument("--format", choices=["imagefolder", "parquet"], default="imagefolder")
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--per-class", type=int, default=4)
    parser.add_argument("--weights-for", metavar="EXPERIMENT", help="write smoke-sized weights for EXPERIMENT to root")
    args = parser.parse_args()
    if args.weights_for:
        print(write_fake_weights(args.root, args.weights_for, args.classes))
        return
    write = write_fake_imagefolder if args.format == "imagefolder" else write_fake_parquet
    print(write(args.root, args.classes, args.per_class))


if __name__ == "__main__":
    main()
