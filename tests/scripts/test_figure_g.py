"""Figure G tooling: recorded routed-expert selections, selection maps, the script and its reproduce.sh branch."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import mita  # noqa: F401  (registers the timm entrypoints)
from mita.analysis import (
    concentration_stats,
    patch_mask,
    record_routing,
    selection_counts,
    selection_maps,
)
from mita.layers.mita import MiTAAttention
from mita.ops.landmarks import pool_landmarks
from mita.ops.mita.dense_ref import _rank
from mita.registry import create_attention

REPO = Path(__file__).resolve().parents[2]


def _script():
    """scripts/figure_g.py (not a package), loaded once per process."""
    if "figure_g" not in sys.modules:
        spec = importlib.util.spec_from_file_location("figure_g", REPO / "scripts" / "figure_g.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["figure_g"] = module
        spec.loader.exec_module(module)
    return sys.modules["figure_g"]


def _layer(routing_only: bool, k: int, layout: str = "official") -> MiTAAttention:
    torch.manual_seed(0)
    layer = create_attention("mita", 32, 2, m=4, k=k, routing_only=routing_only, landmark_layout=layout)
    layer.grid_size = (4, 5)
    layer.num_prefix_tokens = 1
    return layer.double().eval()


def _qkv_landmarks(layer: MiTAAttention, x: torch.Tensor):
    q, k, v = layer.split_qkv(x)
    R = pool_landmarks(q, layer.m, layout=layer.landmark_layout, grid=layer.grid_size, num_prefix_tokens=1)
    return q, k, v, R


@pytest.mark.parametrize("layout", ["official", "patches"])
def test_recorded_selection_reproduces_routing_only_output(layout):
    # Routing-only MiTA recomputed by hand from the recorded experts must equal the layer's output.
    layer = _layer(routing_only=True, k=7, layout=layout)
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    with record_routing(layer) as record:
        out = layer(x)
    sel = record.selections[0]
    assert sel.shape == (2, 2, 4, 7)
    q, k, v, R = _qkv_landmarks(layer, x)
    route = (q @ R.transpose(-1, -2)).argmax(-1)  # [B, H, N]
    expert = torch.gather(sel, 2, route[..., None].expand(-1, -1, -1, sel.shape[-1]))  # [B, H, N, k]
    k_sel = torch.gather(k[:, :, None].expand(-1, -1, 21, -1, -1), 3, expert[..., None].expand(-1, -1, -1, -1, 16))
    v_sel = torch.gather(v[:, :, None].expand(-1, -1, 21, -1, -1), 3, expert[..., None].expand(-1, -1, -1, -1, 16))
    p = torch.softmax(torch.einsum("bhnd,bhnkd->bhnk", q, k_sel) * layer.scale, dim=-1)
    o = torch.einsum("bhnk,bhnkd->bhnd", p, v_sel)
    expected = layer.output(layer.merge_heads(o))
    torch.testing.assert_close(out, expected)
    # A wrong selection (another expert per query) gives another output: the comparison can fail.
    o_wrong = torch.einsum("bhnk,bhnkd->bhnd", p, v_sel.roll(1, dims=2))
    assert not torch.allclose(layer.output(layer.merge_heads(o_wrong)), out)


def test_recorded_selection_is_the_rank_based_expert_membership_with_padding():
    # Independent formulation (rank counting, no sort): the recorded set per landmark is the top-k valid keys.
    layer = _layer(routing_only=False, k=6)
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    pad = torch.zeros(2, 21, dtype=torch.bool)
    pad[1, 15:] = True
    with record_routing(layer) as record:
        layer(x, key_padding_mask=pad)
    sel = record.selections[0]
    _, k, _, R = _qkv_landmarks(layer, x)
    scores = R @ k.transpose(-1, -2)
    valid = (~pad)[:, None, None, :].expand_as(scores)
    member = (_rank(scores, valid) < 6) & valid
    recorded = torch.zeros_like(member)
    recorded.scatter_(3, sel.clamp_min(0), sel >= 0)
    assert torch.equal(recorded, member)
    assert (sel[1] < 15).all()


def test_fewer_valid_keys_than_k_leaves_empty_slots():
    layer = _layer(routing_only=False, k=8)
    x = torch.randn(1, 21, 32, dtype=torch.float64)
    pad = torch.ones(1, 21, dtype=torch.bool)
    pad[0, :5] = False
    with record_routing(layer) as record:
        layer(x, key_padding_mask=pad)
    sel = record.selections[0]
    assert ((sel >= 0).sum(-1) == 5).all() and (sel[sel >= 0] < 5).all()
    assert (sel == -1).sum() == 2 * 4 * 3


def test_recording_off_leaves_no_state_and_same_output():
    layer = _layer(routing_only=False, k=6)
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    out_off = layer(x)
    assert layer.record_selection is False and layer.last_selection is None
    with record_routing(layer) as record:
        out_on = layer(x)
        assert record.current()[0] is not None
    torch.testing.assert_close(out_on, out_off, rtol=0, atol=0)
    assert layer.record_selection is False and layer.last_selection is None
    layer(x)
    assert layer.last_selection is None
    with pytest.raises(ValueError, match="no MiTAAttention"):
        with record_routing(torch.nn.Linear(2, 2)):
            pass


def test_selection_maps_shape_and_counts():
    torch.manual_seed(0)
    model = timm.create_model(
        "mita_deit_tiny_patch16_224", img_size=(48, 64), depth=3, attention_kwargs={"m": 4, "k": 5}, num_classes=3
    )
    model.train()
    maps = selection_maps(model, torch.randn(2, 3, 48, 64))
    assert model.training
    assert maps.patches.shape == (3, 2, 3, 4) and maps.prefix.shape == (3, 2, 1)
    # Every image gets H * m * k selections per layer (k <= N), split between patches and CLS.
    assert torch.equal(maps.totals, torch.full((3, 2), 3 * 4 * 5.0))
    # One layer's counts equal a direct histogram of its recorded indices.
    with record_routing(model) as record:
        model.eval()(torch.randn(2, 3, 48, 64))
    sel = record.selections[1]
    patches, prefix = selection_counts(sel, 13, 1, (3, 4))
    hist = torch.stack([torch.bincount(s.flatten(), minlength=13) for s in sel]).float()
    torch.testing.assert_close(torch.cat([prefix, patches.flatten(1)], 1), hist)


def test_concentration_stats_on_known_maps():
    from mita.analysis import SelectionMaps

    patches = torch.zeros(2, 1, 2, 2)
    patches[0, 0] = torch.tensor([[1.0, 1.0], [1.0, 1.0]])  # uniform
    patches[1, 0, 0, 0] = 4.0  # all on one patch
    maps = SelectionMaps(patches, torch.zeros(2, 1, 1), ["a", "b"], [1, 1], [1, 1], [4, 4])
    foreground = torch.tensor([[[True, False], [False, False]]])
    stats = concentration_stats(maps, foreground)
    assert stats[0]["normalized_entropy"] == pytest.approx(1.0) and stats[0]["distinct_patch_fraction"] == 1.0
    assert stats[1]["normalized_entropy"] == pytest.approx(0.0) and stats[1]["distinct_patch_fraction"] == 0.25
    assert stats[0]["background_selection_fraction"] == pytest.approx(0.75)
    assert stats[1]["background_selection_fraction"] == pytest.approx(0.0)
    assert stats[0]["background_patch_fraction"] == pytest.approx(0.75)
    mask = torch.zeros(1, 8, 8)
    mask[0, :4, :2] = 1
    assert patch_mask(mask, (2, 2)).tolist() == [[[True, False], [False, False]]]
    assert patch_mask(mask, (2, 2), threshold=0.75).tolist() == [[[False, False], [False, False]]]


def test_shape_masks_cover_the_shapes():
    shape_masks = _script().shape_masks
    from tasks.synthetic.data import make_shapes

    x, _ = make_shapes(16, 32, seed=5)
    masks = shape_masks(16, 32, seed=5)
    assert masks.shape == (16, 32, 32) and (masks.flatten(1).sum(1) == 81).all()
    brightness = x.sum(1)
    inside = (brightness * masks).flatten(1).sum(1) / 81
    outside = (brightness * ~masks).flatten(1).sum(1) / (32 * 32 - 81)
    assert (inside > outside + 0.3).all()


def test_script_on_tiny_image_folder(tmp_path):
    from PIL import Image

    main = _script().main

    images, masks = tmp_path / "images" / "cls_a", tmp_path / "masks" / "cls_a"
    images.mkdir(parents=True)
    masks.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        pixels = (torch.rand(40, 40, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(images / f"img{i}.png")
        mask = torch.zeros(40, 40, dtype=torch.uint8)
        mask[8:30, 10:28] = 255
        Image.fromarray(mask.numpy()).save(masks / f"img{i}.png")
    out = tmp_path / "out"
    paths = main(
        [
            "--experiment",
            "synthetic/shapes-mita",
            "--images",
            str(tmp_path / "images"),
            "--masks",
            str(tmp_path / "masks"),
            "--num-images",
            "3",
            "--out",
            str(out),
            "--name",
            "tiny",
        ]
    )
    assert paths["png"].stat().st_size > 1000 and paths["png"].read_bytes()[:4] == b"\x89PNG"
    lines = paths["csv"].read_text().splitlines()
    provenance = {line[2:].split(":", 1)[0] for line in lines if line.startswith("# ")}
    assert {"command", "commit", "date", "hardware", "weights"} <= provenance
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert [int(r["layer"]) for r in rows] == [0, 1]
    for r in rows:
        # 2 heads x 9 landmarks x 16 keys (configs/experiment/synthetic/shapes-mita).
        assert float(r["selections_per_image"]) == 2 * 9 * 16
        assert 0 <= float(r["background_selection_fraction"]) <= 1
        assert 0 < float(r["background_patch_fraction"]) < 1


def _reproduce(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(REPO / "reproduce.sh"), *args], cwd=REPO, env=env, capture_output=True, text=True
    )


def test_reproduce_g_dry_run_prints_the_script():
    proc = _reproduce("G", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "+ " in proc.stdout and "scripts/figure_g.py --synthetic" in proc.stdout
    assert "no experiment files yet" not in proc.stdout
    proc = _reproduce("G", "--dry-run", "init_weights=/w.pth", "data.root=/data/imagenet")
    assert "scripts/figure_g.py --experiment imagenet/deit_s-mita init_weights=/w.pth data.root=/data/imagenet" in (
        proc.stdout
    )
    smoke = _reproduce("G", "--dry-run", "--smoke")
    assert "figure_g.py --synthetic --steps 8" in smoke.stdout
