"""The tiny LRA / arXiv files (tasks/lra/fake.py) are themselves correct."""

from __future__ import annotations

from tasks.lra.fake import LISTOPS_ROWS


def test_listops_fixture_rows_are_correct() -> None:
    """The hand-written ListOps rows carry the values the release algorithm gives them."""
    from script_loader import load_prepare_script

    listops = load_prepare_script("listops")
    for source, target in LISTOPS_ROWS:
        assert listops.evaluate(listops.parse(source)) == target
