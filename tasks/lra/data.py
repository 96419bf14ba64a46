"""Long Range Arena data: the five tasks read from the google-research ``lra_release`` files on local disk.

Every example becomes a right-padded token sequence with a padding mask (True = padding) that the encoder
carries to every attention layer. Token 0 is padding in every task; real tokens start at 1. The pixel tasks
(Image, Pathfinder) follow the PyTorch ports' rule by default: a pixel's token is its 8-bit value, so black pixels
(value 0) are padding too (``zero_is_padding``); the encoder then attends among the other pixels only, each at
its own position (mita.models.lra).

| task | files under ``root`` | tokens |
| ListOps | ``basic_{train,val,test}.tsv`` (header ``Source<TAB>Target``) | 15-symbol vocabulary |
| Text | ``aclImdb/{train,test}/{pos,neg}/*.txt`` or ``{train,test}*.parquet`` (text, label) | bytes |
| Retrieval | ``new_aan_pairs.{train,eval,test}.tsv`` (label, id1, id2, text1, text2) | bytes, two documents |
| Image | ``cifar-10-batches-py/{data_batch_1..5,test_batch}`` | grayscale 8-bit pixels |
| Pathfinder | ``curv_contour_length_14/{imgs/<b>/sample_<i>.png, metadata/<b>.npy}`` | 8-bit pixels |

Splits the release does not fix are seeded (the well-known PyTorch ports shuffle unseeded): Text and Image
hold out a seeded validation part of the training set, Pathfinder splits 80/10/10.
"""

from __future__ import annotations

import csv
import glob
import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

PAD = 0
BYTE_VOCAB = 257

# ListOps: digits, the four operators and "X" (the "]" closing an operator); "(" and ")" are dropped.
LISTOPS_SYMBOLS = [str(i) for i in range(10)] + ["[MIN", "[MAX", "[MED", "[SM", "X"]
LISTOPS_VOCAB = {s: i + 1 for i, s in enumerate(LISTOPS_SYMBOLS)}


LISTOPS_TOKENIZERS = ("brackets", "alphanumeric")


def listops_tokens(source: str, tokenizer: str = "brackets") -> np.ndarray:
    """Token ids of one ListOps expression.

    Args:
        source: the expression as written in the release TSV (``( ( [MAX 2 ) 9 ) ]``).
        tokenizer: ``"brackets"``: ``]`` -> ``X``, parentheses dropped, split on whitespace (the closing bracket
            stays a token, so the tree is recoverable); ``"alphanumeric"``: only the alphanumeric runs, as the
            release's own input pipeline tokenises (its text tokenizer drops every other character: ``[MAX`` ->
            ``MAX``, no ``]`` token), which is what the PyTorch ports trained on.
    """
    if tokenizer == "brackets":
        words = source.replace("]", "X").replace("(", "").replace(")", "").split()
    elif tokenizer == "alphanumeric":
        words = ["[" + w if w.isalpha() else w for w in source.replace("[", " ").replace("]", " ").split()]
        words = [w for w in words if w not in ("(", ")")]
    else:
        raise ValueError(f"tokenizer must be one of {LISTOPS_TOKENIZERS}, got {tokenizer!r}")
    return np.array([LISTOPS_VOCAB[w] for w in words], dtype=np.int16)


