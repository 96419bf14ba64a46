"""Merge what a device call of ``scripts/gpu/lra_rows.py`` returned into the local state, the run records and the
committed in-progress tar, so that the next call continues every unfinished row from its newest checkpoint.

    python scripts/gpu/lra_state.py --returned /path/to/call/files --state .gpu_state \\
        --records results/runs --pack results/lra/in_progress/pathfinder-state.tar

- ``records.tar.gz`` (rows that finished): each record with its curves and log goes to ``--records`` (the table
  records) and to ``<state>/records`` (so that ``lra_rows.py`` skips the row next time); the finished row's
  checkpoints and logs leave the state.
- ``state.tar.partNN`` (rows that paused): each row in the parts replaces that row's folder in the state whole, so
  no checkpoint of an earlier call (a superseded ``best-step*.ckpt``) stays beside the new ones.
- ``--pack``: the state folder as one tar (what results/lra/in_progress keeps), or the tar removed when no row is
  left unfinished.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import tarfile
from pathlib import Path

# A row's folder under logs/: <experiment path>/seed<N>[-x<hash of extra overrides>] (lra_rows.Job.name).
_ROW = re.compile(r"^seed\d+(-x[0-9a-f]{6})?(\.log)?$")


def row_of(member: str) -> str | None:
    """``logs/<experiment>/seed<N>`` (the row's folder, or its driver log without ``.log``) of a state member path."""
    parts = Path(member).parts
    if not parts or parts[0] != "logs":
        return None
    for i, part in enumerate(parts[1:], start=1):
        match = _ROW.match(part)
        if match:
            name = part[: -len(".log")] if match.group(2) else part
            return str(Path(*parts[:i], name))
    return None


def inside(root: Path, rel: str | Path) -> Path:
    """``root / rel``, refusing a member path that leaves ``root`` (absolute, or through ``..``)."""
    target = (root / rel).resolve()
    if not target.is_relative_to(root.resolve()):
        raise SystemExit(f"lra_state: archive member {str(rel)!r} leaves {root}")
    return target


def drop_row(state: Path, row: str) -> None:
    """Remove a row's folder and driver log from the state (refusing a row path that leaves it)."""
    folder = inside(state, row)
    shutil.rmtree(folder, ignore_errors=True)
    inside(state, f"{row}.log").unlink(missing_ok=True)
    # Folders left empty above it (the experiment's), up to the state itself.
    parent, root = folder.parent, state.resolve()
    while parent != root and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def merge_records(archive: Path, state: Path, records: Path) -> list[str]:
    """Finished rows: records to ``records`` and ``state/records``; their state folders dropped. Returns the rows."""
    finished = []
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith("records/")]
        for member in members:
            data = tar.extractfile(member).read()
            rel = Path(member.name).relative_to("records")
            for root in (records, state / "records"):
                target = inside(root, rel)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            if member.name.endswith(".json"):
                name = (json.loads(data).get("config") or {}).get("run_name")
                if name:
                    finished.append(f"logs/{name}")
    for row in finished:
        drop_row(state, row)
    return finished


def merge_state(parts: list[Path], state: Path) -> list[str]:
    """Paused rows: each row in the parts replaces its folder in the state. Returns the rows."""
    data = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = tar.getmembers()
        rows = sorted({r for m in members if (r := row_of(m.name))})
        for row in rows:
            drop_row(state, row)
        for member in members:
            if member.isfile():
                target = inside(state, member.name)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    return rows


def pack(state: Path, path: Path) -> bool:
    """The state as one tar at ``path`` if a row is left in it (else ``path`` removed); True if written."""
    rows = {r for f in state.rglob("*") if f.is_file() and (r := row_of(str(f.relative_to(state))))}
    if not rows:
        path.unlink(missing_ok=True)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for f in sorted(state.rglob("*")):
            if f.is_file():
                tar.add(f, arcname=f"./{f.relative_to(state)}")
    return True


def main(argv: list[str] | None = None) -> dict[str, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--returned", type=Path, required=True, help="the files a device call brought back")
    parser.add_argument("--state", type=Path, default=Path(".gpu_state"), help="the local state folder")
    parser.add_argument("--records", type=Path, default=Path("results/runs"), help="where run records go")
    parser.add_argument("--pack", type=Path, help="write the state here as one tar afterwards")
    args = parser.parse_args(argv)
    if not args.returned.is_dir():
        raise SystemExit(f"lra_state: {args.returned} is not a folder")
    args.state.mkdir(parents=True, exist_ok=True)
    result = {"finished": [], "paused": []}
    archive = args.returned / "records.tar.gz"
    if archive.exists():
        result["finished"] = merge_records(archive, args.state, args.records)
    parts = sorted(args.returned.glob("state.tar.part*"))
    if parts:
        result["paused"] = merge_state(parts, args.state)
    for kind, rows in result.items():
        print(f"{kind}: {', '.join(r.removeprefix('logs/') for r in rows) or 'none'}")
    if args.pack:
        print(f"{args.pack}: {'written' if pack(args.state, args.pack) else 'removed (no unfinished row)'}")
    return result


if __name__ == "__main__":
    main()
