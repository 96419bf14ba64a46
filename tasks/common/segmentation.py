"""The semantic-segmentation LightningModule (ADE20K, Table C); the network comes in from config."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics

from tasks.common.module import NetModule

IGNORE_INDEX = 255


def scores_from_confusion(confusion: torch.Tensor) -> dict[str, torch.Tensor]:
    """mmseg's metrics from a confusion matrix accumulated over the whole split.

    IoU of a class = intersection / union over every pixel of the split; classes whose union is empty (absent from
    both the labels and the predictions) are left out of the mean, as mmseg's ``nanmean``.

    Args:
        confusion: [C, C] counts, rows = labels, columns = predictions (ignored pixels excluded).

    Returns:
        ``{"mIoU", "mAcc", "aAcc"}`` as fractions (0-dim float tensors): mean IoU, mean per-class accuracy over
        classes present in the labels, and pixel accuracy.
    """
    confusion = confusion.double()
    intersection = confusion.diag()
    labelled = confusion.sum(dim=1)
    union = labelled + confusion.sum(dim=0) - intersection
    iou = intersection[union > 0] / union[union > 0]
    acc = intersection[labelled > 0] / labelled[labelled > 0]
    total = confusion.sum()
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=confusion.device)
    return {
        "mIoU": (iou.mean() if iou.numel() else nan).float(),
        "mAcc": (acc.mean() if acc.numel() else nan).float(),
        "aAcc": (intersection.sum() / total if total > 0 else nan).float(),
    }


class SegmentationModule(NetModule):
    """Trains a segmentation network with pixel-wise cross-entropy and evaluates it by sliding window.

    Args:
        net: the network (``net(images [B, 3, H, W]) -> logits [B, num_classes, H, W]``), built by Hydra from the
            ``model`` group.
        num_classes: classes (150).
        optimizer: the ``optimizer`` config group (see :func:`tasks.common.optim.build_optimizer`).
        scheduler: the ``scheduler`` config group (see :func:`tasks.common.optim.build_scheduler`), or None.
        window: sliding-window side at evaluation (the training crop, 512).
        stride: sliding-window stride (512: non-overlapping windows, as Segmenter's ADE20K setting).
        ema: None, or ``{"decay": ..., "validate": false}`` as in :class:`tasks.common.module.ClassificationModule`
            (``validate`` adds ``val/mIoU_ema``).
        scales: evaluation scales of the (already resized) validation image; ``[1.0]`` is single scale. Several
            scales (mmseg / Segmenter's multi-scale setting: 0.5, 0.75, 1.0, 1.25, 1.5, 1.75) average the softmax
            probabilities, each scale's sliding-window logits upsampled to the label size first.
        flip: also evaluate the horizontally flipped image at every scale (flipped back, averaged likewise).
        compile: ``torch.compile`` the network.

    Logged: ``train/loss``; ``val/loss`` (cross-entropy at the label's resolution), ``val/mIoU``, ``val/mAcc``,
    ``val/aAcc`` (fractions; the same under ``test/``).
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: Mapping[str, Any],
        scheduler: Mapping[str, Any] | None = None,
        window: int = 512,
        stride: int = 512,
        ema: Mapping[str, Any] | None = None,
        compile: bool = False,
        scales: Sequence[float] = (1.0,),
        flip: bool = False,
    ) -> None:
        super().__init__(net, num_classes, optimizer, scheduler, ema, compile)
        self.save_hyperparameters(ignore=["net"])
        self.scales = tuple(float(x) for x in scales)
        if not self.scales or any(x <= 0 for x in self.scales):
            raise ValueError(f"task.scales must be a non-empty list of positive numbers, got {list(scales)}")
        self.flip = bool(flip)
        self.window, self.stride = int(window), int(stride)
        self.confusion = nn.ModuleDict(
            {
                name: torchmetrics.classification.MulticlassConfusionMatrix(num_classes, ignore_index=IGNORE_INDEX)
                for name in ("val", "val_ema", "test")
            }
        )
        self.val_loss = torchmetrics.MeanMetric()
        self.test_loss = torchmetrics.MeanMetric()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits [B, num_classes, H, W] of images [B, 3, H, W]."""
        return self.net(images)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def _window_logits(self, net: nn.Module, images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        from mita.models.segmenter import sliding_window_logits

        logits = sliding_window_logits(net, images, self.window, self.stride, self.num_classes).float()
        if tuple(logits.shape[-2:]) != tuple(size):
            logits = F.interpolate(logits, size=size, mode="bilinear", align_corners=False)
        return logits

    def predict_logits(self, net: nn.Module, images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """Sliding-window logits of ``images`` [B, 3, h, w], upsampled (bilinear) to the label size ``size``.

        With several scales or flip: the log of the softmax probabilities averaged over every (scale, flip) view
        (log-probabilities are logits of the same distribution, so the loss and the argmax read them alike).

        Returns:
            [B, num_classes, *size] float32.
        """
        if self.scales == (1.0,) and not self.flip:
            return self._window_logits(net, images, size)
        h, w = images.shape[-2:]
        probs = None
        views = 0
        for scale in self.scales:
            scaled = images
            if scale != 1.0:
                shape = (max(1, round(h * scale)), max(1, round(w * scale)))
                scaled = F.interpolate(images, size=shape, mode="bilinear", align_corners=False)
            for flipped in (False, True) if self.flip else (False,):
                view = scaled.flip(-1) if flipped else scaled
                logits = self._window_logits(net, view, size)
                p = (logits.flip(-1) if flipped else logits).softmax(dim=1)
                probs = p if probs is None else probs + p
                views += 1
        return (probs / views).clamp_min(torch.finfo(torch.float32).tiny).log()

    def _eval_step(self, batch: Any, prefix: str) -> None:
        images, labels = batch
        logits = self.predict_logits(self.net, images, tuple(labels.shape[-2:]))
        loss_metric = self.val_loss if prefix == "val" else self.test_loss
        if (labels != IGNORE_INDEX).any():
            loss_metric(F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX))
        self.confusion[prefix].update(logits.argmax(dim=1), labels)
        if prefix == "val" and self.ema_validate:
            ema_logits = self.predict_logits(self.ema.module, images, tuple(labels.shape[-2:]))
            self.confusion["val_ema"].update(ema_logits.argmax(dim=1), labels)

    def _log_scores(self, prefix: str) -> None:
        loss_metric = self.val_loss if prefix == "val" else self.test_loss
        if loss_metric.update_called:
            self.log(f"{prefix}/loss", loss_metric.compute(), sync_dist=False)
        loss_metric.reset()
        names = [(prefix, "")] + ([("val_ema", "_ema")] if prefix == "val" and self.ema_validate else [])
        for name, postfix in names:
            # compute() sums the confusion matrices of every process (one exact score under DDP).
            scores = scores_from_confusion(self.confusion[name].compute())
            self.confusion[name].reset()
            for key, value in scores.items():
                self.log(f"{prefix}/{key}{postfix}", value, prog_bar=key == "mIoU" and not postfix)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._log_scores("val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._log_scores("test")
