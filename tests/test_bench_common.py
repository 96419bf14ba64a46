"""Helpers of the benchmarks that run without a GPU (scripts/bench/common.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("common", None)
    import common

    return common


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9, 0.99])
def test_correlated_tokens_have_unit_variance_and_lag1_correlation_rho(common, rho):
    g = torch.Generator().manual_seed(0)
    x = common.correlated_tokens((2, 2, 40000, 8), rho, g, device="cpu", dtype=torch.float32)
    assert x.shape == (2, 2, 40000, 8)
    var = x.var().item()
    lag1 = (x[..., 1:, :] * x[..., :-1, :]).mean().item() / var
    assert abs(var - 1) < 0.1
    assert abs(lag1 - rho) < 0.02
    # Independent across channels and heads: correlation of two channels near 0.
    c = (x[..., 0] * x[..., 1]).mean().item() / var
    assert abs(c) < 0.1


def test_correlated_tokens_rejects_rho_out_of_range(common):
    with pytest.raises(ValueError, match="rho"):
        common.correlated_tokens((1, 8, 2), 1.0, torch.Generator(), device="cpu")
