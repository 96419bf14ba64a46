"""Run a configuration inside the current process (tests, notebooks), without Hydra's command-line launcher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.common.config import compose


def run_in_process(overrides: list[str], output_dir: str | Path) -> dict[str, Any]:
    """Compose ``train.yaml`` with ``overrides``, run it with output in ``output_dir``, and return ``run``'s result.

    Args:
        overrides: e.g. ``["experiment=imagenet/deit_s-mita", "debug=smoke", "data.root=/tmp/tiny"]``.
        output_dir: the run folder (checkpoints, logs; smoke records under ``output_dir/records``).

    Returns:
        ``{"metrics", "record", "global_step", "trainer"}`` from :func:`tasks.run.run`.
    """
    from tasks.run import run

    output_dir = Path(output_dir)
    cfg = compose(
        [*overrides, f"paths.output_dir={output_dir}", f"paths.log_dir={output_dir.parent}"], hydra_config=True
    )
    return run(cfg)
