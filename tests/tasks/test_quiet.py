"""Known library noise is dropped, anything else still shows; runs end with one summary line."""

from __future__ import annotations

import logging
import warnings

from omegaconf import OmegaConf

from tasks.common.quiet import silence_known_noise
from tasks.run import summary_line


def test_known_lightning_info_lines_are_dropped_and_others_kept(caplog):
    from lightning.pytorch.utilities import rank_zero_info

    silence_known_noise()
    silence_known_noise()  # idempotent
    with caplog.at_level(logging.INFO):
        rank_zero_info("GPU available: False, used: False")
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        rank_zero_info("`Trainer.fit` stopped: `max_steps=1` reached.")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["`Trainer.fit` stopped: `max_steps=1` reached."]


def test_known_warnings_are_ignored_and_others_raised():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_known_noise()
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory", stacklevel=1
        )
        warnings.warn("Found 11 module(s) in eval mode at the start of training. This may lead to bugs", stacklevel=1)
        warnings.warn("something new", stacklevel=1)
    assert [str(w.message) for w in caught] == ["something new"]


def test_summary_line_names_the_reported_metric_steps_time_and_record():
    cfg = OmegaConf.create({"name": "lra/listops-full", "report": {"key": "test/acc1", "scale": 100}})
    line = summary_line(cfg, {"test/acc1": 0.3455, "val/acc1": 0.378, "val/loss": 1.7}, 5000, 421.4, "r.json")
    assert line == (
        "done: lra/listops-full: test/acc1 34.5, val/acc1 37.8, val/loss 1.7000; 5000 steps in 7 min 1 s; record r.json"
    )
