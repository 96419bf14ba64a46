"""scripts/gpu/lra_state.py: what a device call returned merged into the local state, the records and the
in-progress tar (files built here in the driver's own formats)."""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lra_state():
    spec = importlib.util.spec_from_file_location("lra_state_under_test", ROOT / "scripts" / "gpu" / "lra_state.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def tar_bytes(files: dict[str, str], mode: str = "w") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_row_of_names_the_row_folder(lra_state):
    assert lra_state.row_of("logs/lra/pathfinder-mita/seed0/seed=0/checkpoints/last.ckpt") == (
        "logs/lra/pathfinder-mita/seed0"
    )
    assert lra_state.row_of("logs/lra/pathfinder-mita/seed0.log") == "logs/lra/pathfinder-mita/seed0"
    assert (
        lra_state.row_of("logs/lra/listops-full/seed2-xab12cd/seed=2/run.log") == "logs/lra/listops-full/seed2-xab12cd"
    )
    assert lra_state.row_of("records/lra/x.json") is None


def test_merge_replaces_paused_rows_and_retires_finished_ones(lra_state, tmp_path):
    state, records, returned = tmp_path / "state", tmp_path / "runs", tmp_path / "call"
    mita = "logs/lra/pathfinder-mita/seed0"
    full = "logs/lra/pathfinder-full/seed0"
    moba = "logs/lra/pathfinder-moba/seed0"
    write(state / mita / "seed=0/checkpoints/best/best-step100.ckpt", "old best")
    write(state / mita / "seed=0/checkpoints/last.ckpt", "old last")
    write(state / full / "seed=0/checkpoints/last.ckpt", "full last")
    write(state / f"{full}.log", "full log")
    write(state / moba / "seed=0/checkpoints/last.ckpt", "moba, not in this call")
    # The call: full attention finished (its record), MiTA paused again with a new best checkpoint.
    rec = {"experiment": "lra/pathfinder-full", "config": {"run_name": "lra/pathfinder-full/seed0"}}
    returned.mkdir()
    (returned / "records.tar.gz").write_bytes(
        tar_bytes({"records/lra/pathfinder-full/r1.json": json.dumps(rec), "records/lra/pathfinder-full/r1.log": "x"},
                  "w:gz")
    )  # fmt: skip
    state_tar = tar_bytes({
        f"{mita}/seed=0/checkpoints/best/best-step200.ckpt": "new best",
        f"{mita}/seed=0/checkpoints/last.ckpt": "new last",
        f"{mita}.log": "mita log",
    })  # fmt: skip
    half = len(state_tar) // 2
    (returned / "state.tar.part00").write_bytes(state_tar[:half])
    (returned / "state.tar.part01").write_bytes(state_tar[half:])
    packed = tmp_path / "in_progress" / "state.tar"
    result = lra_state.main(
        ["--returned", str(returned), "--state", str(state), "--records", str(records), "--pack", str(packed)]
    )
    assert result == {"finished": [full], "paused": [mita]}
    # Finished: record in both places, its state gone.
    for root in (records, state / "records"):
        assert json.loads((root / "lra/pathfinder-full/r1.json").read_text()) == rec
    assert not (state / full).exists() and not (state / f"{full}.log").exists()
    assert not (state / "logs/lra/pathfinder-full").exists()  # no empty experiment folder left
    # Paused: the row's folder is the call's, the superseded best checkpoint gone; other rows untouched.
    best = sorted(p.name for p in (state / mita / "seed=0/checkpoints/best").iterdir())
    assert best == ["best-step200.ckpt"]
    assert (state / mita / "seed=0/checkpoints/last.ckpt").read_text() == "new last"
    assert (state / moba / "seed=0/checkpoints/last.ckpt").read_text() == "moba, not in this call"
    with tarfile.open(packed) as tar:
        names = set(tar.getnames())
    assert f"./{mita}/seed=0/checkpoints/last.ckpt" in names and f"./{moba}/seed=0/checkpoints/last.ckpt" in names
    assert "./records/lra/pathfinder-full/r1.json" in names


def test_pack_is_removed_when_no_row_is_left(lra_state, tmp_path):
    state, packed = tmp_path / "state", tmp_path / "state.tar"
    write(state / "records/lra/x/r.json", "{}")
    packed.write_bytes(b"old")
    assert not lra_state.pack(state, packed) and not packed.exists()
    with pytest.raises(SystemExit, match="is not a folder"):
        lra_state.main(["--returned", str(tmp_path / "missing"), "--state", str(state)])


def test_members_leaving_the_state_are_refused(lra_state, tmp_path):
    """A member path through ``..`` is refused before anything is removed or written outside the state."""
    returned = tmp_path / "call"
    returned.mkdir()
    write(tmp_path / "escape" / "seed0" / "keep", "must stay")
    (returned / "state.tar.part00").write_bytes(tar_bytes({"logs/../../escape/seed0/x": "no"}))
    with pytest.raises(SystemExit, match="leaves"):
        lra_state.main(["--returned", str(returned), "--state", str(tmp_path / "a" / "state")])
    assert (tmp_path / "escape" / "seed0" / "keep").read_text() == "must stay"
    assert not (tmp_path / "escape" / "seed0" / "x").exists()
