"""The classification LightningModule every benchmark uses; the network comes in from config."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.utils import ModelEmaV3

from tasks.common.optim import build_optimizer, build_scheduler


def split_batch(batch: Any) -> tuple[dict[str, Any], torch.Tensor]:
    """A batch as (network keyword arguments, labels).

    Accepts ``(x, y)`` (images) or a mapping with ``"label"`` and the network's keyword arguments
    (``{"x": ..., "key_padding_mask": ..., "label": ...}`` for sequence tasks).
    """
    if isinstance(batch, Mapping):
        inputs = {k: v for k, v in batch.items() if k != "label"}
        return inputs, batch["label"]
    x, y = batch[0], batch[1]
    return {"x": x}, y


class NetModule(L.LightningModule):
    """What every task module shares: the network (optionally compiled), the optimiser and schedule configs, the
    exponential moving average of the weights, and the optimiser / per-step schedule built from them. Subclasses
    add the loss and metrics and call ``save_hyperparameters(ignore=["net"])`` in their own ``__init__``.

    Args:
        net: the network, built by Hydra from the ``model`` group.
        num_classes: classes.
        optimizer: the ``optimizer`` config group (see :func:`tasks.common.optim.build_optimizer`).
        scheduler: the ``scheduler`` config group (see :func:`tasks.common.optim.build_scheduler`), or None.
        ema: None, or ``{"decay": ..., "validate": false}`` (``validate``: the subclass also evaluates the EMA).
        compile: ``torch.compile`` the network.
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: Mapping[str, Any],
        scheduler: Mapping[str, Any] | None = None,
        ema: Mapping[str, Any] | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.net = torch.compile(net) if compile else net
        self.num_classes = num_classes
        self.optimizer_cfg = dict(optimizer)
        self.scheduler_cfg = dict(scheduler) if scheduler else None
        self.ema = None
        self.ema_validate = False
        if ema:
            self.ema = ModelEmaV3(net, decay=float(ema["decay"]))
            self.ema_validate = bool(ema.get("validate", False))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.ema is not None:
            self.ema.update(self.net, step=self.global_step)

    def global_batch_size(self) -> int:
        """Samples per optimiser step over all processes."""
        dm = self.trainer.datamodule
        per_device = int(getattr(dm, "batch_size", 1)) if dm is not None else 1
        return per_device * self.trainer.world_size * self.trainer.accumulate_grad_batches

    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer(self.net, self.optimizer_cfg, self.global_batch_size())
        if self.scheduler_cfg is None:
            return optimizer
        # Loads the train loader once, so num_training_batches is known below.
        total = int(self.trainer.estimated_stepping_batches)
        batches = self.trainer.num_training_batches
        if batches in (None, float("inf")):
            steps_per_epoch = total
        else:
            steps_per_epoch = max(1, math.ceil(int(batches) / self.trainer.accumulate_grad_batches))
        scheduler = build_scheduler(optimizer, self.scheduler_cfg, total, steps_per_epoch)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ClassificationModule(NetModule):
    """Trains and evaluates a classifier given as ``net``.

    Args:
        net: the network (``net(**inputs) -> [B, num_classes]`` logits), built by Hydra from the ``model`` group.
        num_classes: classes.
        optimizer: the ``optimizer`` config group (see :func:`tasks.common.optim.build_optimizer`).
        scheduler: the ``scheduler`` config group (see :func:`tasks.common.optim.build_scheduler`), or None.
        loss: ``"ce"`` (cross-entropy; soft targets under Mixup), or ``"bce"`` (binary cross-entropy on one-hot
            targets, the ViT-5 / DeiT III recipe).
        label_smoothing: label smoothing (applied by Mixup when Mixup is on).
        mixup: None, or timm ``Mixup`` arguments (``mixup_alpha``, ``cutmix_alpha``, ``prob``, ``switch_prob``,
            ``mode``); needs an even batch.
        ema: None, or ``{"decay": 0.99996, "validate": false}``: keep an exponential moving average of the
            weights (saved in checkpoints); ``validate`` also evaluates it (metrics ``val/*_ema``).
        top_k: accuracies to report (``(1, 5)`` -> ``val/acc1``, ``val/acc5``); values above num_classes are
            dropped.
        compile: ``torch.compile`` the network.
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: Mapping[str, Any],
        scheduler: Mapping[str, Any] | None = None,
        loss: str = "ce",
        label_smoothing: float = 0.0,
        mixup: Mapping[str, Any] | None = None,
        ema: Mapping[str, Any] | None = None,
        top_k: tuple[int, ...] = (1, 5),
        compile: bool = False,
    ) -> None:
        super().__init__(net, num_classes, optimizer, scheduler, ema, compile)
        self.save_hyperparameters(ignore=["net"])
        if loss not in ("ce", "bce"):
            raise ValueError(f"task.loss must be 'ce' or 'bce', got {loss!r}")
        self.mixup = None
        if mixup:
            self.mixup = Mixup(**dict(mixup), label_smoothing=label_smoothing, num_classes=num_classes)
        if loss == "bce":
            self.train_loss = BinaryCrossEntropy(smoothing=0.0 if self.mixup else label_smoothing)
        elif self.mixup is not None:
            self.train_loss = SoftTargetCrossEntropy()
        elif label_smoothing > 0:
            self.train_loss = LabelSmoothingCrossEntropy(smoothing=label_smoothing)
        else:
            self.train_loss = nn.CrossEntropyLoss()
        self.top_k = tuple(k for k in top_k if k <= num_classes)
        self.val_metrics = self._metrics("val/")
        self.val_metrics_ema = self._metrics("val/", "_ema") if self.ema_validate else None
        self.test_metrics = self._metrics("test/")
        self.val_loss = torchmetrics.MeanMetric()
        self.test_loss = torchmetrics.MeanMetric()

    def _metrics(self, prefix: str, postfix: str = "") -> torchmetrics.MetricCollection:
        metrics = {
            f"acc{k}": torchmetrics.classification.MulticlassAccuracy(
                num_classes=self.num_classes, top_k=k, average="micro"
            )
            for k in self.top_k
        }
        return torchmetrics.MetricCollection(metrics, prefix=prefix, postfix=postfix)

    def forward(self, **inputs: Any) -> torch.Tensor:
        """Logits [B, num_classes] of ``net(**inputs)``."""
        return self.net(**inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, y = split_batch(batch)
        if self.mixup is not None:
            inputs["x"], target = self.mixup(inputs["x"], y)
        else:
            target = y
        logits = self(**inputs)
        loss = self.train_loss(logits, target)
        # The batch size given: Lightning need not infer it from a batch that holds more than tensors.
        n = y.shape[0]
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=n)
        if self.mixup is None:
            # The batch's top-1 accuracy as a device tensor: no host synchronisation in the training step.
            acc = (logits.detach().argmax(-1) == y).float().mean()
            self.log("train/acc1", acc, on_step=True, on_epoch=False, batch_size=n)
        return loss

    def _eval_step(self, batch: Any, metrics: torchmetrics.MetricCollection, loss_metric, prefix: str) -> None:
        inputs, y = split_batch(batch)
        logits = self(**inputs)
        loss_metric(F.cross_entropy(logits.float(), y))
        metrics(logits, y)
        n = y.shape[0]
        self.log(f"{prefix}loss", loss_metric, on_step=False, on_epoch=True, sync_dist=True, batch_size=n)
        self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=prefix == "val/", batch_size=n)
        if prefix == "val/" and self.val_metrics_ema is not None:
            self.val_metrics_ema(self.ema.module(**inputs), y)
            self.log_dict(self.val_metrics_ema, on_step=False, on_epoch=True, batch_size=n)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics, self.val_loss, "val/")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics, self.test_loss, "test/")
