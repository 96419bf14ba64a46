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


@pytest.fixture(scope="module")
def pathfinder_record() -> tuple[np.ndarray, np.ndarray, dict]:
    labels = np.arange(200) % 2
    imgs, record = pathfinder.make_batch(labels, np.random.default_rng(7))
    return labels, imgs, record


def test_pathfinder_markers_on_one_snake_iff_label_one(pathfinder_record) -> None:
    """The origin marker sits on a target snake's tail; the terminal marker on the head of the same snake for label
    1 and of the other snake for label 0. As in the reference (0.3% of its images), the second snake may end on the
    first one's head pixel (the first snake's newest paddle is not yet in the mask), which makes both true."""
    labels, _, rec = pathfinder_record
    rows = np.arange(len(labels))
    assert (rec["markers"][:, 0] == rec["tails"][rows, rec["origin"]]).all()
    same = (rec["markers"][:, 1] == rec["heads"][rows, rec["origin"]]).all(1)
    other = (rec["markers"][:, 1] == rec["heads"][rows, 1 - rec["origin"]]).all(1)
    shared = (rec["heads"][:, 0] == rec["heads"][:, 1]).all(1)
    assert shared.mean() < 0.02
    assert (same == (labels == 1))[~shared].all() and (other == (labels == 0))[~shared].all()
    assert (same | other).all()
    assert set(rec["origin"].tolist()) == {0, 1}


def test_pathfinder_first_tail_central_and_headings_up_left(pathfinder_record) -> None:
    """The first target tail is seeded inside the 2 x seed_distance band (the centre), with a heading of the few
    that the border rule keeps (all pointing up and left); the second tail is seed_distance away."""
    _, _, rec = pathfinder_record
    p = pathfinder.Params()
    tb = pathfinder._tables(p)
    first = rec["tails"][:, 0]
    lo, hi = 2 * p.seed_distance - 1, p.size - 2 * p.seed_distance
    assert ((first >= lo) & (first < hi)).all()
    allowed = set(np.concatenate([tb.first_tails[d] for d in tb.first_headings]).tolist())
    assert set((first[:, 0] * p.size + first[:, 1]).tolist()) <= allowed
    degrees = np.flatnonzero(tb.valid) - 180
    assert 10 <= len(degrees) <= 60 and ((degrees > -180) & (degrees < -90)).all()
    gap = np.linalg.norm(rec["tails"][:, 0] - rec["tails"][:, 1], axis=1)
    assert (np.abs(gap - p.seed_distance) <= 0.75).all()


def test_pathfinder_snakes_are_dashed(pathfinder_record) -> None:
    """Bright target ink (above half its peak) breaks into many pieces: each paddle is a separate dash, where a
    continuous pair of snakes would give one or two."""
    _, _, rec = pathfinder_record
    pieces = []
    for tgt in rec["targets"][:40]:
        labels = _components(tgt > 0.5 * tgt.max())
        pieces.append(labels.max())
    assert min(pieces) >= 5 and np.mean(pieces) >= 9


def test_pathfinder_contrasts(pathfinder_record) -> None:
    """Distractors (contrast 2) peak above the targets (1.5) in every image that has one, and there the markers
    (at most 1) are not the brightest pixels."""
    _, imgs, rec = pathfinder_record
    tgt = rec["targets"].reshape(len(imgs), -1).max(1)
    dis = rec["distractors"].reshape(len(imgs), -1).max(1)
    has = dis > 0
    assert 0.6 < has.mean() < 0.9
    assert (dis[has] > tgt[has]).all() and (tgt <= 1.5).all() and (dis <= 2.0).all()
    o = rec["markers"][:, 0]
    centre = imgs[np.arange(len(imgs)), o[:, 0], o[:, 1]]
    bright = dis > 1.0
    assert bright.sum() > 50 and (centre[bright] < 255).all()


def test_pathfinder_ink_fraction_near_the_reference(pathfinder_record) -> None:
    """Lanczos ringing inks about a third of the pixels (0.342 on the reference emulation's 3,000 images)."""
    _, imgs, _ = pathfinder_record
    assert 0.32 < (imgs > 0).mean() < 0.365
    assert imgs.dtype == np.uint8 and (imgs.reshape(len(imgs), -1).max(1) == 255).all()


def test_listops_first_operator_baseline_on_hand_written_splits(tmp_path: Path, capsys) -> None:
    # Train: MAX trees mostly give 9, MIN trees mostly 0, so the rule is MAX -> 9, MIN -> 0; majority label 9.
    train = [("( ( ( [MAX 2 ) 9 ) ] )", 9)] * 3 + [("( ( ( [MAX 2 ) 1 ) ] )", 2)]
    train += [("( ( ( [MIN 0 ) 4 ) ] )", 0)] * 2 + [("( ( ( [MIN 5 ) 4 ) ] )", 4)]
    test = [
        ("( ( ( [MAX 3 ) 9 ) ] )", 9),
        ("( ( ( [MIN 1 ) 2 ) ] )", 1),
        ("( ( ( [MIN 0 ) 3 ) ] )", 0),
        ("( ( ( [MAX 3 ) 4 ) ] )", 4),
    ]
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
