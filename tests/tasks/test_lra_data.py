"""LRA and arXiv data modules read each release format and carry right-padded tokens with padding masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.arxiv.data import ARXIV_LABELS, ArxivDataModule
from tasks.lra.data import (
    LISTOPS_VOCAB,
    PAD,
    ImageDataModule,
    ListOpsDataModule,
    PathfinderDataModule,
    RetrievalDataModule,
    TextDataModule,
    listops_tokens,
    pad_batch,
    rgb_to_gray,
)
from tasks.lra.fake import (
    write_aan,
    write_arxiv_parquet,
    write_arxiv_raw,
    write_cifar,
    write_imdb,
    write_imdb_parquet,
    write_listops,
    write_pathfinder,
)


def test_listops_tokens_and_batches(tmp_path) -> None:
    assert listops_tokens("( ( ( [MAX 2 ) 9 ) ] )").tolist() == [
        LISTOPS_VOCAB["[MAX"],
        LISTOPS_VOCAB["2"],
        LISTOPS_VOCAB["9"],
        LISTOPS_VOCAB["X"],
    ]
    dm = ListOpsDataModule(str(write_listops(tmp_path / "listops-1000")), max_length=12, batch_size=4)
    batch = next(iter(dm.val_dataloader()))
    assert batch["x"].shape == (4, 12) and batch["key_padding_mask"].dtype == torch.bool
    assert batch["label"].tolist() == [9, 1, 3, 7]
    # Right padding: the mask is True exactly where the token is padding, after the valid prefix.
    assert batch["key_padding_mask"][0].tolist() == [False] * 4 + [True] * 8
    # (shortest, longest) valid count of the rows, Python ints counted on the CPU: the encoder's cut needs no sync.
    counts = (~batch["key_padding_mask"]).sum(1).tolist()
    assert batch["valid_lengths"] == (min(counts), max(counts)) and min(counts) < max(counts)
    assert all(type(n) is int for n in batch["valid_lengths"])
    assert (batch["x"][batch["key_padding_mask"]] == 0).all() and (batch["x"][~batch["key_padding_mask"]] > 0).all()
    dm_batch = ListOpsDataModule(str(tmp_path / "listops-1000"), batch_size=4, pad_to="batch")
    assert next(iter(dm_batch.val_dataloader()))["x"].shape == (4, 8)
    assert dm.num_classes == 10 and dm.vocab_size == 16


def test_loaders_pin_batches_only_where_cuda_is(tmp_path, monkeypatch) -> None:
    root = str(write_listops(tmp_path / "listops-1000"))
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda c=cuda: c)
        assert ListOpsDataModule(root, batch_size=4).train_dataloader().pin_memory is cuda
        assert ListOpsDataModule(root, batch_size=4, pin_memory=False).val_dataloader().pin_memory is False


def test_text_imdb_folders_and_parquet(tmp_path) -> None:
    dm = TextDataModule(str(write_imdb(tmp_path / "imdb")), max_length=64, batch_size=2, val_fraction=0.25, seed=1)
    dm.setup()
    assert len(dm.datasets["train"]) + len(dm.datasets["val"]) == 12 and len(dm.datasets["val"]) == 3
    assert len(dm.datasets["test"]) == 12
    tokens, label = dm.datasets["test"][0]
    # neg files come first; bytes + 1, and the UTF-8 "é" is two bytes.
    assert label == 0 and bytes((tokens - 1).astype(np.uint8).tolist()).decode().startswith("neg review 0: caf\u00e9")
    dm2 = TextDataModule(str(tmp_path / "imdb"), max_length=64, val_fraction=0.25, seed=1)
    dm2.setup()
    assert [len(t) for t in dm2.datasets["val"].tokens] == [len(t) for t in dm.datasets["val"].tokens]
    pq_dm = TextDataModule(str(write_imdb_parquet(tmp_path / "hf")), max_length=64, val_fraction=0.0, batch_size=6)
    batch = next(iter(pq_dm.val_dataloader()))
    assert batch["label"].tolist() == [0, 1, 0, 1, 0, 1] and batch["x"].shape == (6, 64)


def test_retrieval_pairs_keep_order(tmp_path) -> None:
    dm = RetrievalDataModule(str(write_aan(tmp_path / "aan")), max_length=32, batch_size=3)
    batch = next(iter(dm.test_dataloader()))
    assert set(batch) == {
        "x",
        "key_padding_mask",
        "valid_lengths",
        "x2",
        "key_padding_mask2",
        "valid_lengths2",
        "label",
    }
    for mask, lengths in ((batch["key_padding_mask"], batch["valid_lengths"]),
                          (batch["key_padding_mask2"], batch["valid_lengths2"])):  # fmt: skip
        counts = (~mask).sum(1).tolist()
        assert lengths == (min(counts), max(counts))
    assert batch["label"].tolist() == [0, 1, 0]
    first = bytes((batch["x"][1][~batch["key_padding_mask"][1]] - 1).tolist()).decode()
    second = bytes((batch["x2"][1][~batch["key_padding_mask2"][1]] - 1).tolist()).decode()
    assert first.startswith("first document 1") and second == "second 1"


@pytest.mark.parametrize("zero_is_padding", [True, False])
def test_image_cifar_grayscale_tokens(tmp_path, zero_is_padding: bool) -> None:
    root = str(write_cifar(tmp_path / "cifar"))
    dm = ImageDataModule(root, val_size=4, batch_size=2, zero_is_padding=zero_is_padding)
    dm.setup()
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [16, 4, 4]
    batch = next(iter(dm.test_dataloader()))
    assert batch["x"].shape == (2, 1024)
    import pickle

    with open(tmp_path / "cifar" / "cifar-10-batches-py" / "test_batch", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    rgb = raw[b"data"][0].reshape(3, 32, 32).transpose(1, 2, 0)
    gray = torch.from_numpy(rgb_to_gray(rgb).reshape(-1).astype(np.int64))
    # The ports' rule: a pixel's token is its value and black pixels are padding; else every pixel is value + 1.
    assert torch.equal(batch["x"][0], gray if zero_is_padding else gray + 1)
    assert torch.equal(batch["key_padding_mask"][0], gray == 0 if zero_is_padding else torch.zeros(1024, dtype=bool))
    assert batch["label"][0].item() == raw[b"labels"][0]


def test_pathfinder_skips_empty_image_and_splits(tmp_path) -> None:
    dm = PathfinderDataModule(str(write_pathfinder(tmp_path / "pathfinder32", n=21)), batch_size=4, seed=0)
    dm.setup()
    assert dm.skipped == ["imgs/0/sample_3.png"]
    sizes = [len(dm.datasets[s]) for s in ("train", "val", "test")]
    assert sizes == [16, 2, 2]
    batch = next(iter(dm.val_dataloader()))
    assert batch["x"].shape == (2, 1024)
    # Black pixels are padding (the ports' rule); the ink and the markers are tokens at their own positions.
    assert batch["key_padding_mask"].any(dim=1).all() and (~batch["key_padding_mask"]).any(dim=1).all()
    assert torch.equal(batch["key_padding_mask"], batch["x"] == 0)
    dense = PathfinderDataModule(str(tmp_path / "pathfinder32"), seed=0, zero_is_padding=False)
    dense.setup()
    torch.testing.assert_close(dense.datasets["val"].tokens, dm.datasets["val"].tokens + 1)
    other = PathfinderDataModule(str(tmp_path / "pathfinder32"), seed=1)
    other.setup()
    assert not torch.equal(other.datasets["val"].tokens, dm.datasets["val"].tokens)


def test_pathfinder_binarize_thresholds_the_grey_levels(tmp_path) -> None:
    root = str(write_pathfinder(tmp_path / "pathfinder32", n=21))
    grey = PathfinderDataModule(root, seed=0, zero_is_padding=False)
    grey.setup()
    two = PathfinderDataModule(root, seed=0, binarize=0.3, zero_is_padding=False)
    two.setup()
    g, b = grey.datasets["train"].tokens, two.datasets["train"].tokens
    assert set(b.unique().tolist()) <= {1, 256}
    # Same images in the same order: ink exactly where the grey image is above 0.3 x 255.
    assert torch.equal(b == 256, (g - 1) > 0.3 * 255)
    with pytest.raises(ValueError, match="binarize"):
        PathfinderDataModule(root, binarize=1.5)


def test_arxiv_raw_no_ref_and_subset(tmp_path) -> None:
    root = write_arxiv_raw(tmp_path / "arxiv")
    dm = ArxivDataModule(str(root), max_length=256, classes="all11", no_ref=True, batch_size=6)
    dm.setup()
    text = bytes((dm.datasets["train"].tokens[0] - 1).astype(np.uint8).tolist()).decode()
    assert "cs.AI" not in text and text.startswith("Paper 0 [] about")
    assert dm.datasets["train"].labels[:2] == [ARXIV_LABELS.index("cs.AI"), ARXIV_LABELS.index("math.AC")]
    kept = ArxivDataModule(str(root), max_length=256, no_ref=False)
    kept.setup()
    assert "cs.AI" in bytes((kept.datasets["train"].tokens[0] - 1).astype(np.uint8).tolist()).decode()
    sub = ArxivDataModule(str(root), max_length=256, classes="subset4")
    sub.setup()
    assert sub.num_classes == 4
    # cs.AI, math.AC, cs.NE, math.GR are kept (cs.CV and math.ST dropped) and renumbered in subset order.
    assert sub.datasets["train"].labels == [0, 2, 1, 3]
    batch = next(iter(dm.train_dataloader()))
    assert batch["x"].shape == (6, 256)


def test_arxiv_parquet_export(tmp_path) -> None:
    dm = ArxivDataModule(str(write_arxiv_parquet(tmp_path / "hf")), max_length=16384, batch_size=2)
    dm.setup()
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [6, 6, 6]
    assert dm.num_classes == 11
    batch = next(iter(dm.val_dataloader()))
    assert batch["x"].shape == (2, 16384)
    assert batch["key_padding_mask"][:, 400:].all() and not batch["key_padding_mask"][:, :300].any()


def test_missing_root_raises(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        ListOpsDataModule(str(tmp_path / "nowhere")).setup()


@pytest.mark.parametrize("length", [None, 3, 6])
def test_pad_batch_pads_truncates_and_marks_padding(length):
    seqs = [np.array([5, 6, 7, 8]), torch.tensor([9, 10], dtype=torch.int16), np.array([11, 12, 13, 14, 15])]
    tokens, mask = pad_batch(seqs, length)
    width = length or 5
    assert tokens.dtype == torch.long and tokens.shape == (3, width)
    for row, seq in zip(tokens.tolist(), seqs, strict=True):
        kept = [int(v) for v in seq[:width]]
        assert row == kept + [PAD] * (width - len(kept))
    assert torch.equal(mask, tokens == PAD)


def test_pad_batch_of_equal_length_rows_is_their_stack():
    rows = torch.randint(0, 256, (4, 8), dtype=torch.int16)
    tokens, mask = pad_batch(list(rows), 8)
    assert tokens.dtype == torch.long and torch.equal(tokens, rows.long()) and torch.equal(mask, rows == 0)
    tokens, _ = pad_batch(list(rows), 5)
    assert torch.equal(tokens, rows[:, :5].long())
