"""Counting the PyTorch ops that launch kernels: what a call costs on the host beyond its own launches.

``KernelOps`` is a dispatch mode that records every op run under it except allocations, views, detaches and
``record_stream`` (``FREE_OPS``, which launch no kernel on a GPU); ``skip()`` true leaves ops out (the Triton
interpreter's own ops while a kernel runs). Used by the launch-count tests and ``scripts/bench/profiler.py host``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

FREE_OPS = frozenset(
    {
        "empty", "new_empty", "new_empty_strided", "empty_like", "empty_strided", "view", "detach", "_unsafe_view",
        "alias", "as_strided", "_reshape_alias", "unsqueeze", "transpose", "t", "expand", "slice", "select",
        "permute", "squeeze", "split", "unbind", "reshape", "record_stream",
    }
)  # fmt: skip


class KernelOps(TorchDispatchMode):
    """Records the names of the kernel-launching ops run under it: ``names`` (a Counter) and ``ops`` (in order)."""

    def __init__(self, skip: Callable[[], bool] = lambda: False):
        super().__init__()
        self.skip = skip
        self.ops: list[str] = []
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in FREE_OPS and not self.skip():
            self.ops.append(name)
            self.names[name] += 1
        return func(*args, **(kwargs or {}))
