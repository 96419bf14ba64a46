"""Table B: fine-tuning full-attention ViTs with MiTA, MiTA swapped in at inference, and the budget sweep."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import timm
import torch
from hydra.utils import instantiate

import mita.models  # noqa: F401
from tasks.common.config import compose
from tasks.common.experiments import list_experiments
from tasks.common.testing import run_in_process
from tasks.imagenet.fake import write_fake_imagefolder

REPO = Path(__file__).resolve().parents[2]
TABLE_B = list_experiments("B")
ENV = {"s": "MITA_VIT_S_WEIGHTS", "l": "MITA_VIT_L_WEIGHTS"}
SMOKE = ["debug=smoke", "data.num_classes=3"]
# Per size: ViT-L runs at 112 x 112 (a 7 x 7 grid, still m = k = 25) to keep its CPU step short.
SIZE_ARGS = {"s": [], "l": ["data.img_size=112"]}


@pytest.fixture(autouse=True)
def _no_weights_env(monkeypatch):
    # The rows read their weights from these variables when set; the tests pass init_weights themselves.
    for name in ENV.values():
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tiny_imagefolder(tmp_path_factory) -> Path:
    return write_fake_imagefolder(tmp_path_factory.mktemp("imagenet"), num_classes=3, per_class=2)


@pytest.fixture(scope="module")
def full_attention_weights(tmp_path_factory) -> dict[str, Path]:
    """A full-attention checkpoint per size, built from the reference row's own (smoke-shrunk) config."""
    folder = tmp_path_factory.mktemp("weights")
    paths = {}
    for size in ENV:
        cfg = compose([f"experiment=imagenet/ft_vit_{size}-full", *SMOKE, *SIZE_ARGS[size]])
        torch.manual_seed(1)
        paths[size] = folder / f"vit_{size}.pth"
        torch.save(instantiate(cfg.model).state_dict(), paths[size])
    return paths


def test_table_b_has_every_row():
    rows = {f"imagenet/{kind}_vit_{size}-{att}" for kind in ("ft", "swap") for size in "sl" for att in ("mita", "full")}
    assert set(TABLE_B) == rows
    values = {name: compose([f"experiment={name}"]).paper.value for name in TABLE_B}
    assert values["imagenet/ft_vit_s-mita"] == 80.9 and values["imagenet/ft_vit_l-mita"] == 85.5
    assert all(v is None for name, v in values.items() if not name.endswith(("ft_vit_s-mita", "ft_vit_l-mita")))


def test_recipe_and_pretrained_conventions():
    cfg = compose(["experiment=imagenet/ft_vit_l-mita"])
    assert cfg.requires_init_weights and cfg.train and cfg.init_weights is None
    # timm AugReg weights: qkv bias, mean = std = 0.5, crop 0.9.
    assert cfg.model.qkv_bias and list(cfg.data.mean) == list(cfg.data.std) == [0.5, 0.5, 0.5]
    assert cfg.data.crop_pct == 0.9 and cfg.model.model_name == "mita_vit_large_patch16_224"
    # The assumed fine-tuning recipe: 30 epochs, lr 5e-5 x batch / 512, no Mixup / CutMix / EMA.
    assert cfg.trainer.max_epochs == 30 and cfg.optimizer.lr == 5e-5 and cfg.optimizer.lr_batch_ref == 512
    assert cfg.task.mixup is None and cfg.task.ema is None and cfg.task.label_smoothing == 0.1
    assert not compose(["experiment=imagenet/swap_vit_s-mita"]).train
    assert not compose(["experiment=imagenet/deit_s-mita"]).requires_init_weights


def test_weights_from_the_environment(monkeypatch):
    monkeypatch.setenv("MITA_VIT_S_WEIGHTS", "/w/vit_s.safetensors")
    assert compose(["experiment=imagenet/swap_vit_s-mita"]).init_weights == "/w/vit_s.safetensors"
    assert compose(["experiment=imagenet/swap_vit_s-mita", "init_weights=/x.pth"]).init_weights == "/x.pth"


def test_vit_large_entrypoint_is_timm_vit_large():
    ref = timm.create_model("vit_large_patch16_224", depth=1).eval()
    net = timm.create_model("mita_vit_large_patch16_224", attention="full", depth=1).eval()
    assert net.pretrained_cfg["mean"] == (0.5, 0.5, 0.5)
    net.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(1, 3, 224, 224)
    torch.testing.assert_close(net(x), ref(x))
    mita_net = timm.create_model("mita_vit_large_patch16_224", attention={"name": "mita", "m": 25, "k": 25}, depth=1)
    mita_net.load_state_dict(ref.state_dict(), strict=True)
    assert (mita_net.blocks[0].attn.m, mita_net.blocks[0].attn.grid_size) == (25, (14, 14))


