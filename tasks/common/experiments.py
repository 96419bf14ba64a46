"""The experiment files (one per paper-table row) and their ``paper:`` blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tasks.common.config import CONFIG_DIR

EXPERIMENT_DIR = CONFIG_DIR / "experiment"


def read_paper_block(path: Path) -> dict[str, Any] | None:
    """The ``paper:`` block of an experiment file, or None (helper files such as recipes have none)."""
    data = yaml.safe_load(path.read_text()) or {}
    block = data.get("paper") if isinstance(data, dict) else None
    return dict(block) if isinstance(block, dict) else None


def list_experiments(table: str | None = None) -> list[str]:
    """Names (paths under configs/experiment without ``.yaml``) of the table-row experiment files.

    Args:
        table: only rows of this table (``"A"``, ``"D"``, ``"main"``); None for every table.

    Returns:
        Sorted names, e.g. ``["imagenet/deit_s-full", ...]``.
    """
    names = []
    for path in sorted(EXPERIMENT_DIR.rglob("*.yaml")):
        block = read_paper_block(path)
        if block is None:
            continue
        if table is not None and str(block.get("table")) != table:
            continue
        names.append(path.relative_to(EXPERIMENT_DIR).with_suffix("").as_posix())
    return names


def paper_blocks() -> dict[str, dict[str, Any]]:
    """Experiment name -> its ``paper:`` block, for every table-row experiment file."""
    return {name: read_paper_block(EXPERIMENT_DIR / f"{name}.yaml") for name in list_experiments()}
