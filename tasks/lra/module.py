"""LightningModule for the LRA tasks and arXiv: classification of one sequence or of a document pair.

The network comes in from config (``mita.models.lra.LRAEncoder``); this module owns the loss, the metrics
and the recipe's optimiser: AdamW (betas 0.9/0.999, eps 1e-6, weight decay 0), linear warm-up then linear
decay to 0 at ``total_steps``, stepped every optimisation step.
"""

from __future__ import annotations

import time

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F


def warmup_linear_decay(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate factor: ``step / warmup`` during warm-up, then linear decay to 0 at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


class LRAModule(L.LightningModule):
    """Cross-entropy classification with accuracy on train/val/test.

    Batches are dicts from :class:`tasks.lra.data.Collate`: ``tokens``, ``mask`` (True = padding), ``label``,
    and ``tokens2``/``mask2`` for the retrieval dual encoder.

    Args:
        net: the encoder (``forward(tokens, mask, tokens2=None, mask2=None) -> [B, classes]``).
        lr: peak learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warm-up steps.
        total_steps: step at which the linear decay reaches 0 (the recipe's training length).
    """

    def __init__(
        self,
        net: nn.Module,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        warmup_steps: int = 1000,
        total_steps: int = 5000,
    ) -> None:
        super().__init__()
        self.net = net
        self.save_hyperparameters(ignore=["net"])
        self._t0: float | None = None

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(batch["tokens"], batch["mask"], batch.get("tokens2"), batch.get("mask2"))

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logits = self(batch)
        loss = F.cross_entropy(logits.float(), batch["label"])
        acc = (logits.argmax(dim=-1) == batch["label"]).float().mean()
        on_step = stage == "train"
        bs = batch["label"].shape[0]
        self.log(f"{stage}/loss", loss, on_step=on_step, on_epoch=not on_step, prog_bar=True, batch_size=bs)
        self.log(f"{stage}/acc", acc, on_step=on_step, on_epoch=not on_step, prog_bar=True, batch_size=bs)
        return loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def on_train_start(self) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self._t0 is not None:
            self.log("train/wall_s", time.perf_counter() - self._t0, on_step=True, on_epoch=False)

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(
            self.parameters(), lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, weight_decay=hp.weight_decay
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_linear_decay(step, hp.warmup_steps, hp.total_steps)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
