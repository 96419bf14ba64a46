"""ADE20K (Table C): the release loader, the Segmenter pipelines, mmseg's mIoU, and one step of every row."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.ade20k.data import (
    ADE20KDataModule,
    ADE20KLayoutError,
    SegmentationTrainTransform,
    reduce_zero_label,
    rescale_size,
)
from tasks.ade20k.fake import SMOKE_OVERRIDES, write_fake_ade20k, write_fake_weights
from tasks.common.config import compose
from tasks.common.experiments import list_experiments
from tasks.common.segmentation import SegmentationModule, scores_from_confusion
from tasks.common.testing import run_in_process

TABLE_C = list_experiments("C")
ENV = ("MITA_VIT_S_WEIGHTS", "MITA_VIT_T_WEIGHTS")
SMOKE = ["debug=smoke", *SMOKE_OVERRIDES, "logger=none"]


@pytest.fixture(autouse=True)
def _no_weights_env(monkeypatch):
    # The rows read their weights from these variables when set; the tests pass init_weights themselves.
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory) -> Path:
    return write_fake_ade20k(tmp_path_factory.mktemp("ade20k"))


@pytest.fixture(scope="module")
def encoder_weights(tmp_path_factory) -> dict[str, Path]:
    """Smoke-sized full-attention encoder weights per backbone (a timm ViT state dict under ``encoder.``)."""
    folder = tmp_path_factory.mktemp("weights")
    torch.manual_seed(1)
    return {size: write_fake_weights(folder / f"vit_{size}.pth", f"ade20k/vit_{size}-cbt-full") for size in "st"}


def test_table_c_has_every_row():
    rows = {f"ade20k/vit_{s}-{d}" for s in "st" for d in ("cbt-full", "cbt-mita", "mask-full")}
    assert set(TABLE_C) == rows
    values = {name: compose([f"experiment={name}"]).paper.value for name in TABLE_C}
    assert values == {
        "ade20k/vit_s-cbt-full": 45.8,
        "ade20k/vit_s-cbt-mita": 44.5,
        "ade20k/vit_s-mask-full": 45.3,
        "ade20k/vit_t-cbt-full": None,
        "ade20k/vit_t-cbt-mita": None,
        "ade20k/vit_t-mask-full": 38.1,
    }


def test_recipe():
    cfg = compose(["experiment=ade20k/vit_s-cbt-mita"])
    assert cfg.requires_init_weights and cfg.init_weights is None
    assert dict(cfg.model.attention)["m"] == dict(cfg.model.attention)["k"] == 49
    assert cfg.model.attention.landmark_layout == "official" and cfg.model.decoder == "cbt"
    assert cfg.optimizer.name == "momentum" and cfg.optimizer.lr == 1e-3 and cfg.optimizer.weight_decay == 0
    assert cfg.scheduler.name == "poly" and cfg.scheduler.power == 0.9 and cfg.scheduler.min_lr == 1e-5
    assert cfg.trainer.max_epochs == 64 and cfg.trainer.check_val_every_n_epoch == 2 and cfg.data.batch_size == 8
    assert list(cfg.data.mean) == list(cfg.data.std) == [0.5, 0.5, 0.5] and cfg.model.drop_path_rate == 0.1
    assert cfg.report.key == cfg.eval_monitor == "val/mIoU"
    assert compose(["experiment=ade20k/vit_t-mask-full"]).model.decoder == "mask_transformer"


def test_poly_schedule_is_mmseg_poly():
    from tasks.common.optim import build_scheduler

    cfg = compose(["experiment=ade20k/vit_s-cbt-full"])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(cfg.optimizer.lr))
    sched = build_scheduler(opt, dict(cfg.scheduler), total_steps=100, steps_per_epoch=10)
    lrs = []
    for _ in range(101):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # mmseg: (base - min) * (1 - t / T) ** 0.9 + min, no warm-up.
    expected = [(1e-3 - 1e-5) * (1 - t / 100) ** 0.9 + 1e-5 for t in range(101)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-9, atol=1e-12)


def test_reduce_zero_label():
    label = np.array([[0, 1, 2], [150, 0, 75]], dtype=np.uint8)
    np.testing.assert_array_equal(reduce_zero_label(label), [[255, 0, 1], [149, 255, 74]])


def test_rescale_size_is_mmseg_keep_ratio():
    assert rescale_size(683, 512, (2048, 512)) == (683, 512)
    assert rescale_size(640, 480, (2048, 512)) == (683, 512)
    # Very wide images stop at the long edge.
    assert rescale_size(5000, 500, (2048, 512)) == (2048, 205)


def test_loader_reads_the_release(fake_root):
    dm = ADE20KDataModule(str(fake_root), crop_size=32, scale=(128, 32), batch_size=2, num_workers=0, pin_memory=False)
    dm.setup("fit")
    assert len(dm.train_set) == 4 and len(dm.val_set) == 2
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (2, 32, 32) and y.dtype == torch.int64
    assert set(y.unique().tolist()) <= set(range(150)) | {255}
    xv, yv = next(iter(dm.val_dataloader()))
    # Validation: the image resized so its shorter side is 32; the label kept at the release's resolution.
    raw = np.asarray(Image.open(fake_root / "annotations" / "validation" / "ADE_val_00000001.png"))
    assert yv.shape == (1, *raw.shape) and min(xv.shape[-2:]) == 32
    assert xv.shape[-2:] == rescale_size(raw.shape[1], raw.shape[0], (128, 32))[::-1]
    np.testing.assert_array_equal(yv[0].numpy(), reduce_zero_label(raw))
    assert (yv == 255).any() and (yv == 149).any() and not ((yv > 149) & (yv < 255)).any()
    # mean = std = 0.5: pixels in [-1, 1].
    assert xv.min() >= -1 and xv.max() <= 1


def test_train_transform_pads_with_ignore_and_flips_labels_with_pixels():
    image = Image.fromarray(np.tile(np.arange(20, dtype=np.uint8)[None, :, None] * 10, (10, 1, 3)))
    label = np.tile(np.arange(20, dtype=np.uint8)[None, :], (10, 1))
    # A fixed ratio of 1 into (40, 10): the image keeps its 10 x 20 size, smaller than the 16 crop in height.
    transform = SegmentationTrainTransform(
        crop_size=16, scale=(40, 10), ratio_range=(1, 1), cat_max_ratio=1.0, hflip=0.5, photometric=False
    )
    flips = set()
    for seed in range(8):
        x, y = transform(image, label, random.Random(seed))
        assert x.shape == (3, 16, 16) and y.shape == (16, 16)
        assert (y[10:] == 255).all() and (x[:, 10:] == 0).all() and (y[:10] != 255).all()
        # The label still matches the pixels it came with (pixel value = 10 x class), flipped or not.
        torch.testing.assert_close((x[0, :10] * 127.5 + 127.5) / 10, y[:10].float())
        flips.add(bool(y[0, 0] > y[0, -1]))
    assert flips == {True, False}


def test_photometric_distortion_keeps_the_range():
    from tasks.ade20k.data import photometric_distortion

    image = np.random.default_rng(0).uniform(0, 255, size=(8, 9, 3)).astype(np.float32)
    changed = 0
    for seed in range(6):
        out = photometric_distortion(image.copy(), random.Random(seed))
        assert out.shape == image.shape and out.min() >= 0 and out.max() <= 255
        changed += not np.allclose(out, image)
    assert changed >= 4


def test_bad_root_is_a_one_line_error(tmp_path, capsys, encoder_weights):
    (tmp_path / "images").mkdir()
    with pytest.raises(ADE20KLayoutError, match="ADEChallengeData2016 release"):
        ADE20KDataModule(str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        weights = f"init_weights={encoder_weights['s']}"
        run_in_process(["experiment=ade20k/vit_s-cbt-full", *SMOKE, f"data.root={tmp_path}", weights], tmp_path / "run")
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("config error")]
    assert len(err) == 1 and "is not the ADEChallengeData2016 release" in err[0]


def test_scores_on_a_hand_made_confusion():
    # Rows = labels, columns = predictions. Class 2 is neither labelled nor predicted: left out of the mean.
    confusion = torch.tensor([[2, 1, 0], [0, 3, 0], [0, 0, 0]])
    scores = scores_from_confusion(confusion)
    assert scores["mIoU"].item() == pytest.approx((2 / 3 + 3 / 4) / 2)
    assert scores["mAcc"].item() == pytest.approx((2 / 3 + 1) / 2)
    assert scores["aAcc"].item() == pytest.approx(5 / 6)
    # A class predicted but never labelled has IoU 0 and counts in the mean (mmseg).
    scores = scores_from_confusion(torch.tensor([[2, 1], [0, 0]]))
    assert scores["mIoU"].item() == pytest.approx((2 / 3 + 0) / 2)


def test_module_metrics_ignore_255_and_accumulate_over_images():
    class Oracle(torch.nn.Module):
        # Predicts the class written in the first channel of each pixel (windows see pixels, not positions).
        num_classes = 3

        def forward(self, images):
            return torch.nn.functional.one_hot(images[:, 0].long(), 3).permute(0, 3, 1, 2).float()

    module = SegmentationModule(Oracle(), num_classes=3, optimizer={"name": "sgd", "lr": 0.1}, window=4, stride=4)
    labels = torch.zeros(1, 4, 8, dtype=torch.int64)
    labels[..., 4:] = 1
    labels[..., 0, :] = 255  # ignored: whatever the prediction there
    labels[..., 1, 4:] = 0  # 4 wrong pixels of class 0 predicted as 1
    images = torch.zeros(1, 3, 4, 8)
    images[:, :, :, 4:] = 1  # predicted: class 0 on the left half, class 1 on the right half
    for _ in range(2):
        module._eval_step((images, labels), "val")
    confusion = module.confusion["val"].compute()
    torch.testing.assert_close(confusion, torch.tensor([[24, 8, 0], [0, 16, 0], [0, 0, 0]]))
    assert scores_from_confusion(confusion)["mIoU"].item() == pytest.approx((24 / 32 + 16 / 24) / 2)


def test_multi_scale_flip_averages_softmax_over_views():
    """Multi-scale + flip evaluation is the log of the mean softmax over (scale, flip) views, each view's
    sliding-window logits flipped back and upsampled to the label size; single scale returns the logits."""
    from mita.models.segmenter import sliding_window_logits

    torch.manual_seed(0)
    net = torch.nn.Conv2d(3, 4, (1, 3), padding=(0, 1))  # not mirror-symmetric: a missing flip-back shows
    opt = {"name": "sgd", "lr": 0.1}
    images = torch.randn(1, 3, 8, 12)
    size = (16, 24)

    def up(x):
        return torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False)

    def window(x):
        return sliding_window_logits(net, x, 4, 4, 4)

    with torch.no_grad():
        single = SegmentationModule(net, num_classes=4, optimizer=opt, window=4, stride=4)
        torch.testing.assert_close(single.predict_logits(net, images, size), up(window(images)))
        multi = SegmentationModule(net, num_classes=4, optimizer=opt, window=4, stride=4, scales=[0.5, 1.5], flip=True)
        views = []
        for scale in (0.5, 1.5):
            x = torch.nn.functional.interpolate(images, scale_factor=scale, mode="bilinear", align_corners=False)
            views += [up(window(x)).softmax(1), up(window(x.flip(-1)).flip(-1)).softmax(1)]
        assert not torch.allclose(views[0], views[1], atol=1e-3)
        want = torch.stack(views).mean(0).log()
        torch.testing.assert_close(multi.predict_logits(net, images, size), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="task.scales"):
        SegmentationModule(net, num_classes=4, optimizer=opt, scales=[])


@pytest.mark.parametrize("experiment", TABLE_C)
def test_every_table_c_row_runs(experiment, fake_root, encoder_weights, tmp_path):
    size = experiment.split("vit_")[1][0]
    weights = encoder_weights[size]
    no_ckpt = ["~callbacks.checkpoint", "save_final_checkpoint=false"]
    result = run_in_process(
        [f"experiment={experiment}", *SMOKE, *no_ckpt, f"data.root={fake_root}", f"init_weights={weights}"],
        tmp_path / "run",
    )
    assert result["global_step"] == 1
    record = json.loads(Path(result["record"]).read_text())
    assert record["smoke"] is True and record["paper"]["table"] == "C"
    metrics = record["metrics"]
    assert np.isfinite(metrics["val/loss"]) and 0 <= metrics["val/mIoU"] <= 1 and 0 <= metrics["val/aAcc"] <= 1
    net = result["trainer"].lightning_module.net
    attention = record["config"]["model"]["attention"]
    layer = net.encoder.blocks[0].attn
    assert type(layer).attention_name == attention["name"] and len(net.encoder.blocks) == 1
    if attention["name"] == "mita":
        assert (layer.m, layer.topk) == (49, 49)
    decoder = {"cbt": "CBTDecoder", "mask_transformer": "MaskTransformerDecoder"}[record["config"]["model"]["decoder"]]
    assert type(net.decoder).__name__ == decoder
    # Fine-tuning starts from the encoder weights: one SGD step at lr 1e-3 moves them only a little.
    saved = torch.load(weights)
    assert all(key.startswith("encoder.") for key in saved)
    key = "encoder.blocks.0.attn.qkv.weight"
    moved = (net.state_dict()[key] - saved[key]).abs().max().item()
    assert 0 < moved < 1e-2


def test_missing_init_weights_is_a_one_line_error(fake_root, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_in_process(["experiment=ade20k/vit_t-cbt-mita", *SMOKE, f"data.root={fake_root}"], tmp_path / "r")
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(err) == 1 and err[0].startswith("config error: init_weights:")


@pytest.mark.gpu
@pytest.mark.parametrize("experiment", ["ade20k/vit_s-cbt-full", "ade20k/vit_s-cbt-mita"])
def test_full_size_rows_train_on_the_gpu(experiment, tmp_path):
    """The recipe's real shapes (512 crops, 12 blocks, batch 8, bf16, sliding-window validation at 512) for a few
    steps on the GPU with the fastest attention backend; the losses and scores are finite."""
    from hydra.utils import instantiate

    root = write_fake_ade20k(tmp_path / "data", sizes=((384, 512), (512, 384)))
    weights = tmp_path / "w.pth"
    encoder = instantiate(compose(["experiment=ade20k/vit_s-cbt-full"]).model).encoder
    torch.save({f"encoder.{k}": v for k, v in encoder.state_dict().items()}, weights)
    result = run_in_process(
        [
            f"experiment={experiment}",
            "debug=smoke",
            "logger=none",
            "~model.depth",
            "trainer.accelerator=gpu",
            "trainer.precision=bf16-mixed",
            "trainer.max_steps=12",
            "data.batch_size=4",
            "data.photometric=false",
            f"data.root={root}",
            f"init_weights={weights}",
            "~callbacks.checkpoint",
            "save_final_checkpoint=false",
        ],
        tmp_path / "run",
    )
    assert result["global_step"] == 12
    metrics = result["metrics"]
    assert np.isfinite(metrics["val/loss"]) and 0 <= metrics["val/mIoU"] <= 1
    net = result["trainer"].lightning_module.net
    assert len(net.encoder.blocks) == 12 and net.encoder.blocks[0].attn.grid_size == (32, 32)