@pytest.mark.parametrize("experiment", TABLE_B)
def test_every_table_b_row_runs(experiment, tiny_imagefolder, full_attention_weights, tmp_path):
    size = experiment.split("_vit_")[1][0]
    weights = full_attention_weights[size]
    # No checkpoint files: writing ViT-L's optimiser state would take most of the test's time.
    no_ckpt = ["~callbacks.checkpoint", "save_final_checkpoint=false"]
    result = run_in_process(
        [f"experiment={experiment}", *SMOKE, *SIZE_ARGS[size], *no_ckpt, f"data.root={tiny_imagefolder}"]
        + [f"init_weights={weights}"],
        tmp_path / "run",
    )
    record = json.loads(Path(result["record"]).read_text())
    assert record["smoke"] is True and record["paper"]["table"] == "B"
    assert torch.isfinite(torch.tensor(record["metrics"]["val/loss"]))
    net = result["trainer"].lightning_module.net
    attention = record["config"]["model"]["attention"]["name"]
    assert type(net.blocks[0].attn).attention_name == attention
    saved = torch.load(weights)
    state = net.state_dict()
    assert set(state) == set(saved)
    if experiment.startswith("imagenet/swap_"):
        # Inference only: no step, and the network holds exactly the full-attention weights.
        assert result["global_step"] == 0
        for key, value in saved.items():
            torch.testing.assert_close(state[key], value)
    else:
        # Fine-tuning starts from the weights: one step moves them only a little.
        assert result["global_step"] == 1
        moved = (state["blocks.0.attn.qkv.weight"] - saved["blocks.0.attn.qkv.weight"]).abs().max().item()
        assert 0 < moved < 1e-3


def test_missing_init_weights_is_a_one_line_error(tiny_imagefolder, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_in_process(["experiment=imagenet/ft_vit_s-mita", *SMOKE, f"data.root={tiny_imagefolder}"], tmp_path / "r")
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(err) == 1 and err[0].startswith("config error: init_weights:") and "ft_vit_s-mita" in err[0]


def _budget_sweep():
    if "budget_sweep" not in sys.modules:
        spec = importlib.util.spec_from_file_location("budget_sweep", REPO / "scripts" / "budget_sweep.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["budget_sweep"] = module
        spec.loader.exec_module(module)
    return sys.modules["budget_sweep"]


SHAPES = ["debug=smoke", "data.num_train=8", "data.num_val=8", "data.num_test=4"]


def test_budget_sweep_writes_one_row_per_budget(tmp_path):
    # A tiny MiTA checkpoint in this project's Lightning format (keys net.*).
    cfg = compose(["experiment=synthetic/shapes-mita", *SHAPES])
    torch.manual_seed(2)
    net = instantiate(cfg.model)
    torch.save({"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()}}, tmp_path / "mita.ckpt")
    sweep = _budget_sweep()
    args = ["--experiment", "synthetic/shapes-mita", "--init-weights", str(tmp_path / "mita.ckpt")]
    args += ["--m", "4", "9", "--k", "8", "16", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "w")]
    csv_path, md_path = sweep.main([*args, *SHAPES])
    rows = list(csv.DictReader(csv_path.open()))
    assert [(int(r["m"]), int(r["k"])) for r in rows] == [(4, 8), (4, 16), (9, 8), (9, 16)]
    assert [int(r["entries_per_query"]) for r in rows] == [12, 20, 17, 25]
    for row in rows:
        assert 0.0 <= float(row["value"]) <= 100.0 and row["metric"] == "val/acc1" and row["smoke"] == "True"
        assert len(row["commit"]) == 40 and row["hardware"] and row["command"].startswith("python scripts/")
    assert rows[0]["init_weights_sha256"] == sweep.file_sha256(tmp_path / "mita.ckpt")
    text = md_path.read_text()
    assert "SMOKE" in text and "| 9 |" in text and "* (25)" in text
    # m and k need a MiTA experiment.
    with pytest.raises(SystemExit, match="need MiTA"):
        sweep.main(["--experiment", "synthetic/shapes-full", "--init-weights", str(tmp_path / "mita.ckpt"), *SHAPES])
