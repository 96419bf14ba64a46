"""The shared fixtures of tests/conftest.py do what the kernel tests rely on."""

from __future__ import annotations

import pytest
import torch

_REAL_EMPTY, _REAL_NEW_EMPTY = torch.empty, torch.Tensor.new_empty


def test_poison_covers_every_uninitialised_allocation(poison) -> None:
    x = torch.zeros(2, 3)
    floats = [
        torch.empty(4),
        torch.empty_like(x),
        torch.empty_strided((2, 3), (1, 2)),
        x.new_empty(5),
        x.new_empty_strided((2, 3), (1, 2)),
        x.new_empty(3, dtype=torch.bfloat16),
    ]
    for t in floats:
        assert t.isnan().all(), t
    ints = [
        torch.empty(4, dtype=torch.int32),
        x.new_empty(4, dtype=torch.int64),
        torch.empty_like(x, dtype=torch.int8),
        x.new_empty_strided((2, 2), (1, 2), dtype=torch.int32),
    ]
    for t in ints:
        # Neither 0 nor the -1 some kernels write for "no key".
        assert ((t != 0) & (t != -1)).all(), t
    # Initialised allocations are left alone.
    assert (torch.zeros(3) == 0).all() and (x.new_zeros(3) == 0).all() and (torch.full((2,), 7.0) == 7).all()


@pytest.mark.no_poison
def test_no_poison_marker_leaves_allocations_alone(poison) -> None:
    assert torch.empty is _REAL_EMPTY and torch.Tensor.new_empty is _REAL_NEW_EMPTY


def test_poison_fills_allocations_that_require_grad(poison):
    """torch.compile's pattern set-up allocates leaves with requires_grad=True; the poison must still fill them (an
    in-place fill of such a leaf outside no_grad is an autograd error), and they stay leaves that require grad."""
    t = torch.empty(3, requires_grad=True)
    assert t.requires_grad and t.is_leaf and torch.isnan(t).all()
    i = torch.empty(2, dtype=torch.int32)
    assert (i == -123456789).all()
