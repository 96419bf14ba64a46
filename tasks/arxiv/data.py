"""arXiv long-document classification (ccdv/arxiv-classification, He et al. 2019) at byte level.

Reads a local copy of the Hugging Face data set, either

- the raw release: ``{train,val,test}_data.txt``, JSON lines ``{"label": "cs.AI", "text": ...}``
  (label as the category name), or
- parquet / JSONL exports: files whose names start with ``train``, ``validation``/``val`` and ``test`` (searched
  recursively, so a ``no_ref/`` sub-folder works), with ``text`` and an integer ``label`` (the ClassLabel
  order below) or a category-name ``label``.

``no_ref=True`` removes every category name from the text (what the data set's ``no_ref`` config does, since
in-text tags leak the label); exports of the ``no_ref`` config are already stripped and stripping again does
nothing. Tokens are UTF-8 bytes + 1 (0 is padding), truncated to ``max_length`` (16384, 32768 or 65536).
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

from tasks.lra.data import BYTE_VOCAB, LRADataModule, TokenDataset, _read_parquet, byte_tokens

ARXIV_LABELS = [
    "math.AC",
    "cs.CV",
    "cs.AI",
    "cs.SY",
    "math.GR",
    "cs.CE",
    "cs.PL",
    "cs.IT",
    "cs.DS",
    "cs.NE",
    "math.ST",
]
# The 4-class subset of long-sequence papers (Paramixer, ChordMixer).
ARXIV_SUBSET4 = ["cs.AI", "cs.NE", "math.AC", "math.GR"]
CLASS_SETS = {"all11": ARXIV_LABELS, "subset4": ARXIV_SUBSET4}

SPLIT_NAMES = {"train": ("train",), "val": ("validation", "val"), "test": ("test",)}


def strip_refs(text: str) -> str:
    """Remove every category name from ``text`` (the ``no_ref`` configuration)."""
    for name in ARXIV_LABELS:
        text = text.replace(name, "")
    return text


class ArxivDataModule(LRADataModule):
    """arXiv classification, byte-level, 11 classes or the 4-class subset.

    Args:
        root: folder of the local ccdv/arxiv-classification copy.
        max_length: bytes per document (16384, 32768, 65536 in Table E).
        classes: ``"all11"`` (the 11 categories) or ``"subset4"`` (cs.AI, cs.NE, math.AC, math.GR; other documents
            are dropped and labels renumbered in that order).
        no_ref: strip category names from the texts.
        **kwargs: :class:`~tasks.lra.data.LRADataModule` options (batch_size, num_workers, pad_to, seed, limit).
    """

    vocab_size = BYTE_VOCAB

    def __init__(
        self, root: str, max_length: int = 16384, classes: str = "all11", no_ref: bool = True, **kwargs
    ) -> None:
        if classes not in CLASS_SETS:
            raise ValueError(f"classes must be one of {sorted(CLASS_SETS)}, got {classes!r}")
        self.classes = classes
        self.class_names = CLASS_SETS[classes]
        self.num_classes = len(self.class_names)
        super().__init__(root, max_length, **kwargs)
        self.no_ref = no_ref

    def _rows(self, split: str) -> list[dict]:
        for name in SPLIT_NAMES[split]:
            raw = self.root / f"{name}_data.txt"
            if raw.is_file():
                return _read_jsonl(raw)
            for ext, reader in (("parquet", _read_parquet), ("jsonl", _read_jsonl), ("json", _read_jsonl)):
                files = sorted(glob.glob(str(self.root / "**" / f"{name}*.{ext}"), recursive=True))
                # "val" would also match "validation"; the longer name is tried first.
                if files:
                    return [row for fn in files for row in reader(fn)]
        raise FileNotFoundError(f"no {split} split ({'/'.join(SPLIT_NAMES[split])}) found under {self.root}")

    def load(self) -> dict[str, TokenDataset]:
        remap = {ARXIV_LABELS.index(name): i for i, name in enumerate(self.class_names)}
        out = {}
        for split in ("train", "val", "test"):
            tokens, labels = [], []
            for row in self._rows(split):
                label = row["label"]
                label = ARXIV_LABELS.index(label) if isinstance(label, str) else int(label)
                if label not in remap:
                    continue
                text = strip_refs(row["text"]) if self.no_ref else row["text"]
                tokens.append(byte_tokens(text, self.max_length))
                labels.append(remap[label])
            out[split] = TokenDataset(tokens, labels)
        return out


def _read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
