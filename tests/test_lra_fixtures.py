"""The tiny LRA / arXiv files (tasks/lra/fake.py) are themselves correct."""

from __future__ import annotations

from pathlib import Path

from tasks.lra.fake import (  # noqa: F401  (re-exported for the other LRA test modules)
    LISTOPS_ROWS,
    write_aan,
    write_arxiv_parquet,
    write_arxiv_raw,
    write_cifar,
    write_imdb,
    write_imdb_parquet,
    write_listops,
    write_pathfinder,
)


def test_listops_fixture_rows_are_correct() -> None:
    """The hand-written ListOps rows carry the values the release algorithm gives them."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "prepare_data" / "listops.py"
    spec = importlib.util.spec_from_file_location("listops_fixture_check", path)
    listops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(listops)
    for source, target in LISTOPS_ROWS:
        assert listops.evaluate(listops.parse(source)) == target
