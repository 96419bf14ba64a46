"""Silence the library messages a run prints that carry no information for this project.

Each entry is understood: Lightning's accelerator inventory and its advertisement for its cloud logger, its note
that it loads the train loader to count steps, torch.load's ``weights_only`` default (our own checkpoints), the
``pin_memory`` warning on machines without an accelerator, a ``_pytree`` deprecation inside Lightning, and the
"modules in eval mode" warning (frozen or eval-mode submodules are deliberate here). Everything else still shows.
"""

from __future__ import annotations

import logging
import warnings

# Prefixes of Lightning info lines (rank_zero_info and the checkpoint connector's logger) that are dropped.
INFO_PREFIXES = (
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "💡 Tip: For seamless cloud logging",
    "Loading `train_dataloader` to estimate number of stepping batches",
    "`weights_only` was not set",
)
# Message patterns (regular expressions matched at the start) of warnings that are ignored.
WARNING_PATTERNS = (
    r".*'pin_memory' argument is set as true but no accelerator is found",
    r".*isinstance\(treespec, LeafSpec\)",
    r"Found \d+ module\(s\) in eval mode at the start of training",
    r".*You are using `torch.load` with `weights_only=False`",
)
LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.pytorch.trainer.connectors.checkpoint_connector",
)


class _DropKnownInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(INFO_PREFIXES)


_FILTER = _DropKnownInfo()


def silence_known_noise() -> None:
    """Install the filters (idempotent)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    for pattern in WARNING_PATTERNS:
        warnings.filterwarnings("ignore", message=pattern)