def byte_tokens(text: str | bytes, max_length: int) -> np.ndarray:
    """UTF-8 bytes + 1 (0 is padding), truncated to ``max_length``."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data[:max_length], dtype=np.uint8).astype(np.int16) + 1


def pixel_tokens(pixels: np.ndarray, zero_is_padding: bool) -> torch.Tensor:
    """Token ids of 8-bit pixels: the value itself when ``zero_is_padding`` (the PyTorch ports' rule: their
    padding mask is ``token != 0``, so black pixels are masked out of attention and pooling), else value + 1
    (every pixel a real token)."""
    return torch.from_numpy(pixels.astype(np.int16) + (0 if zero_is_padding else 1))


class TokenDataset(Dataset):
    """Token sequences (each [L_i]) and labels; or pairs of sequences for retrieval."""

    def __init__(self, tokens: Sequence, labels: Sequence[int], tokens2: Sequence | None = None) -> None:
        if len(tokens) != len(labels) or (tokens2 is not None and len(tokens2) != len(labels)):
            raise ValueError("tokens and labels differ in length")
        self.tokens, self.labels, self.tokens2 = tokens, labels, tokens2

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        if self.tokens2 is None:
            return self.tokens[i], int(self.labels[i])
        return self.tokens[i], self.tokens2[i], int(self.labels[i])


def pad_batch(seqs: Sequence[np.ndarray], length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token arrays.

    Args:
        seqs: 1D integer arrays.
        length: pad (and truncate) to this length; None pads to the longest in the batch.

    Returns:
        (tokens [B, L] long, padding mask [B, L] bool, True = padding).
    """
    length = length or max(len(s) for s in seqs)
    rows = [torch.as_tensor(s[:length]) for s in seqs]
    if all(len(r) == length for r in rows):
        # Fixed-length rows (the pixel tasks): one copy instead of one per row.
        tokens = torch.stack(rows).long()
    else:
        tokens = torch.full((len(rows), length), PAD, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
    return tokens, tokens == PAD


def valid_lengths(key_padding_mask: torch.Tensor) -> tuple[int, int]:
    """(shortest, longest) valid-token count over the rows of a [B, L] padding mask (True = padding)."""
    counts = (~key_padding_mask).sum(dim=1)
    return int(counts.min()), int(counts.max())


def add_valid_lengths(batch: dict) -> dict:
    """``batch`` with ``valid_lengths`` (``valid_lengths2``) beside each CPU padding mask ``key_padding_mask``
    (``key_padding_mask2``): what the encoder's padding cut needs so as not to read the mask back from the GPU."""
    for suffix in ("", "2"):
        mask = batch.get(f"key_padding_mask{suffix}")
        if mask is not None:
            batch[f"valid_lengths{suffix}"] = valid_lengths(mask)
    return batch


class Collate:
    """Batch dict ``{"x", "key_padding_mask", "valid_lengths", "label"}`` (the framework's sequence-batch keys,
    which are the encoder's keyword arguments); retrieval adds the second document as ``x2``/``key_padding_mask2``/
    ``valid_lengths2``. ``valid_lengths`` (Python ints, counted here on the CPU) let the encoder cut the batch's
    padding without reading the mask back from the GPU."""

    def __init__(self, length: int | None) -> None:
        self.length = length

    def __call__(self, items: list[tuple]) -> dict[str, torch.Tensor | tuple[int, int]]:
        batch: dict[str, torch.Tensor | tuple[int, int]] = {}
        batch["x"], batch["key_padding_mask"] = pad_batch([it[0] for it in items], self.length)
        if len(items[0]) == 3:
            batch["x2"], batch["key_padding_mask2"] = pad_batch([it[1] for it in items], self.length)
        add_valid_lengths(batch)
        batch["label"] = torch.tensor([it[-1] for it in items], dtype=torch.long)
        return batch


def seeded_split(n: int, fractions: Sequence[float], seed: int) -> list[np.ndarray]:
    """Indices of a seeded random split of ``range(n)`` into parts of the given fractions (the last takes the
    rest)."""
    perm = np.random.default_rng(seed).permutation(n)
    cuts = np.cumsum([int(round(f * n)) for f in fractions[:-1]])
    return np.split(perm, cuts)


class LRADataModule(L.LightningDataModule):
    """Shared loader logic: per-split datasets, padding to ``max_length`` (or the batch's longest).

    Args:
        root: folder of the task's release files.
        max_length: sequence length (longer inputs are truncated).
        batch_size: per-device batch size.
        num_workers: DataLoader workers.
        pad_to: ``"max"`` pads every batch to ``max_length`` (the LRA convention) or ``"batch"`` to the longest
            sequence of the batch. The LRA encoder cuts each batch to its longest valid sequence (rounded up to its
            ``pad_multiple``) either way, so this only changes the size of what the loader hands over.
        seed: seed of the splits the release does not fix.
        limit: keep at most this many examples per split (smoke tests and short runs); None keeps all.
        num_classes, vocab_size: optional, as written in the data config for the model to read
            (``${data.num_classes}``); checked against the task's own values.
        pin_memory: batches in page-locked memory on machines with CUDA, so that their copy to the GPU is queued
            like a kernel (a copy from pageable memory may hold the host until the GPU has run the work queued
            before it).
    """

    num_classes: int = 2
    vocab_size: int = BYTE_VOCAB
    dual: bool = False

    def __init__(
        self,
        root: str,
        max_length: int,
        batch_size: int = 32,
        num_workers: int = 0,
        pad_to: str = "max",
        seed: int = 0,
        limit: int | None = None,
        num_classes: int | None = None,
        vocab_size: int | None = None,
        pin_memory: bool = True,
    ) -> None:
        super().__init__()
        for key, given in (("num_classes", num_classes), ("vocab_size", vocab_size)):
            if given is not None and given != getattr(self, key):
                raise ValueError(
                    f"{type(self).__name__}: {key}={given} in the config, but the data has {getattr(self, key)}"
                )
        if pad_to not in ("max", "batch"):
            raise ValueError(f"pad_to must be 'max' or 'batch', got {pad_to!r}")
        self.root = Path(os.path.expanduser(str(root)))
        self.max_length = int(max_length)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pad_to = pad_to
        self.seed = seed
        self.limit = limit
        self.pin_memory = bool(pin_memory)
        self.datasets: dict[str, TokenDataset] = {}

    def load(self) -> dict[str, TokenDataset]:
        """The train/val/test datasets (implemented per task)."""
        raise NotImplementedError

    def example_input(self) -> dict[str, torch.Tensor]:
        """One full-length input of ones (the framework's preflight forward), without reading the data."""
        x = torch.ones(1, self.max_length, dtype=torch.long)
        out = {"x": x, "key_padding_mask": torch.zeros_like(x, dtype=torch.bool)}
        if self.dual:
            out["x2"], out["key_padding_mask2"] = x.clone(), out["key_padding_mask"].clone()
        return out

    def setup(self, stage: str | None = None) -> None:
        if not self.datasets:
            if not self.root.exists():
                raise FileNotFoundError(f"{type(self).__name__}: data root {self.root} does not exist")
            self.datasets = self.load()
            if self.limit:
                for name, ds in self.datasets.items():
                    keep = min(self.limit, len(ds))
                    t2 = ds.tokens2[:keep] if ds.tokens2 is not None else None
                    self.datasets[name] = TokenDataset(ds.tokens[:keep], ds.labels[:keep], t2)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        return DataLoader(
            self.datasets[split],
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=Collate(self.max_length if self.pad_to == "max" else None),
            drop_last=shuffle,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)


class ListOpsDataModule(LRADataModule):
    """ListOps (``listops-1000/basic_{train,val,test}.tsv``), 10 classes, length 2000.

    Args:
        tokenizer: ``"brackets"`` or ``"alphanumeric"`` (see :func:`listops_tokens`).
    """

    num_classes = 10
    vocab_size = len(LISTOPS_SYMBOLS) + 1

    def __init__(self, root: str, max_length: int = 2000, tokenizer: str = "brackets", **kwargs) -> None:
        super().__init__(root, max_length, **kwargs)
        if tokenizer not in LISTOPS_TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {LISTOPS_TOKENIZERS}, got {tokenizer!r}")
        self.tokenizer = tokenizer

    def load(self) -> dict[str, TokenDataset]:
        out = {}
        for split in ("train", "val", "test"):
            path = self.root / f"basic_{split}.tsv"
            with open(path, newline="") as f:
                reader = csv.reader(f, delimiter="\t")
                header = next(reader)
                if [h.strip() for h in header[:2]] != ["Source", "Target"]:
                    raise ValueError(f"{path}: expected the header Source<TAB>Target, got {header}")
                rows = [r for r in reader if r]
            tokens = [listops_tokens(r[0], self.tokenizer)[: self.max_length] for r in rows]
            out[split] = TokenDataset(tokens, [int(r[1]) for r in rows])
        return out


def _read_parquet(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


class TextDataModule(LRADataModule):
    """IMDb reviews at byte level (LRA Text), 2 classes, length 4096.

    Reads ``aclImdb/{train,test}/{pos,neg}/*.txt`` (the Stanford release; ``root`` may be the folder holding
    ``aclImdb`` or ``aclImdb`` itself) or parquet files named ``train*.parquet`` / ``test*.parquet`` with
    ``text`` and ``label`` columns (a local Hugging Face ``imdb`` copy, searched recursively).

    Args:
        val_fraction: seeded part of the training set held out for validation; 0 evaluates on the test set, as
            the LRA release does (then model selection sees the test set: report which was used).
    """

    num_classes = 2

    def __init__(self, root: str, max_length: int = 4096, val_fraction: float = 0.1, **kwargs) -> None:
        super().__init__(root, max_length, **kwargs)
        self.val_fraction = val_fraction

    def _split_files(self, split: str) -> tuple[list, list[int]]:
        base = self.root / "aclImdb" if (self.root / "aclImdb").is_dir() else self.root
        if (base / split / "pos").is_dir():
            texts, labels = [], []
            for label, name in ((0, "neg"), (1, "pos")):
                files = sorted(glob.glob(str(base / split / name / "*.txt")))
                for fn in files:
                    with open(fn, "rb") as f:
                        texts.append(f.read())
                    labels.append(label)
            return texts, labels
        files = sorted(glob.glob(str(self.root / "**" / f"{split}*.parquet"), recursive=True))
        if not files:
            raise FileNotFoundError(f"no aclImdb/{split}/{{pos,neg}} folder nor {split}*.parquet under {self.root}")
        rows = [r for fn in files for r in _read_parquet(fn)]
        return [r["text"] for r in rows], [int(r["label"]) for r in rows]

    def load(self) -> dict[str, TokenDataset]:
        out = {}
        texts, labels = self._split_files("train")
        tokens = [byte_tokens(t, self.max_length) for t in texts]
        test_texts, test_labels = self._split_files("test")
        out["test"] = TokenDataset([byte_tokens(t, self.max_length) for t in test_texts], test_labels)
        if self.val_fraction > 0:
            val_idx, train_idx = seeded_split(len(tokens), [self.val_fraction, 1 - self.val_fraction], self.seed)
            out["train"] = TokenDataset([tokens[i] for i in train_idx], [labels[i] for i in train_idx])
            out["val"] = TokenDataset([tokens[i] for i in val_idx], [labels[i] for i in val_idx])
        else:
            out["train"] = TokenDataset(tokens, labels)
            out["val"] = out["test"]
        return out


class RetrievalDataModule(LRADataModule):
    """AAN document-pair matching at byte level (LRA Retrieval), 2 classes, 4000 bytes per document.

    Reads ``new_aan_pairs.{train,eval,test}.tsv`` (columns label, id1, id2, text1, text2; no header) from
    ``root`` or ``root/tsv_data``. Batches carry both documents in their file order: ``x``/``key_padding_mask``
    is text1 and ``x2``/``key_padding_mask2`` is text2.
    """

    num_classes = 2
    dual = True

    def __init__(self, root: str, max_length: int = 4000, **kwargs) -> None:
        super().__init__(root, max_length, **kwargs)

    def load(self) -> dict[str, TokenDataset]:
        base = self.root / "tsv_data" if (self.root / "tsv_data").is_dir() else self.root
        csv.field_size_limit(sys.maxsize)
        out = {}
        for split, name in (("train", "train"), ("val", "eval"), ("test", "test")):
            t1, t2, labels = [], [], []
            with open(base / f"new_aan_pairs.{name}.tsv", newline="", encoding="utf-8") as f:
                for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
                    if not row or row[0].strip().lower() == "label":
                        continue
                    labels.append(int(float(row[0])))
                    t1.append(byte_tokens(row[3], self.max_length))
                    t2.append(byte_tokens(row[4], self.max_length))
            out[split] = TokenDataset(t1, labels, t2)
        return out


def rgb_to_gray(rgb: np.ndarray) -> np.ndarray:
    """[..., 3] uint8 RGB -> [...] uint8 luma (ITU-R 601 weights, as tf.image.rgb_to_grayscale)."""
    gray = rgb[..., 0] * 0.2989 + rgb[..., 1] * 0.5870 + rgb[..., 2] * 0.1140
    return np.clip(gray, 0, 255).astype(np.uint8)


class ImageDataModule(LRADataModule):
    """CIFAR-10 as sequences of 1024 grayscale 8-bit pixel tokens (LRA Image), 10 classes.

    Reads the python-pickle release ``cifar-10-batches-py`` (``root`` or ``root/cifar-10-batches-py``);
    a seeded ``val_size`` images of the 50K training images are held out (45K/5K/10K). ``zero_is_padding``: see
    :func:`pixel_tokens`.
    """

    num_classes = 10
    vocab_size = 257

    def __init__(
        self, root: str, max_length: int = 1024, val_size: int = 5000, zero_is_padding: bool = True, **kwargs
    ) -> None:
        super().__init__(root, max_length, **kwargs)
        self.val_size = val_size
        self.zero_is_padding = zero_is_padding

    def _batches(self, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        base = self.root / "cifar-10-batches-py" if (self.root / "cifar-10-batches-py").is_dir() else self.root
        data, labels = [], []
        for name in names:
            with open(base / name, "rb") as f:
                d = pickle.load(f, encoding="bytes")
            data.append(np.asarray(d[b"data"], dtype=np.uint8))
            labels += list(d[b"labels"])
        # Rows are 3072 = 3 planes (R, G, B) of 32 x 32, row-major.
        rgb = np.concatenate(data).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return rgb_to_gray(rgb).reshape(-1, 1024), np.asarray(labels)

    def load(self) -> dict[str, TokenDataset]:
        x, y = self._batches([f"data_batch_{i}" for i in range(1, 6)])
        tx, ty = self._batches(["test_batch"])
        val_idx, train_idx = seeded_split(len(x), [self.val_size / len(x), 1 - self.val_size / len(x)], self.seed)
        tok = pixel_tokens(x, self.zero_is_padding)
        return {
            "train": TokenDataset(tok[train_idx], y[train_idx]),
            "val": TokenDataset(tok[val_idx], y[val_idx]),
            "test": TokenDataset(pixel_tokens(tx, self.zero_is_padding), ty),
        }


def read_pathfinder_metadata(folder: Path) -> list[tuple[str, int]]:
    """(image path relative to ``folder``, label) for every line of ``folder/metadata/*.npy`` (text files)."""
    items = []
    files = sorted(glob.glob(str(folder / "metadata" / "*.npy")), key=lambda p: (len(Path(p).stem), Path(p).stem))
    for fn in files:
        with open(fn) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 4:
                    items.append((f"{fields[0]}/{fields[1]}", int(fields[3])))
    return items


class PathfinderDataModule(LRADataModule):
    """Pathfinder-32 (``pathfinder32/<difficulty>``), 1024 pixel tokens, 2 classes, seeded 80/10/10 split.

    Images that are empty or unreadable (the release has one, ``curv_baseline/imgs/0/sample_172.png``) are
    skipped; the decoded set is kept in memory as uint8.

    Args:
        difficulty: ``curv_contour_length_14`` (hard, the LRA setting), ``curv_contour_length_9`` or
            ``curv_baseline``.
        binarize: None (the recipe: every grey level is its own token) or a fraction of 255: pixels above it
            become 255, the others 0 (a diagnostic of how the grey levels affect learning; never a table row).
        zero_is_padding: black pixels are padding (the recipe; see :func:`pixel_tokens`).
    """

    num_classes = 2
    vocab_size = 257

    def __init__(
        self,
        root: str,
        max_length: int = 1024,
        difficulty: str = "curv_contour_length_14",
        binarize: float | None = None,
        zero_is_padding: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(root, max_length, **kwargs)
        self.zero_is_padding = zero_is_padding
        if binarize is not None and not 0.0 <= binarize < 1.0:
            raise ValueError(f"binarize must be None or a fraction in [0, 1), got {binarize!r}")
        self.difficulty = difficulty
        self.binarize = binarize
        self.skipped: list[str] = []

    def load(self) -> dict[str, TokenDataset]:
        folder = self.root / self.difficulty if (self.root / self.difficulty).is_dir() else self.root
        items = read_pathfinder_metadata(folder)
        if self.limit:
            # Decode only what a limited run can use (a seeded subset of the index).
            pick = np.random.default_rng(self.seed).permutation(len(items))[: self.limit * 10]
            items = [items[i] for i in sorted(pick)]
        pixels, labels = [], []
        for rel, label in items:
            path = folder / rel
            try:
                if os.path.getsize(path) == 0:
                    raise OSError("empty file")
                with Image.open(path) as img:
                    arr = np.asarray(img.convert("L"), dtype=np.uint8)
            except OSError:
                self.skipped.append(rel)
                continue
            if arr.size != self.max_length:
                raise ValueError(f"{path}: {arr.shape} image does not give {self.max_length} pixel tokens")
            pixels.append(arr.reshape(-1))
            labels.append(label)
        if not pixels:
            raise FileNotFoundError(f"no readable Pathfinder images listed under {folder / 'metadata'}")
        pixels = np.stack(pixels)
        if self.binarize is not None:
            pixels = np.where(pixels > self.binarize * 255, 255, 0).astype(np.uint8)
        tok = pixel_tokens(pixels, self.zero_is_padding)
        y = np.asarray(labels)
        parts = seeded_split(len(y), [0.8, 0.1, 0.1], self.seed)
        return {name: TokenDataset(tok[idx], y[idx]) for name, idx in zip(("train", "val", "test"), parts)}
