"""init_weights: full-attention checkpoints initialise MiTA models (timm / torch / Lightning formats)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mita.models.vit import create_vit
from tasks.common.config import compose
from tasks.common.testing import run_in_process
from tasks.common.weights import WeightsError, load_init_weights

SMALL = dict(img_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0)


def _vit(attention, num_classes=5):
    torch.manual_seed(0)
    return create_vit("mita_deit_tiny_patch16_224", attention=attention, num_classes=num_classes, **SMALL)


@pytest.mark.parametrize("fmt", ["timm", "lightning"])
def test_full_attention_weights_initialise_mita_with_dwc(tmp_path, fmt):
    full = _vit("full")
    state = full.state_dict()
    if fmt == "lightning":
        state = {"state_dict": {f"net.{k}": v for k, v in state.items()}, "global_step": 7}
    torch.save(state, tmp_path / "w.pth")
    net = _vit({"name": "mita", "m": 4, "k": 8, "dwc": True})
    loaded = load_init_weights(net, tmp_path / "w.pth")
    assert loaded["missing"] and all(".attn.dwc." in k for k in loaded["missing"])
    assert not loaded["unexpected"] and not loaded["skipped"]
    for key, value in full.state_dict().items():
        torch.testing.assert_close(net.state_dict()[key], value)


def test_other_head_needs_skip(tmp_path):
    torch.save(_vit("full", num_classes=7).state_dict(), tmp_path / "w.pth")
    net = _vit("mita")
    with pytest.raises(WeightsError, match=r"head\.weight .*init_weights_skip"):
        load_init_weights(net, tmp_path / "w.pth")
    loaded = load_init_weights(net, tmp_path / "w.pth", skip=["head."])
    assert loaded["skipped"] == ["head.bias", "head.weight"] and loaded["missing"] == ["head.bias", "head.weight"]
    with pytest.raises(WeightsError, match="is not a file"):
        load_init_weights(net, tmp_path / "nope.pth")
    torch.save({"a.b": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(WeightsError, match="no tensor"):
        load_init_weights(net, tmp_path / "other.pth")


SMOKE = ["debug=smoke", "data.num_train=16", "data.num_val=8", "data.num_test=8"]


def test_evaluate_mita_with_full_attention_weights(tmp_path, capsys):
    from hydra.utils import instantiate

    full_cfg = compose(["experiment=synthetic/shapes-full", *SMOKE])
    torch.save(instantiate(full_cfg.model).state_dict(), tmp_path / "full.pth")
    result = run_in_process(
        ["experiment=synthetic/shapes-mita", *SMOKE, "train=false", f"init_weights={tmp_path / 'full.pth'}"],
        tmp_path / "run",
    )
    assert "init_weights:" in capsys.readouterr().err
    saved = torch.load(tmp_path / "full.pth")
    net = result["trainer"].lightning_module.net
    for key, value in net.state_dict().items():
        torch.testing.assert_close(value, saved[key])
    record = json.loads(Path(result["record"]).read_text())
    assert 0.0 <= record["metrics"]["val/acc1"] <= 1.0 and record["steps"] == 0
    with pytest.raises(SystemExit) as exc:
        run_in_process(
            ["experiment=synthetic/shapes-mita", *SMOKE, f"init_weights={tmp_path / 'x.pth'}"], tmp_path / "r2"
        )
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(err) == 1 and "init_weights" in err[0]


def test_timm_vit_weights_into_segmenter_encoder_with_prefix(tmp_path):
    """A timm ViT state dict (no prefix, another grid) initialises Segmenter's encoder with prefix="encoder.":
    the position embedding is resampled by the encoder; a network that does not resample still refuses it."""
    import timm

    from mita.models.segmenter import create_segmenter

    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2)
    torch.save(vit.state_dict(), tmp_path / "vit.pth")
    seg = create_segmenter("vit_tiny", num_classes=3, img_size=64, decoder="linear", encoder_kwargs={"depth": 2})
    with pytest.raises(WeightsError):
        load_init_weights(seg, tmp_path / "vit.pth")
    loaded = load_init_weights(seg, tmp_path / "vit.pth", prefix="encoder.")
    assert set(loaded["unexpected"]) == {"encoder.head.weight", "encoder.head.bias"}
    assert all(k.startswith("decoder.") for k in loaded["missing"])
    torch.testing.assert_close(seg.encoder.blocks[1].attn.qkv.weight, vit.blocks[1].attn.qkv.weight)
    assert seg.encoder.pos_embed.shape[1] == 1 + 4 * 4
    # A classification ViT of another grid has no resampling hook: the shape mismatch is an error, as before.
    other = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2, img_size=64)
    with pytest.raises(WeightsError):
        load_init_weights(other, tmp_path / "vit.pth")
