"""ImageNet-1K data: the ImageFolder release or a local Hugging Face parquet copy, with DeiT's augmentation.

ImageFolder layout: ``ROOT/train/<wnid>/*.JPEG`` and ``ROOT/val/<wnid>/*.JPEG``; labels follow the sorted wnids.
Parquet layout (``imagenet-1k`` on the Hugging Face hub, copied to local disk): ``ROOT/data/train-*.parquet`` and
``ROOT/data/validation-*.parquet`` with columns ``image`` (``{"bytes", "path"}``) and ``label``.
"""

from __future__ import annotations

import glob
import io
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler
from torchvision.datasets import ImageFolder


class ParquetImageDataset(Dataset):
    """Images and labels from local parquet files (the Hugging Face ``datasets`` image format).

    Args:
        files: parquet files, read in sorted order.
        transform: applied to each RGB PIL image.
        image_column, label_column: column names.
    """

    def __init__(
        self,
        files: Sequence[str],
        transform: Callable | None = None,
        image_column: str = "image",
        label_column: str = "label",
    ) -> None:
        import pyarrow.parquet as pq

        if not files:
            raise ValueError("data: no parquet files matched")
        self.files = sorted(files)
        self.transform = transform
        self.image_column, self.label_column = image_column, label_column
        # Memory-mapped reads keep the (large) image bytes on disk until an item is decoded.
        tables = [pq.read_table(f, columns=[image_column, label_column], memory_map=True) for f in self.files]
        import pyarrow as pa

        self.table = pa.concat_tables(tables)
        self.labels = self.table.column(label_column).to_pylist()
        self.classes = sorted(set(self.labels))

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index: int) -> tuple[Any, int]:
        cell = self.table.column(self.image_column)[index].as_py()
        data = cell["bytes"] if isinstance(cell, dict) else cell
        image = Image.open(io.BytesIO(data)).convert("RGB")
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])


def three_augment_transform(
    img_size: int,
    scale: Sequence[float] = (0.08, 1.0),
    color_jitter: float = 0.3,
    interpolation: str = "bicubic",
    mean: Sequence[float] = IMAGENET_DEFAULT_MEAN,
    std: Sequence[float] = IMAGENET_DEFAULT_STD,
) -> Callable:
    """DeiT III's 3-Augment (the ViT-5 recipe): random resized crop, flip, then one of grayscale / solarisation /
    Gaussian blur, colour jitter, normalisation.

    Args:
        img_size: output side.
        scale: crop area range.
        color_jitter: brightness / contrast / saturation strength (0 disables).
        interpolation: resize interpolation.
        mean, std: normalisation.

    Returns:
        A callable PIL image -> [3, img_size, img_size] tensor.
    """
    from torchvision import transforms as T

    mode = T.InterpolationMode(interpolation)
    steps = [
        T.RandomResizedCrop(img_size, scale=tuple(scale), interpolation=mode),
        T.RandomHorizontalFlip(),
        T.RandomChoice([T.Grayscale(num_output_channels=3), T.RandomSolarize(128, p=1.0), T.GaussianBlur(5)]),
    ]
    if color_jitter:
        steps.append(T.ColorJitter(color_jitter, color_jitter, color_jitter))
    steps += [T.ToTensor(), T.Normalize(tuple(mean), tuple(std))]
    return T.Compose(steps)


