"""Caches of tensors that stay usable whatever grad mode they were first built in."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def outside_inference_mode(fn: F) -> F:
    """Run ``fn`` with inference mode off, so that the tensors it returns are normal tensors.

    A table cached on first use (an ``lru_cache`` of pooling matrices, a RoPE cos/sin pair) may be built under
    ``torch.inference_mode()``; an inference tensor cannot be saved for backward, so every later training step
    that reads the table would fail. Apply this below the cache decorator.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
