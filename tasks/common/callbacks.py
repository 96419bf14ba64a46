"""Callbacks: throughput / step time / peak memory, and loggers that need a decision at start-up."""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        return _batch_size(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    return 0


def _tokens(batch: Any) -> int | torch.Tensor | None:
    """Valid tokens in a sequence batch (``key_padding_mask`` True = padding; a 0-dim tensor on the mask's device,
    read only when the window is logged: no host synchronisation per step), else None."""
    if isinstance(batch, Mapping):
        mask = batch.get("key_padding_mask")
        if isinstance(mask, torch.Tensor):
            return (~mask).sum()
        x = batch.get("x")
        if isinstance(x, torch.Tensor) and x.dim() == 2:
            return int(x.numel())
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory (CUDA), else the process's peak resident set size, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux, bytes on macOS.
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class ThroughputMonitor(Callback):
    """Logs step time, samples (and tokens) per second over all processes, and peak memory.

    Times the interval between consecutive training-batch ends (data loading included), averaged over
    ``log_every_n_steps`` steps, so no device synchronisation is added to the training loop.

    Args:
        log_every_n_steps: averaging window and logging period.
    """

    def __init__(self, log_every_n_steps: int = 50) -> None:
        self.log_every_n_steps = max(1, int(log_every_n_steps))
        self._t0: float | None = None
        self._samples = 0
        self._tokens = 0
        self._steps = 0
        # Whole-run totals (after each epoch's first step) for the mean throughput in the run record.
        self._run_samples = 0
        self._run_time = 0.0
        self._prev: float | None = None
        self.last: dict[str, float] = {}

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = None
        self._prev = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._prev is not None:
            self._run_samples += _batch_size(batch)
            self._run_time += now - self._prev
            self.last["perf/mean_samples_per_s"] = self._run_samples * trainer.world_size / self._run_time
        self._prev = now
        if self._t0 is None:
            # The first step includes start-up work; the window starts after it.
            self._t0, self._samples, self._tokens, self._steps = now, 0, 0, 0
            return
        self._samples += _batch_size(batch)
        tokens = _tokens(batch)
        if tokens is not None:
            self._tokens = self._tokens + tokens
        self._steps += 1
        if self._steps < self.log_every_n_steps:
            return
        elapsed = now - self._t0
        world = trainer.world_size
        metrics = {
            "perf/step_time_s": elapsed / self._steps,
            "perf/samples_per_s": self._samples * world / elapsed,
            "perf/peak_mem_gb": peak_memory_gb(pl_module.device),
        }
        if tokens is not None:
            metrics["perf/tokens_per_s"] = int(self._tokens) * world / elapsed
        self.last.update(metrics)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        pl_module.log("samples/s", metrics["perf/samples_per_s"], prog_bar=True, on_step=True, rank_zero_only=True)
        self._t0, self._samples, self._tokens, self._steps = now, 0, 0, 0


class RunClock(Callback):
    """The run's wall time over all its processes, and a clean stop at a wall-clock deadline.

    The time spent so far, the number of processes the run has taken, the commit each of them ran and how many
    training processes shared the accelerator with each are saved in every checkpoint, so a run continued with
    ``resume=auto`` reports its whole training time, every commit that trained it and every sharing. With a
    ``deadline`` (Unix time), training stops after the first optimiser step that ends
    past it; the caller then saves a checkpoint to continue from.

    Args:
        start: Unix time at which this process started the run.
        deadline: Unix time to stop training at, or None.
        commit: the commit this process runs (None if unknown).
        processes: training processes sharing this process's accelerator, itself included (None if unknown).
    """

    def __init__(
        self, start: float, deadline: float | None = None, commit: str | None = None, processes: int | None = None
    ) -> None:
        self.start = float(start)
        self.deadline = None if deadline is None else float(deadline)
        self.before = 0.0
        self.commit = commit
        # The commit of every process of the run, this one last (None where a checkpoint did not say).
        self.commits: list[str | None] = [commit]
        # The processes sharing the accelerator during each process of the run, this one last (None: unknown).
        self.processes: list[int | None] = [processes]
        self.stopped = False

    @property
    def segments(self) -> int:
        """Processes the run has taken, this one included."""
        return len(self.commits)

    def elapsed(self) -> float:
        """Seconds of the run so far, earlier processes included."""
        return self.before + time.time() - self.start

    def state_dict(self) -> dict[str, Any]:
        return {
            "elapsed": self.elapsed(),
            "segments": self.segments,
            "commits": list(self.commits),
            "processes": list(self.processes),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = float(state_dict.get("elapsed", 0.0))
        # Checkpoints written before commits were kept give only the count: those commits are unknown.
        earlier = state_dict.get("commits") or [None] * int(state_dict.get("segments", 1))
        self.commits = [*earlier, self.commit]
        # Checkpoints written before the sharing was kept: unknown for every earlier process.
        shared = state_dict.get("processes") or [None] * len(earlier)
        self.processes = [*shared, self.processes[-1]]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self.deadline is not None and time.time() >= self.deadline:
            self.stopped = True
            trainer.should_stop = True


class BestTracker(Callback):
    """Keeps the best value of one metric (times ``scale``) over the validation runs during training.

    Args:
        key: logged metric name (``val/acc1``), or None to track nothing.
        scale: factor applied to the value (100: fraction -> percent).
    """

    def __init__(self, key: str | None, scale: float = 1.0) -> None:
        self.key, self.scale = key, float(scale)
        self.best: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.key or trainer.state.fn != "fit":
            return
        value = trainer.callback_metrics.get(self.key)
        if value is not None:
            value = float(value) * self.scale
            self.best = value if self.best is None else max(self.best, value)


def wandb_logger(**kwargs: Any):
    """A W&B logger: online when ``WANDB_API_KEY`` is set (or ``offline=False`` is forced), otherwise offline files
    that ``wandb sync <dir>`` uploads later.

    Args:
        **kwargs: ``lightning.pytorch.loggers.WandbLogger`` arguments; ``offline=None`` means "decide from the key".
    """
    from lightning.pytorch.loggers import WandbLogger

    if kwargs.get("offline") is None:
        kwargs["offline"] = not os.environ.get("WANDB_API_KEY")
    tags = kwargs.get("tags") or []
    kwargs["tags"] = [tags] if isinstance(tags, str) else [str(t) for t in tags]
    return WandbLogger(**kwargs)
