"""The ListOps and Pathfinder generators write real data in the LRA release formats."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from script_loader import load_prepare_script

ROOT = Path(__file__).resolve().parents[2]


listops = load_prepare_script("listops")
pathfinder = load_prepare_script("pathfinder")


def _eval_tokens(source: str) -> tuple[int, int]:
    """Independent evaluator over the tokenised form (the one the data module sees): value and length."""
    tokens = source.replace("(", " ").replace(")", " ").split()
    stack: list[list] = []
    result = None
    for tok in tokens:
        if tok.startswith("["):
            stack.append([tok])
        elif tok == "]":
            op, *vals = stack.pop()
            value = {
                "[MIN": min,
                "[MAX": max,
                "[MED": lambda v: int(statistics.median(v)),
                "[SM": lambda v: sum(v) % 10,
            }[op](vals)
            if stack:
                stack[-1].append(value)
            else:
                result = value
        else:
            if stack:
                stack[-1].append(int(tok))
            else:
                result = int(tok)
    assert not stack
    return result, len(tokens)


@pytest.fixture(scope="module")
def listops_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("listops")
    listops.main(["--out", str(out), "--train", "60", "--val", "10", "--test", "10", "--seed", "3", "--no-progress"])
    return out


def test_listops_files_labels_lengths_dedup(listops_dir: Path) -> None:
    sources = []
    for split, n in (("train", 60), ("val", 10), ("test", 10)):
        lines = (listops_dir / f"basic_{split}.tsv").read_text().splitlines()
        assert lines[0] == "Source\tTarget"
        assert len(lines) == n + 1
        for line in lines[1:]:
            source, target = line.split("\t")
            value, length = _eval_tokens(source)
            assert int(target) == value
            assert 500 < length < 2000
            assert source.startswith("( ") and source.endswith(" )")
            sources.append(source)
    assert len(set(sources)) == len(sources)


def test_listops_deterministic_across_workers() -> None:
    a = listops.generate(12, seed=5, min_length=20, max_length=400, workers=1, progress=False)
    b = listops.generate(12, seed=5, min_length=20, max_length=400, workers=2, progress=False)
    c = listops.generate(12, seed=6, min_length=20, max_length=400, workers=1, progress=False)
    assert a == b
    assert a != c


def test_listops_operators_and_written_form() -> None:
    tree = ("[MED", [2, ("[SM", [9, 8]), 4, 1])
    assert listops.evaluate(tree) == int(statistics.median([2, 7, 4, 1]))
    assert listops.to_string(("[MAX", [2, 9])) == "( ( ( [MAX 2 ) 9 ) ] )"
    assert listops.parse(listops.to_string(tree)) == tree
    rng = random.Random(0)
    for _ in range(200):
        t, length = listops.generate_tree(rng)
        assert _eval_tokens(listops.to_string(t)) == (listops.evaluate(t), length)


@pytest.fixture(scope="module")
def pathfinder_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pathfinder32")
    pathfinder.main(
        ["--out", str(out), "--n", "24", "--per-batch", "10", "--seed", "1", "--workers", "1", "--no-progress"]
    )
    return out / "curv_contour_length_14"


def test_pathfinder_layout_metadata_balance(pathfinder_dir: Path) -> None:
    meta = sorted((pathfinder_dir / "metadata").iterdir())
    assert [m.name for m in meta] == ["0.npy", "1.npy", "2.npy"]
    labels = []
    for m in meta:
        # TEXT despite the .npy suffix, as in the release.
        lines = m.read_text().splitlines()
        per_batch = []
        for line in lines:
            fields = line.split()
            assert fields[0] == f"imgs/{m.stem}"
            assert fields[1] == f"sample_{fields[2]}.png"
            assert fields[3] in ("0", "1")
            assert fields[5] == "14"
            per_batch.append(int(fields[3]))
            img = Image.open(pathfinder_dir / fields[0] / fields[1])
            assert img.mode == "L" and img.size == (32, 32)
            arr = np.asarray(img)
            assert arr.max() == 255 and arr.min() == 0
        assert abs(sum(per_batch) * 2 - len(per_batch)) <= 1
        labels += per_batch
    assert len(labels) == 24 and sum(labels) == 12


def _components(mask: np.ndarray) -> np.ndarray:
    """8-connected component labels of a bool image (0 = background)."""
    labels = np.zeros(mask.shape, dtype=int)
    current = 0
    for start in zip(*np.nonzero(mask)):
        if labels[start]:
            continue
        current += 1
        stack = [start]
        labels[start] = current
        while stack:
            y, x = stack.pop()
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not labels[ny, nx]:
                        labels[ny, nx] = current
                        stack.append((ny, nx))
    return labels


def test_pathfinder_label_one_connects_the_markers() -> None:
    """With label 1 both markers lie on one connected curve of the rendered image."""
    p = pathfinder.Params()
    for seed in range(6):
        img = pathfinder.make_image(1, np.random.default_rng(seed), p)
        assert img.shape == (32, 32) and img.dtype == np.uint8
        comps = _components(img > 10)
        # Marker centres are the only pixels at full brightness.
        marker_comps = set(comps[img == 255].tolist())
        assert len(marker_comps) == 1 and 0 not in marker_comps


def test_pathfinder_same_files_whatever_the_workers(tmp_path: Path) -> None:
    """A batch is drawn from its own seeded stream: 1 and 2 processes write byte-identical files."""
    roots = []
    for name, workers, seed in (("one", 1, 4), ("two", 2, 4), ("other", 1, 5)):
        args = ["--out", str(tmp_path / name), "--n", "20", "--per-batch", "5", "--seed", str(seed)]
        pathfinder.main([*args, "--workers", str(workers), "--no-progress"])
        root = tmp_path / name / "curv_contour_length_14"
        roots.append({str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()})
    one, two, other = roots
    assert len(one) == 20 + 4
    assert one == two
    assert one.keys() == other.keys() and one != other


def _reaches(ink: np.ndarray, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether an 8-connected path through ``ink > 0`` joins pixels a and b."""
    comps = _components(ink > 0)
    assert comps[a] and comps[b]
    return bool(comps[a] == comps[b])


