"""Generated shape images: a small classification task that needs no download.

Each image (3 x size x size, noisy background) holds one of four shapes at a random position and colour: a
filled square, a hollow square, a plus and a diagonal cross. The shape spans several patches, so a ViT has to
combine patches to tell the classes apart (a hollow and a filled square share their border patches). A few
random distractor pixels make the task less trivial. Generated in memory from a seed: identical on every run.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

CLASSES = ("filled_square", "hollow_square", "plus", "cross")


def make_shapes(n: int, size: int = 32, shape_size: int = 9, noise: float = 0.35, seed: int = 0):
    """Generate ``n`` images and labels.

    Args:
        n: samples.
        size: image side.
        shape_size: side of the shape's bounding box (odd).
        noise: standard deviation of the Gaussian background noise.
        seed: random seed.

    Returns:
        (images [n, 3, size, size] float32, labels [n] int64).
    """
    g = torch.Generator().manual_seed(seed)
    s = shape_size
    c = s // 2
    yy, xx = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    masks = torch.stack(
        [
            torch.ones(s, s, dtype=torch.bool),
            (yy == 0) | (yy == s - 1) | (xx == 0) | (xx == s - 1),
            (yy == c) | (xx == c),
            (yy == xx) | (yy == s - 1 - xx),
        ]
    ).float()
    labels = torch.randint(0, len(CLASSES), (n,), generator=g)
    images = noise * torch.randn(n, 3, size, size, generator=g)
    colours = 0.6 + 0.8 * torch.rand(n, 3, generator=g)
    ys = torch.randint(0, size - s + 1, (n,), generator=g)
    xs = torch.randint(0, size - s + 1, (n,), generator=g)
    # Distractors: bright isolated pixels anywhere in the image.
    spots = torch.rand(n, 1, size, size, generator=g) < 0.01
    images = images + spots.float() * colours[:, :, None, None]
    for i in range(n):
        y, x = int(ys[i]), int(xs[i])
        images[i, :, y : y + s, x : x + s] += masks[labels[i]] * colours[i, :, None, None]
    return images, labels


class SyntheticShapesDataModule(L.LightningDataModule):
    """Train / val / test splits of :func:`make_shapes` (different seeds, so no image is shared).

    Args:
        num_train, num_val, num_test: split sizes.
        img_size: image side.
        batch_size: per process.
        num_workers: loader workers.
        seed: base seed of the generator.
        num_classes: 4 (fixed by the generator; a config value so the model can interpolate it).
    """

    handles_distributed_sampling = False

    def __init__(
        self,
        num_train: int = 4096,
        num_val: int = 1024,
        num_test: int = 1024,
        img_size: int = 32,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 1234,
        num_classes: int = len(CLASSES),
    ) -> None:
        super().__init__()
        if num_classes != len(CLASSES):
            raise ValueError(f"data.num_classes must be {len(CLASSES)} for the shapes task, got {num_classes}")
        self.num_classes = num_classes
        self.sizes = {"train": num_train, "val": num_val, "test": num_test}
        self.img_size = img_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.sets: dict[str, TensorDataset] = {}

    def example_input(self) -> dict[str, torch.Tensor]:
        """One input batch of the right shape (for the pre-flight check of the model)."""
        return {"x": torch.zeros(1, 3, self.img_size, self.img_size)}

    def setup(self, stage: str | None = None) -> None:
        for offset, split in enumerate(("train", "val", "test")):
            if split not in self.sets:
                x, y = make_shapes(self.sizes[split], self.img_size, seed=self.seed + 1000 * offset)
                self.sets[split] = TensorDataset(x, y)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        return DataLoader(
            self.sets[split],
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            drop_last=shuffle,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)


__all__ = ["CLASSES", "SyntheticShapesDataModule", "make_shapes"]
