"""The MAC counter against the paper's FLOPs (Table A) and against hand counts."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn

import mita.models  # noqa: F401
from mita.utils.flops import count_macs, count_params, mita_core_macs, model_gmacs

C_S, DEPTH, PATCHES = 384, 12, 196  # ViT-S: width, blocks, 14 x 14 patches of 16 x 16 x 3


def vit_s_macs_by_hand(n_tokens: int, core_per_block: int, extra_per_block: int = 0) -> float:
    """GMACs of a ViT-S counted by hand: patch embedding, per block qkv (3 N C^2) + proj (N C^2) + MLP (8 N C^2)
    + the attention core, then the classifier on one token."""
    per_block = 12 * n_tokens * C_S * C_S + core_per_block + extra_per_block
    return (PATCHES * 768 * C_S + DEPTH * per_block + C_S * 1000) / 1e9


def mita_core_by_hand(n: int, c: int, m: int, k: int) -> int:
    """MiTA's core over all heads (c = H d): pool N c, R K^T m N c, landmark values 2 m N c (softmax(R K^T) V),
    routing q R^T m N c, and the final attention over m + k entries 2 N (m + k) c."""
    return n * c + m * n * c + 2 * m * n * c + m * n * c + 2 * n * (m + k) * c


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
    [
        ({"name": "full"}, vit_s_macs_by_hand(201, 2 * 201 * 201 * C_S)),
        (
            {"name": "mita", "m": 25, "k": 30, "landmark_layout": "patches"},
            vit_s_macs_by_hand(201, mita_core_by_hand(201, C_S, 25, 30)),
        ),
    ],
)
def test_vit5_flops_match_the_paper_and_a_hand_count(attention, gmacs):
    # Paper: ViT-5-S 4.7G, MiTA-ViT-5-S 4.5G (N = 201: CLS + 4 registers + 196 patches).
    with torch.device("meta"):
        net = timm.create_model("mita_vit5_small_patch16_224", attention=attention)
    assert model_gmacs(net) == pytest.approx(gmacs, rel=2e-3)
    assert round(gmacs, 1) == (4.7 if attention["name"] == "full" else 4.5)


def test_gate_is_counted_honestly():
    base = _deit("small", name="mita", dwc=True)
    gated = _deit("small", name="mita", dwc=True, gate=True)
    # The gate adds a C x C projection (+ bias) per block: 12 x (384^2 + 384) = 1.774M parameters.
    assert count_params(gated) - count_params(base) == 12 * (384 * 384 + 384)
    # ... and 197 x 384 x 384 MACs per block: 0.349 G.
    extra = model_gmacs(gated) - model_gmacs(base)
    assert extra == pytest.approx(12 * 197 * 384 * 384 / 1e9, rel=1e-6)
    # The whole gated model by hand: MiTA's core, the 3 x 3 depth-wise conv on the 196 patches, the gate.
    by_hand = vit_s_macs_by_hand(197, mita_core_by_hand(197, C_S, 25, 25), 9 * PATCHES * C_S + 197 * C_S * C_S)
    assert model_gmacs(gated) == pytest.approx(by_hand, rel=2e-3)


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
    assert gmacs == pytest.approx(vit_s_macs_by_hand(197, mita_core_by_hand(197, C_S, 25, 25)), rel=2e-3)
    # DeiT-S by hand: patch embedding, CLS, positions, 12 blocks (2 norms, qkv, proj, fc1, fc2), norm, head.
    norms, qkv, proj = 2 * 2 * C_S, C_S * 3 * C_S + 3 * C_S, C_S * C_S + C_S
    block = norms + qkv + proj + (C_S * 4 * C_S + 4 * C_S) + (4 * C_S * C_S + C_S)
    params = (768 * C_S + C_S) + C_S + 197 * C_S + DEPTH * block + 2 * C_S + (C_S * 1000 + 1000)
    assert params_m == pytest.approx(params / 1e6, abs=1e-6)
