"""The MAC counter against the paper's FLOPs (Table A) and against hand counts."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn

import mita.models  # noqa: F401
from mita.utils.flops import count_macs, count_params, mita_core_macs, model_gmacs


def _deit(size: str, **attention):
    with torch.device("meta"):
        return timm.create_model(f"mita_deit_{size}_patch16_224", attention=attention)


@pytest.mark.parametrize(
    "size, attention, gmacs",
    [
        ("small", {"name": "full"}, 4.60),
        ("small", {"name": "mita", "m": 25, "k": 25}, 4.42),
        ("tiny", {"name": "mita", "m": 25, "k": 25}, 1.17),
    ],
)
def test_table_a_flops_match_the_paper(size, attention, gmacs):
    assert round(model_gmacs(_deit(size, **attention)), 2) == gmacs


@pytest.mark.parametrize(
    "attention, gmacs",
    [({"name": "full"}, 4.70), ({"name": "mita", "m": 25, "k": 30, "landmark_layout": "patches"}, 4.52)],
)
def test_vit5_flops_match_the_paper(attention, gmacs):
    # Paper: ViT-5-S 4.7G, MiTA-ViT-5-S 4.5G (N = 201: CLS + 4 registers + 196 patches).
    with torch.device("meta"):
        net = timm.create_model("mita_vit5_small_patch16_224", attention=attention)
    assert round(model_gmacs(net), 2) == gmacs


def test_gate_is_counted_honestly():
    base = _deit("small", name="mita", dwc=True)
    gated = _deit("small", name="mita", dwc=True, gate=True)
    # The gate adds a C x C projection (+ bias) per block: 12 x (384^2 + 384) = 1.774M parameters.
    assert count_params(gated) - count_params(base) == 12 * (384 * 384 + 384)
    # ... and 197 x 384 x 384 MACs per block: 0.349 G.
    extra = model_gmacs(gated) - model_gmacs(base)
    assert extra == pytest.approx(12 * 197 * 384 * 384 / 1e9, rel=1e-6)
    assert round(model_gmacs(gated), 2) == 4.78


def test_mita_core_follows_the_operator_cost_model():
    n, d, m, k = 197, 384, 25, 25
    # Pooling N d + R k^T m N d + landmark values 2 m N d + routing m N d + final attention 2 N (m + k) d.
    assert mita_core_macs(n, d, m, k) == n * d + 4 * m * n * d + 2 * n * (m + k) * d
    assert mita_core_macs(n, d, m, 2 * k, routing_only=True) == n * d + 2 * m * n * d + 2 * n * 2 * k * d
    # k larger than the sequence: an expert holds every key.
    assert mita_core_macs(10, d, 4, 50) == mita_core_macs(10, d, 4, 10)


def test_counter_counts_linear_and_matmul_exactly():
    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 16)

        def forward(self, x):
            h = self.fc(x)  # [B, T, 16]
            return h @ h.transpose(-1, -2)  # [B, T, T]

    count = count_macs(Toy(), torch.randn(3, 5, 8))
    assert count.total == 3 * 5 * 8 * 16 + 3 * 5 * 5 * 16
    assert count.per_sample == count.total / 3


def test_full_attention_counts_its_quadratic_core():
    small = model_gmacs(_deit("small", name="full"))
    mita = model_gmacs(_deit("small", name="mita"))
    # Difference per block: full 2 N^2 C against MiTA's cost model.
    n, c = 197, 384
    expected = 12 * (2 * n * n * c - mita_core_macs(n, c, 25, 25)) / 1e9
    assert small - mita == pytest.approx(expected, rel=1e-6)


def test_padding_counts_only_valid_tokens():
    layer = mita.registry.create_attention("mita", 64, 2, m=4, k=8, landmark_layout="1d")
    layer.grid_size, layer.num_prefix_tokens = None, 0
    x = torch.randn(2, 32, 64)
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask[1, 16:] = True
    count = count_macs(layer, x, key_padding_mask=mask)
    core = mita_core_macs(32, 64, 4, 8) + mita_core_macs(16, 64, 4, 8)
    projections = 2 * 32 * (64 * 192 + 64 * 64)
    assert count.total == core + projections


def test_scripts_flops_counts_an_experiment_file():
    from scripts.flops import count_experiment

    params_m, gmacs = count_experiment("imagenet/deit_s-mita")
    assert round(gmacs, 2) == 4.42
    assert params_m == pytest.approx(22.05, abs=0.01)