class ImageNetDataModule(L.LightningDataModule):
    """ImageNet-1K train/val loaders with the DeiT (or another timm) augmentation recipe.

    Samplers are built here (Lightning's automatic distributed sampler is switched off through
    ``handles_distributed_sampling``) so repeated augmentation works under DDP: each of the ``num_repeats``
    augmented copies of an image goes to a different process.

    Args:
        root: data set root (see the module docstring).
        format: ``"imagefolder"`` or ``"parquet"``.
        num_classes: classes (1000).
        img_size: training and evaluation resolution.
        batch_size: per process.
        num_workers: loader workers per process.
        train_split, val_split: ImageFolder subfolders, or parquet globs relative to ``root``.
        augmentation: ``"deit"`` (timm's RandAugment pipeline below) or ``"three_augment"`` (DeiT III / ViT-5:
            :func:`three_augment_transform`; auto_augment, reprob and hflip do not apply).
        auto_augment: timm auto-augment string (DeiT: ``"rand-m9-mstd0.5-inc1"``), or None.
        color_jitter: colour-jitter strength (DeiT passes 0.3; timm ignores it when auto_augment is set).
        reprob, remode, recount: random erasing probability, mode and count (DeiT: 0.25, "pixel", 1).
        interpolation: resize interpolation (``"bicubic"``).
        scale, ratio: RandomResizedCrop ranges.
        hflip: horizontal flip probability.
        crop_pct: evaluation centre-crop ratio (DeiT: 0.875).
        mean, std: normalisation.
        repeated_aug: repeated augmentation sampler (DeiT: on, 3 repeats).
        num_repeats: copies per image with repeated augmentation.
        pin_memory, persistent_workers: DataLoader options.
        limit_train_samples: use only the first N training images (debugging).
    """

    handles_distributed_sampling = True

    def __init__(
        self,
        root: str,
        format: str = "imagefolder",
        num_classes: int = 1000,
        img_size: int = 224,
        batch_size: int = 128,
        num_workers: int = 8,
        train_split: str = "train",
        val_split: str = "val",
        augmentation: str = "deit",
        auto_augment: str | None = "rand-m9-mstd0.5-inc1",
        color_jitter: float = 0.3,
        reprob: float = 0.25,
        remode: str = "pixel",
        recount: int = 1,
        interpolation: str = "bicubic",
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0),
        hflip: float = 0.5,
        crop_pct: float = 0.875,
        mean: Sequence[float] = IMAGENET_DEFAULT_MEAN,
        std: Sequence[float] = IMAGENET_DEFAULT_STD,
        repeated_aug: bool = True,
        num_repeats: int = 3,
        pin_memory: bool = True,
        persistent_workers: bool = False,
        limit_train_samples: int | None = None,
    ) -> None:
        super().__init__()
        if format not in ("imagefolder", "parquet"):
            raise ValueError(f"data.format must be 'imagefolder' or 'parquet', got {format!r}")
        self.root = Path(root)
        self.format = format
        self.num_classes = num_classes
        self.img_size = img_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_split, self.val_split = train_split, val_split
        if augmentation not in ("deit", "three_augment"):
            raise ValueError(f"data.augmentation must be 'deit' or 'three_augment', got {augmentation!r}")
        self.train_transform = create_transform(
            img_size,
            is_training=True,
            auto_augment=auto_augment,
            color_jitter=color_jitter,
            re_prob=reprob,
            re_mode=remode,
            re_count=recount,
            interpolation=interpolation,
            scale=tuple(scale),
            ratio=tuple(ratio),
            hflip=hflip,
            mean=tuple(mean),
            std=tuple(std),
        )
        if augmentation == "three_augment":
            self.train_transform = three_augment_transform(img_size, scale, color_jitter, interpolation, mean, std)
        self.eval_transform = create_transform(
            img_size,
            is_training=False,
            interpolation=interpolation,
            crop_pct=crop_pct,
            mean=tuple(mean),
            std=tuple(std),
        )
        self.repeated_aug = repeated_aug
        self.num_repeats = num_repeats
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.limit_train_samples = limit_train_samples
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def example_input(self) -> dict[str, torch.Tensor]:
        """One input batch of the right shape (for the pre-flight check of the model)."""
        return {"x": torch.zeros(1, 3, self.img_size, self.img_size)}

    def _dataset(self, split: str, transform: Callable) -> Dataset:
        if self.format == "imagefolder":
            path = self.root / split
            if not path.is_dir():
                raise ValueError(f"data.root: no folder {path} (expected ROOT/{split}/<wnid>/*.JPEG)")
            ds = ImageFolder(str(path), transform=transform)
        else:
            files = glob.glob(str(self.root / split))
            if not files:
                raise ValueError(f"data.root: no parquet files match {self.root / split}")
            ds = ParquetImageDataset(files, transform=transform)
        if len(ds.classes) > self.num_classes:
            raise ValueError(f"data.num_classes={self.num_classes} but {split} has {len(ds.classes)} classes")
        return ds

    def setup(self, stage: str | None = None) -> None:
        if stage in ("fit", None) and self.train_set is None:
            ds = self._dataset(self.train_split, self.train_transform)
            if self.limit_train_samples:
                ds = torch.utils.data.Subset(ds, range(min(len(ds), int(self.limit_train_samples))))
            self.train_set = ds
        if self.val_set is None:
            self.val_set = self._dataset(self.val_split, self.eval_transform)

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return trainer.world_size, trainer.global_rank

    def train_dataloader(self) -> DataLoader:
        world, rank = self._world()
        if self.repeated_aug:
            sampler = RepeatAugSampler(self.train_set, num_replicas=world, rank=rank, num_repeats=self.num_repeats)
        elif world > 1:
            sampler = DistributedSampler(self.train_set, num_replicas=world, rank=rank, shuffle=True)
        else:
            sampler = RandomSampler(self.train_set)
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            drop_last=True,
            persistent_workers=self.persistent_workers,
        )

    def val_dataloader(self) -> DataLoader:
        world, rank = self._world()
        if world > 1:
            # Pads the last shard with repeated images (as DeiT does); exact numbers come from one process.
            sampler = DistributedSampler(self.val_set, num_replicas=world, rank=rank, shuffle=False)
        else:
            sampler = SequentialSampler(self.val_set)
        return DataLoader(
            self.val_set,
            batch_size=int(math.ceil(self.batch_size * 1.5)),
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            drop_last=False,
            persistent_workers=self.persistent_workers,
        )
