"""ADE20K (SceneParsing, ADEChallengeData2016) with the Segmenter / mmseg training and test pipelines.

Release layout: ``ROOT/images/{training,validation}/*.jpg`` and ``ROOT/annotations/{training,validation}/*.png``
(20,210 / 2,000 pairs, matched by file stem). Annotation value 0 is "other" (ignored) and 1..150 are the classes;
labels are reduced to 0..149 with 0 -> 255 (the ignore index), as mmseg's ``reduce_zero_label``.

Training (mmseg's ADE20K pipeline that Segmenter uses): resize keeping the aspect ratio into ``scale`` (2048 x 512)
times a ratio drawn from ``ratio_range`` (0.5-2.0), random crop ``crop_size`` (re-drawn up to 10 times while one
class covers more than ``cat_max_ratio`` of the crop), horizontal flip, photometric distortion (brightness,
contrast, saturation, hue), normalisation, padding to the crop size (image 0 after normalisation, label 255).

Validation: the image resized keeping its ratio into ``scale`` (mmseg's test pipeline: the shorter side becomes 512
unless the longer one would pass 2048), the label at its ORIGINAL resolution; the module evaluates by sliding
window on the resized image and upsamples the logits to the label (as mmseg and Segmenter score at the original
size). Batch size 1, because images differ in size.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

IGNORE_INDEX = 255
SPLITS = {"train": "training", "val": "validation"}
EXPECTED = "expected ROOT/images/{training,validation}/*.jpg and ROOT/annotations/{training,validation}/*.png"


class ADE20KLayoutError(ValueError):
    """The root does not hold the ADEChallengeData2016 release layout."""


def check_layout(root: str | Path) -> None:
    """Raise :class:`ADE20KLayoutError` unless ``root`` has the four release folders."""
    root = Path(root)
    for kind in ("images", "annotations"):
        for split in SPLITS.values():
            if not (root / kind / split).is_dir():
                raise ADE20KLayoutError(f"data.root: {root} is not the ADEChallengeData2016 release ({EXPECTED})")


def find_pairs(root: str | Path, split: str) -> list[tuple[Path, Path]]:
    """(image, annotation) paths of one split, sorted by file stem.

    Args:
        root: the ``ADEChallengeData2016`` folder.
        split: ``"training"`` or ``"validation"``.

    Returns:
        The pairs.

    Raises:
        ADE20KLayoutError: a folder is missing, empty, or an image has no annotation.
    """
    root = Path(root)
    images_dir, labels_dir = root / "images" / split, root / "annotations" / split
    if not images_dir.is_dir() or not labels_dir.is_dir():
        raise ADE20KLayoutError(f"data.root: {root} is not the ADEChallengeData2016 release ({EXPECTED})")
    images = sorted(images_dir.glob("*.jpg"))
    if not images:
        raise ADE20KLayoutError(f"data.root: no images in {images_dir} ({EXPECTED})")
    pairs = []
    for image in images:
        label = labels_dir / f"{image.stem}.png"
        if not label.is_file():
            raise ADE20KLayoutError(f"data.root: {image.name} has no annotation {label}")
        pairs.append((image, label))
    return pairs


def reduce_zero_label(label: np.ndarray) -> np.ndarray:
    """Release annotation (0 = other, 1..150 = classes) -> training labels (255 = ignore, 0..149).

    Args:
        label: [H, W] uint8.

    Returns:
        [H, W] uint8.
    """
    out = label.astype(np.int64) - 1
    out[label == 0] = IGNORE_INDEX
    return out.astype(np.uint8)


def rescale_size(width: int, height: int, scale: Sequence[int]) -> tuple[int, int]:
    """(width, height) scaled by one factor so the longer side fits max(scale) and the shorter min(scale)
    (mmseg's ``Resize`` with ``keep_ratio=True``)."""
    long_edge, short_edge = max(scale), min(scale)
    factor = min(long_edge / max(width, height), short_edge / min(width, height))
    return max(1, int(width * factor + 0.5)), max(1, int(height * factor + 0.5))


def photometric_distortion(image: np.ndarray, rng: random.Random) -> np.ndarray:
    """mmseg's ``PhotoMetricDistortion``: each step with probability 1/2: brightness +-32, contrast x [0.5, 1.5]
    (before or after the colour steps), saturation x [0.5, 1.5], hue +-18 degrees.

    Args:
        image: [H, W, 3] float32 RGB in 0..255.
        rng: random source.

    Returns:
        [H, W, 3] float32 in 0..255.
    """

    def clip(x: np.ndarray) -> np.ndarray:
        return np.clip(x, 0, 255)

    if rng.random() < 0.5:
        image = clip(image + rng.uniform(-32, 32))
    contrast_first = rng.random() < 0.5
    if contrast_first and rng.random() < 0.5:
        image = clip(image * rng.uniform(0.5, 1.5))
    saturation = rng.uniform(0.5, 1.5) if rng.random() < 0.5 else None
    hue = rng.uniform(-18, 18) if rng.random() < 0.5 else None
    if saturation is not None or hue is not None:
        hsv = np.asarray(Image.fromarray(image.astype(np.uint8)).convert("HSV")).astype(np.float32)
        if saturation is not None:
            hsv[..., 1] = clip(hsv[..., 1] * saturation)
        if hue is not None:
            # PIL's hue runs over 0..255 for 360 degrees.
            hsv[..., 0] = np.mod(hsv[..., 0] + hue * 256.0 / 360.0, 256.0)
        image = np.asarray(Image.fromarray(hsv.astype(np.uint8), mode="HSV").convert("RGB")).astype(np.float32)
    if not contrast_first and rng.random() < 0.5:
        image = clip(image * rng.uniform(0.5, 1.5))
    return image


class SegmentationTrainTransform:
    """The training pipeline (module docstring) on a PIL image and its reduced label map.

    Args:
        crop_size: square crop side (512).
        scale: (long, short) target of the random resize (2048, 512).
        ratio_range: range of the resize ratio (0.5, 2.0).
        cat_max_ratio: largest fraction of the crop one class may cover (1.0 disables the check).
        hflip: horizontal flip probability.
        photometric: apply :func:`photometric_distortion`.
        mean, std: normalisation in 0..1 units.
    """

    def __init__(
        self,
        crop_size: int = 512,
        scale: Sequence[int] = (2048, 512),
        ratio_range: Sequence[float] = (0.5, 2.0),
        cat_max_ratio: float = 0.75,
        hflip: float = 0.5,
        photometric: bool = True,
        mean: Sequence[float] = (0.5, 0.5, 0.5),
        std: Sequence[float] = (0.5, 0.5, 0.5),
    ) -> None:
        self.crop_size = int(crop_size)
        self.scale = tuple(int(s) for s in scale)
        self.ratio_range = tuple(float(r) for r in ratio_range)
        self.cat_max_ratio = float(cat_max_ratio)
        self.hflip = float(hflip)
        self.photometric = photometric
        self.mean = np.asarray(mean, dtype=np.float32) * 255.0
        self.std = np.asarray(std, dtype=np.float32) * 255.0

    def _crop_box(self, label: np.ndarray, rng: random.Random) -> tuple[int, int, int, int]:
        h, w = label.shape
        size = self.crop_size
        box = (0, 0, h, w)
        for _ in range(10):
            top, left = rng.randint(0, max(h - size, 0)), rng.randint(0, max(w - size, 0))
            box = (top, left, min(top + size, h), min(left + size, w))
            if self.cat_max_ratio >= 1.0:
                break
            crop = label[box[0] : box[2], box[1] : box[3]]
            counts = np.bincount(crop[crop != IGNORE_INDEX].ravel(), minlength=1)
            counts = counts[counts > 0]
            if len(counts) > 1 and counts.max() / counts.sum() < self.cat_max_ratio:
                break
        return box

    def __call__(self, image: Image.Image, label: np.ndarray, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: image (PIL RGB), label [H, W] uint8 (reduced), rng. Returns: image [3, S, S] float32 and label
        [S, S] int64 with S = crop_size."""
        ratio = rng.uniform(*self.ratio_range)
        w, h = rescale_size(image.width, image.height, [s * ratio for s in self.scale])
        image = image.resize((w, h), Image.BILINEAR)
        label = np.asarray(Image.fromarray(label).resize((w, h), Image.NEAREST))
        top, left, bottom, right = self._crop_box(label, rng)
        pixels = np.asarray(image, dtype=np.float32)[top:bottom, left:right]
        label = label[top:bottom, left:right]
        if rng.random() < self.hflip:
            pixels, label = pixels[:, ::-1], label[:, ::-1]
        if self.photometric:
            pixels = photometric_distortion(np.ascontiguousarray(pixels), rng)
        pixels = (pixels - self.mean) / self.std
        size = self.crop_size
        out_image = np.zeros((size, size, 3), dtype=np.float32)
        out_label = np.full((size, size), IGNORE_INDEX, dtype=np.int64)
        out_image[: pixels.shape[0], : pixels.shape[1]] = pixels
        out_label[: label.shape[0], : label.shape[1]] = label
        return torch.from_numpy(out_image).permute(2, 0, 1).contiguous(), torch.from_numpy(out_label)


class SegmentationEvalTransform:
    """The test pipeline: the image resized into ``scale`` keeping its ratio and normalised; the label unchanged.

    Args:
        scale: (long, short) target (2048, 512).
        mean, std: normalisation in 0..1 units.
    """

    def __init__(
        self,
        scale: Sequence[int] = (2048, 512),
        mean: Sequence[float] = (0.5, 0.5, 0.5),
        std: Sequence[float] = (0.5, 0.5, 0.5),
    ) -> None:
        self.scale = tuple(int(s) for s in scale)
        self.mean = np.asarray(mean, dtype=np.float32) * 255.0
        self.std = np.asarray(std, dtype=np.float32) * 255.0

    def __call__(self, image: Image.Image, label: np.ndarray, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns: image [3, h, w] float32 (resized) and label [H, W] int64 (original size)."""
        w, h = rescale_size(image.width, image.height, self.scale)
        pixels = (np.asarray(image.resize((w, h), Image.BILINEAR), dtype=np.float32) - self.mean) / self.std
        return torch.from_numpy(pixels).permute(2, 0, 1).contiguous(), torch.from_numpy(label.astype(np.int64))


class ADE20KDataset(Dataset):
    """Image / label pairs of one split, reduced labels, passed through ``transform``.

    Args:
        root: the ``ADEChallengeData2016`` folder.
        split: ``"training"`` or ``"validation"``.
        transform: a :class:`SegmentationTrainTransform` or :class:`SegmentationEvalTransform`.
        seed: base seed of the per-item random source (combined with the item index and the torch seed of the
            worker, so epochs and workers draw different augmentations).
    """

    def __init__(self, root: str | Path, split: str, transform, seed: int = 0) -> None:
        self.pairs = find_pairs(root, split)
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image_path, label_path = self.pairs[index]
        image = Image.open(image_path).convert("RGB")
        label = reduce_zero_label(np.asarray(Image.open(label_path)))
        if label.shape != (image.height, image.width):
            raise ValueError(f"{label_path}: label {label.shape} does not match image {image.height}x{image.width}")
        # Drawn from torch's generator, which Lightning seeds per worker and which advances between epochs.
        rng = random.Random(int(torch.randint(0, 2**62, (1,)).item()) ^ (self.seed * 1_000_003 + index))
        return self.transform(image, label, rng)


class ADE20KDataModule(L.LightningDataModule):
    """ADE20K train / validation loaders with the Segmenter pipelines (module docstring).

    Args:
        root: the ``ADEChallengeData2016`` folder.
        num_classes: 150.
        crop_size: training crop and sliding-window side (512).
        scale: (long, short) resize target (2048, 512); training multiplies it by a ratio in ``ratio_range``.
        ratio_range: random resize ratio range.
        cat_max_ratio: random-crop class-dominance limit (1.0 disables it).
        hflip: flip probability.
        photometric: photometric distortion on / off.
        mean, std: normalisation (the timm AugReg ViTs: 0.5 / 0.5).
        batch_size: training batch per process (validation always uses 1).
        num_workers: loader workers per process.
        pin_memory, persistent_workers: DataLoader options.
        limit_train_samples: use only the first N training pairs (debugging).
        seed: augmentation seed.
    """

    def __init__(
        self,
        root: str,
        num_classes: int = 150,
        crop_size: int = 512,
        scale: Sequence[int] = (2048, 512),
        ratio_range: Sequence[float] = (0.5, 2.0),
        cat_max_ratio: float = 0.75,
        hflip: float = 0.5,
        photometric: bool = True,
        mean: Sequence[float] = (0.5, 0.5, 0.5),
        std: Sequence[float] = (0.5, 0.5, 0.5),
        batch_size: int = 8,
        num_workers: int = 8,
        pin_memory: bool = True,
        persistent_workers: bool = False,
        limit_train_samples: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.root = Path(root)
        self.num_classes = num_classes
        self.crop_size = int(crop_size)
        self.img_size = self.crop_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.limit_train_samples = limit_train_samples
        self.seed = seed
        self.train_transform = SegmentationTrainTransform(
            crop_size, scale, ratio_range, cat_max_ratio, hflip, photometric, mean, std
        )
        self.eval_transform = SegmentationEvalTransform(scale, mean, std)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        # A root in another layout stops at build time with one line (a missing root is reported by tasks.run;
        # scripts that only need example_input build the module without data).
        if self.root.exists():
            check_layout(self.root)

    def example_input(self) -> dict[str, torch.Tensor]:
        """One input batch of the training shape (pre-flight check, FLOP count)."""
        return {"images": torch.zeros(1, 3, self.crop_size, self.crop_size)}

    def setup(self, stage: str | None = None) -> None:
        if stage in ("fit", None) and self.train_set is None:
            ds = ADE20KDataset(self.root, SPLITS["train"], self.train_transform, self.seed)
            if self.limit_train_samples:
                ds = torch.utils.data.Subset(ds, range(min(len(ds), int(self.limit_train_samples))))
            self.train_set = ds
        if self.val_set is None:
            self.val_set = ADE20KDataset(self.root, SPLITS["val"], self.eval_transform, self.seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            drop_last=True,
            persistent_workers=self.persistent_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set,
            batch_size=1,
            shuffle=False,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
        )
