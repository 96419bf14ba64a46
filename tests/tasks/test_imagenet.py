"""ImageNet (Table A): timm entrypoints, loaders on tiny trees in the release formats, every row runs one step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch

import mita.models  # noqa: F401
from tasks.common.experiments import list_experiments
from tasks.common.testing import run_in_process
from tasks.imagenet.data import ImageNetDataModule
from tasks.imagenet.fake import write_fake_imagefolder, write_fake_parquet

TABLE_A = list_experiments("A")


@pytest.fixture(scope="module")
def tiny_imagefolder(tmp_path_factory) -> Path:
    return write_fake_imagefolder(tmp_path_factory.mktemp("imagenet"), num_classes=3, per_class=2)


def test_table_a_has_every_row():
    expected = {"full", "agent_minus", "mita", "mita_dwc", "mita_dwc_gate", "mita_routing", "moba", "topk"}
    assert {name.split("deit_s-")[1] for name in TABLE_A if "deit_s-" in name} == expected
    assert {"imagenet/deit_t-mita", "imagenet/deit_t-mita_dwc"} <= set(TABLE_A)
    assert {"imagenet/vit5_s-full", "imagenet/vit5_s-mita", "imagenet/vit5_s-mita_dwc"} <= set(TABLE_A)


@pytest.mark.parametrize("experiment", TABLE_A)
def test_every_table_a_row_runs_one_step(experiment, tiny_imagefolder, tmp_path):
    result = run_in_process(
        [f"experiment={experiment}", "debug=smoke", f"data.root={tiny_imagefolder}", "data.num_classes=3"],
        tmp_path / "run",
    )
    assert result["global_step"] == 1
    record = json.loads(Path(result["record"]).read_text())
    assert record["smoke"] is True and record["paper"]["table"] == "A"
    assert torch.isfinite(torch.tensor(record["metrics"]["val/loss"]))
    # The row's attention really ran: the network's blocks hold the configured layer.
    net = result["trainer"].lightning_module.net
    attention = record["config"]["model"]["attention"]
    layer = net.blocks[0].attn
    assert type(layer).attention_name in (attention["name"], "mita_routing" if attention.get("routing_only") else "")
    # Config key -> layer attribute (the layer keeps k, the keys per expert, as ``topk``, beside its key tensor k).
    for key, attribute in (("m", "m"), ("k", "topk"), ("routing_only", "routing_only")):
        if key in attention:
            assert getattr(layer, attribute) == attention[key]
    if attention["name"] == "mita":
        assert (layer.dwc is not None) == attention["dwc"]
        assert (layer.gate_proj is not None) == attention["gate"]


def test_entrypoints_take_any_attention_and_load_timm_weights():
    ref = timm.create_model("deit_tiny_patch16_224")
    net = timm.create_model("mita_deit_tiny_patch16_224", attention="mita", attention_kwargs={"m": 16, "k": 20})
    for block in net.blocks:
        assert block.attn.grid_size == (14, 14) and block.attn.num_prefix_tokens == 1
        assert (block.attn.m, block.attn.topk) == (16, 20)
    # A plain timm DeiT state dict loads strictly (MiTA adds no parameters) ...
    net.load_state_dict(ref.state_dict(), strict=True)
    # ... and into the DWC variant with exactly the DWC parameters missing.
    dwc = timm.create_model("mita_deit_tiny_patch16_224", attention={"name": "mita", "dwc": True})
    missing = dwc.load_state_dict(ref.state_dict(), strict=False).missing_keys
    assert missing and all(".attn.dwc." in key for key in missing)
    # Full attention reproduces timm's DeiT exactly.
    full = timm.create_model("mita_deit_tiny_patch16_224", attention="full").eval()
    full.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 224, 224)
    torch.testing.assert_close(full(x), ref.eval()(x))


def test_vit5_rope_depends_on_relative_patch_positions():
    from mita.models.vit import Rope2D

    rope = Rope2D(16, theta=100.0, prefix_theta=100.0)
    rope.grid_size, rope.num_prefix_tokens = (6, 7), 5
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    n = 5 + 6 * 7

    def score(i: int, j: int) -> torch.Tensor:
        qs, ks = torch.zeros(1, 1, n, 16), torch.zeros(1, 1, n, 16)
        qs[..., i, :], ks[..., j, :] = q[..., 0, :], k[..., 0, :]
        return (rope(qs)[..., i, :] * rope(ks)[..., j, :]).sum()

    def patch(r: int, c: int) -> int:
        return 5 + r * 7 + c

    # The same offset (1 row, 2 columns) at two places of the grid gives the same score; another offset does not.
    torch.testing.assert_close(score(patch(0, 0), patch(1, 2)), score(patch(3, 4), patch(4, 6)))
    assert not torch.allclose(score(patch(0, 0), patch(1, 2)), score(patch(0, 0), patch(2, 1)))
    # Rotations keep norms.
    x = torch.randn(2, 3, n, 16)
    torch.testing.assert_close(rope(x).norm(dim=-1), x.norm(dim=-1))


def test_vit5_has_registers_rope_and_patch_landmarks():
    net = timm.create_model(
        "mita_vit5_small_patch16_224", attention={"name": "mita", "m": 25, "k": 30, "landmark_layout": "patches"}
    )
    assert net.num_prefix_tokens == 5 and net.blocks[0].attn.num_prefix_tokens == 5
    assert net.blocks[0].attn.rope is net.rope and net.blocks[0].ls1.gamma.abs().max().item() == pytest.approx(1e-4)
    assert not any("rope" in key for key in net.state_dict())
    assert net(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


def test_set_input_size_updates_the_attention_grid():
    net = timm.create_model("mita_deit_tiny_patch16_224", attention="mita", img_size=224, depth=1)
    net.set_input_size(img_size=(160, 192))
    assert net.blocks[0].attn.grid_size == (10, 12)
    assert net(torch.randn(1, 3, 160, 192)).shape == (1, 1000)


@pytest.mark.parametrize("fmt", ["imagefolder", "parquet"])
def test_loaders_read_the_release_formats(tmp_path, fmt):
    if fmt == "imagefolder":
        root = write_fake_imagefolder(tmp_path / "inet", num_classes=3, per_class=4)
        splits = {}
    else:
        root = write_fake_parquet(tmp_path / "inet", num_classes=3, per_class=4)
        splits = {"train_split": "data/train-*.parquet", "val_split": "data/validation-*.parquet"}
    dm = ImageNetDataModule(
        str(root), format=fmt, num_classes=3, img_size=64, batch_size=4, num_workers=0, pin_memory=False, **splits
    )
    dm.setup("fit")
    assert len(dm.train_set) == len(dm.val_set) == 12
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 64, 64) and y.dtype == torch.int64
    xv, yv = next(iter(dm.val_dataloader()))
    assert xv.shape[1:] == (3, 64, 64)
    # Labels follow the sorted class names (wnids): the first validation images are class 0.
    assert yv[0].item() == 0 and set(y.tolist()) <= {0, 1, 2}


def test_repeated_augmentation_spreads_copies_over_processes(tmp_path):
    from timm.data.distributed_sampler import RepeatAugSampler

    root = write_fake_imagefolder(tmp_path / "inet", num_classes=2, per_class=6)
    dm = ImageNetDataModule(str(root), num_classes=2, img_size=32, batch_size=2, num_workers=0, pin_memory=False)
    dm.setup("fit")
    shards = [list(RepeatAugSampler(dm.train_set, num_replicas=3, rank=r, num_repeats=3)) for r in range(3)]
    # Each image's three augmented copies go to the three processes.
    assert shards[0] == shards[1] == shards[2]
