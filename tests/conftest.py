"""Test selection: GPU tests need CUDA; slow tests run with `-m slow` or RUN_SLOW=1."""

from __future__ import annotations

import os

# Without a GPU, Triton kernels run in its CPU interpreter. The variable must be set before anything imports
# triton (torch may), in every pytest-xdist worker too, so it is set here rather than in a test module.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


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