@pytest.mark.parametrize("distractors", [False, True])
def test_pathfinder_markers_on_one_snake_iff_label_one(distractors: bool) -> None:
    """On the high-resolution ink without the marker discs, the two marker pixels are joined for label 1 and never
    for label 0 (every stroke keeps ``margin`` away from the other snakes' strokes)."""
    p = pathfinder.Params()
    for seed in range(8):
        u = pathfinder.Uniforms(np.random.default_rng([seed, 7]))
        for label in (0, 1):
            segs, markers = pathfinder.layout(label, u, p, distractors=distractors)
            ink = pathfinder.render(segs, (), p)
            assert ink.shape == (64, 64) and ink.max() == 1.0
            a, b = (pathfinder.pixel(m, p) for m in markers)
            assert _reaches(ink, a, b) == (label == 1)


def test_pathfinder_statistics_match_the_reference_generator() -> None:
    """Snake counts and image statistics stay where the first (full-canvas distance field) generator had them:
    on 500 images of seed 0 it gave mean ink fraction (pixels > 0) 0.1751 (per-image sd 0.0065) and mean pixel
    value 15.87 (sd 0.19); the bands are about 20 standard errors of a 400-image mean wide on each side."""
    p = pathfinder.Params()
    u = pathfinder.Uniforms(np.random.default_rng(11))
    ink, value, distractors = [], [], []
    for i in range(400):
        segs, markers = pathfinder.layout(i % 2, u, p)
        extra = len(segs) - 2 * p.contour_length
        assert extra % p.distractor_length == 0 and 0 <= extra <= p.num_distractors * p.distractor_length
        distractors.append(extra // p.distractor_length)
        img = pathfinder.make_image(i % 2, u, p)
        ink.append((img > 0).mean())
        value.append(img.mean())
    assert 0.168 < np.mean(ink) < 0.182
    assert 15.6 < np.mean(value) < 16.3
    assert np.mean(distractors) > 4.0


def test_listops_first_operator_baseline_on_hand_written_splits(tmp_path: Path, capsys) -> None:
    # Train: MAX trees mostly give 9, MIN trees mostly 0, so the rule is MAX -> 9, MIN -> 0; majority label 9.
    train = [("( ( ( [MAX 2 ) 9 ) ] )", 9)] * 3 + [("( ( ( [MAX 2 ) 1 ) ] )", 2)]
    train += [("( ( ( [MIN 0 ) 4 ) ] )", 0)] * 2 + [("( ( ( [MIN 5 ) 4 ) ] )", 4)]
    test = [("( ( ( [MAX 3 ) 9 ) ] )", 9), ("( ( ( [MIN 1 ) 2 ) ] )", 1), ("( ( ( [MIN 0 ) 3 ) ] )", 0),
            ("( ( ( [MAX 3 ) 4 ) ] )", 4)]
    listops.write_tsv(tmp_path / "basic_train.tsv", train)
    listops.write_tsv(tmp_path / "basic_test.tsv", test)
    stats = listops.first_operator_baseline(tmp_path)
    assert set(stats) == {"train", "test"}
    assert stats["train"] == {"n": 7, "first_operator": 5 / 7, "majority": 3 / 7}
    assert stats["test"] == {"n": 4, "first_operator": 2 / 4, "majority": 1 / 4}
    listops.main(["--out", str(tmp_path), "--baseline"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["test", "n=", "4", "first-operator", "rule", "50.00%", "majority", "class", "25.00%"]
    # The JSON record feeds Table D's ListOps note (scripts/make_tables.py).
    listops.main(["--out", str(tmp_path), "--baseline", "--baseline-json", str(tmp_path / "rule.json")])
    rec = json.loads((tmp_path / "rule.json").read_text())
    assert rec["splits"] == stats and "--baseline-json" in rec["command"]


def test_pathfinder_cnn_check_reads_the_split_and_reports(pathfinder_dir: Path, capsys) -> None:
    cnn = load_prepare_script("pathfinder_cnn")
    parts = cnn.PathfinderDataModule(str(pathfinder_dir), seed=0, zero_is_padding=False).load()
    x, y = cnn.images(parts["val"], torch.device("cpu"))
    # Tokens are pixel + 1; the check sees grey levels in [0, 1] with the background at 0 and some ink at 1.
    assert x.shape == (len(parts["val"]), 1, 32, 32) and x.min() == 0.0 and x.max() == 1.0
    assert set(y.tolist()) <= {0, 1}
    assert cnn.make_cnn(width=8, depth=3)(x).shape == (len(y), 2)
    cnn.main(["--root", str(pathfinder_dir), "--seconds", "0.5", "--batch", "8", "--eval-every", "1"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["val"] == len(parts["val"]) and report["train"] == len(parts["train"]) and report["steps"] >= 1
    assert 0.0 <= report["best_val_acc"] <= 1.0 and report["history"][0][0] == 1
