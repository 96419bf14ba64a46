"""Tiny LRA and arXiv data sets in each release's on-disk format, for the tests and ``reproduce.sh D|E --smoke``.

Usage: ``python -m tasks.lra.fake DIR`` writes ``DIR/<task>`` for task in listops, text, retrieval, image,
pathfinder, arxiv; each folder is a valid ``data.root`` for that task's data config.
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

import numpy as np
from PIL import Image

LISTOPS_ROWS = [
    ("( ( ( [MAX 2 ) 9 ) ] )", 9),
    ("( ( ( ( [MIN 4 ) ( ( ( [SM 3 ) 8 ) ] ) ) 7 ) ] )", 1),
    ("( ( ( ( [MED 1 ) 5 ) 3 ) ] )", 3),
    ("7", 7),
]


def write_listops(root: Path, n: int = 8) -> Path:
    """``basic_{train,val,test}.tsv`` with the header ``Source<TAB>Target``."""
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val", "test"):
        rows = [LISTOPS_ROWS[i % len(LISTOPS_ROWS)] for i in range(n)]
        text = "Source\tTarget\n" + "".join(f"{s}\t{t}\n" for s, t in rows)
        (root / f"basic_{split}.tsv").write_text(text)
    return root


def write_imdb(root: Path, n: int = 6) -> Path:
    """``aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt``."""
    for split in ("train", "test"):
        for name in ("pos", "neg"):
            d = root / "aclImdb" / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                (d / f"{i}_{7 if name == 'pos' else 2}.txt").write_text(f"{name} review {i}: caf\u00e9 " * (i + 1))
    return root


def write_imdb_parquet(root: Path, n: int = 6) -> Path:
    """A local Hugging Face ``imdb`` copy: ``plain_text/{train,test}-00000-of-00001.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = root / "plain_text"
    d.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        table = pa.table({"text": [f"review {i}" for i in range(n)], "label": [i % 2 for i in range(n)]})
        pq.write_table(table, d / f"{split}-00000-of-00001.parquet")
    return root


def write_aan(root: Path, n: int = 6) -> Path:
    """``tsv_data/new_aan_pairs.{train,eval,test}.tsv``: label, id1, id2, text1, text2 (no header)."""
    d = root / "tsv_data"
    d.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval", "test"):
        lines = [f"{float(i % 2)}\tP{i}-a\tP{i}-b\tfirst document {i} " + "x" * i + f"\tsecond {i}" for i in range(n)]
        (d / f"new_aan_pairs.{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


def write_cifar(root: Path, n: int = 4) -> Path:
    """``cifar-10-batches-py/{data_batch_1..5,test_batch}`` python pickles (bytes keys, uint8 rows of 3072)."""
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
            b"labels": [int(x) for x in rng.integers(0, 10, size=n)],
            b"batch_label": name.encode(),
        }
        with open(d / name, "wb") as f:
            pickle.dump(batch, f)
    return root


def write_pathfinder(root: Path, n: int = 20, empty: int | None = 3) -> Path:
    """``curv_contour_length_14/{imgs/0/sample_<i>.png, metadata/0.npy}``; image ``empty`` is a 0-byte file."""
    d = root / "curv_contour_length_14"
    (d / "imgs" / "0").mkdir(parents=True, exist_ok=True)
    (d / "metadata").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        path = d / "imgs" / "0" / f"sample_{i}.png"
        if i == empty:
            path.write_bytes(b"")
        else:
            Image.fromarray(rng.integers(0, 256, size=(32, 32), dtype=np.uint8), mode="L").save(path)
        lines.append(f"imgs/0 sample_{i}.png {i} {i % 2} 1.0 14 4 2 0.5 1 1")
    (d / "metadata" / "0.npy").write_text("\n".join(lines) + "\n")
    return root


def write_arxiv_raw(root: Path, n: int = 6) -> Path:
    """The raw release: ``{train,val,test}_data.txt`` JSON lines with category-name labels."""
    root.mkdir(parents=True, exist_ok=True)
    names = ["cs.AI", "math.AC", "cs.CV", "cs.NE", "math.GR", "math.ST"]
    for split in ("train", "val", "test"):
        with open(root / f"{split}_data.txt", "w") as f:
            for i in range(n):
                label = names[i % len(names)]
                f.write(json.dumps({"label": label, "text": f"Paper {i} [{label}] about things. " * 20}) + "\n")
    return root


def write_arxiv_parquet(root: Path, n: int = 6) -> Path:
    """A parquet export of the ``no_ref`` config: ``no_ref/{train,validation,test}-00000-of-00001.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = root / "no_ref"
    d.mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation", "test"):
        table = pa.table({"text": [f"document {i} " * 30 for i in range(n)], "label": [i % 11 for i in range(n)]})
        pq.write_table(table, d / f"{split}-00000-of-00001.parquet")
    return root


WRITERS = {
    "listops": write_listops,
    "text": write_imdb,
    "retrieval": write_aan,
    "image": write_cifar,
    "pathfinder": write_pathfinder,
    "arxiv": write_arxiv_raw,
}
# Sequence lengths that keep one smoke step fast; Image and Pathfinder keep their 1024 pixels.
SMOKE_LENGTHS = {"listops": 64, "text": 96, "retrieval": 64, "arxiv": 128}


def write_all(base: Path) -> dict[str, Path]:
    """Write every task's tiny data set under ``base``; returns task -> data root."""
    return {task: writer(base / task) for task, writer in WRITERS.items()}


def smoke_overrides(task: str, base: Path) -> list[str]:
    """Command-line overrides that point a ``debug=smoke`` run of ``task`` at the tiny data under ``base``."""
    overrides = [f"data.root={base / task}", "data.num_workers=0"]
    if task in SMOKE_LENGTHS:
        overrides.append(f"data.max_length={SMOKE_LENGTHS[task]}")
    if task == "image":
        overrides.append("data.val_size=4")
    return overrides


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write tiny LRA / arXiv data sets in their release formats.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--overrides-for", help="print the smoke-run overrides of this task instead")
    args = parser.parse_args(argv)
    if args.overrides_for:
        print(" ".join(smoke_overrides(args.overrides_for, args.out)))
        return
    for task, root in write_all(args.out).items():
        print(f"{task}: {root}")


if __name__ == "__main__":
    main()
