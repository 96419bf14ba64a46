"""Test selection: GPU tests need CUDA; slow tests run with `-m slow` or RUN_SLOW=1."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    markexpr = config.getoption("-m") or ""
    run_slow = os.environ.get("RUN_SLOW") == "1" or "slow" in markexpr and "not slow" not in markexpr
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    not_slow = pytest.mark.skip(reason="slow: run with -m slow or RUN_SLOW=1")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(not_slow)
