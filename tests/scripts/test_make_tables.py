"""scripts/make_tables.py: which records fill a row, seeds, Table D's layout, the time column and the README block."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("make_tables", ROOT / "scripts" / "make_tables.py")
make_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_tables)

LRA_STEPS = {"listops": 5000, "text": 20000, "retrieval": 30000, "image": 35000, "pathfinder": 62400}


def record(
    experiment: str,
    value: float | None,
    *,
    date: str = "2026-12-01T10:00:00Z",
    steps: int = 5000,
    max_steps: int | str = 5000,
    overrides: list[str] | None = None,
    commit: str | None = "0123456789abcdef0123456789abcdef01234567",
    smoke: bool = False,
    wall_time_s: float = 360.0,
    concurrency: dict[str, Any] | None = None,
    source: str | None = "git",
    max_epochs: int = -1,
    epochs: int = 3,
    segment_commits: list[str | None] | None = None,
    segment_processes: list[int | None] | None = None,
) -> dict[str, Any]:
    """A run record with the keys ``tasks.common.records.write_record`` writes (and the optional new ones)."""
    overrides = [f"experiment={experiment}"] if overrides is None else overrides
    rec = {
        "experiment": experiment,
        "paper": {"table": "D", "row": experiment, "metric": "test accuracy", "value": None},
        "result": {"metric": "test accuracy", "value": value, "best": value},
        "metrics": {"test/acc1": None if value is None else value / 100},
        "smoke": smoke,
        "command": "python -m tasks.run " + " ".join(overrides),
        "argv": ["tasks/run.py", *overrides],
        "overrides": overrides,
        "git": {"commit": commit, "dirty": False, "source": source if commit else None},
        "hardware": {
            "cpu": "X",
            "cpu_count": 16,
            "gpus": ["GPU X"],
            "host": "h",
            "world_size": 1,
            "summary": "1x GPU X",
        },
        "versions": {"python": "3.12", "torch": "2.0"},
        "date": date,
        "steps": steps,
        "epochs": epochs,
        "wall_time_s": wall_time_s,
        "segments": len(segment_commits) if segment_commits else 1,
        "segment_commits": segment_commits or [commit],
        "output_dir": "/somewhere/outputs/" + experiment,
        "config": {"seed": 0, "trainer": {"max_steps": max_steps, "max_epochs": max_epochs}},
        "concurrency": concurrency,
    }
    # As write_record fills it: earlier processes unknown, the last one's from its concurrency.
    if segment_processes is None:
        segment_processes = [None] * (rec["segments"] - 1) + [(concurrency or {}).get("processes") or 1]
    rec["segment_processes"] = segment_processes
    return rec


def write(records_dir: Path, rec: dict[str, Any]) -> Path:
    digest = hashlib.sha1(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:8]
    path = records_dir / rec["experiment"] / f"{rec['date'].replace(':', '')}-{digest}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=2) + "\n")
    return path


def table(tmp_path: Path, name: str = "D") -> str:
    tables = tmp_path / "results" / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    return make_tables.build_table(name, tmp_path / "results" / "runs", tmp_path / "no-flops.csv", tables)


def row(text: str, experiment: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("| ") and f"| `{experiment}` |" in line)


def other_rows(text: str) -> list[str]:
    if "**Other runs (not used in the table)**" not in text:
        return []
    section = text.split("**Other runs (not used in the table)**", 1)[1]
    return [line for line in section.splitlines() if line.startswith("| `")]


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.setattr(make_tables, "TIME_ESTIMATES", tmp_path / "no-estimates.csv")
    return tmp_path / "results" / "runs"


def test_hand_written_records_have_write_records_keys(tmp_path):
    from tasks.common.records import write_record

    path = write_record(
        tmp_path, "lra/listops-full", {"test/acc1": 0.3}, paper={"metric": "test accuracy"},
        report={"key": "test/acc1", "scale": 100}, overrides=["experiment=lra/listops-full"], steps=5000, epochs=1,
        wall_time_s=1.0, world_size=1, config={"trainer": {"max_steps": 5000}}, output_dir="/x",
    )  # fmt: skip
    written = json.loads(path.read_text())
    assert set(written) - {"concurrency"} <= set(record("lra/listops-full", 30.0))
    assert set(written["git"]) <= {"commit", "dirty", "source"}


def test_override_rules():
    allowed = ["experiment=lra/listops-full", "seed=3", "data.root=/d", "data.num_workers=8", "paths.output_dir=/o",
               "+paths.x=1", "logger=csv", "trainer.enable_progress_bar=false", "resume=auto", "run_name=a",
               "++deadline=17", "hydra.run.dir=/r", "hydra=x"]  # fmt: skip
    refused = ["trainer.max_steps=3", "data.limit=100", "debug=smoke", "model.depth=1", "+trainer.max_time=00:02",
               "++model.dim=3", "pathsx=1", "~seed"]  # fmt: skip
    assert all(make_tables.override_allowed(o) for o in allowed)
    assert not any(make_tables.override_allowed(o) for o in refused)
    assert make_tables.override_key("++trainer.max_time=1") == "trainer.max_time"


def test_debug_run_does_not_replace_the_recipe_run(runs, tmp_path):
    write(runs, record("lra/listops-full", 37.0, date="2026-12-01T10:00:00Z"))
    debug = ["experiment=lra/listops-full", "trainer.max_steps=3"]
    write(runs, record("lra/listops-full", 10.0, date="2026-12-02T10:00:00Z", steps=3, max_steps=3, overrides=debug))
    text = table(tmp_path)
    assert "| 37.0 |" in row(text, "lra/listops-full")
    (other,) = other_rows(text)
    assert "`lra/listops-full`" in other and "| 10.0 | 3 | 2026-12-02 |" in other
    assert "| overrides trainer.max_steps=3 |" in other


def test_reasons_for_other_runs_are_listed_sorted(runs, tmp_path):
    full = "lra/listops-full"
    write(runs, record(full, 20.0, date="2026-12-03T00:00:00Z", steps=3501))
    write(runs, record(full, 21.0, date="2026-12-01T00:00:00Z", smoke=True))
    write(runs, record(full, 22.0, date="2026-12-02T00:00:00Z", commit=None))
    cap = [f"experiment={full}", "+trainer.max_time=00:00:02:00"]
    write(runs, record("lra/listops-mita", 23.0, date="2026-11-01T00:00:00Z", overrides=cap))
    text = table(tmp_path)
    others = other_rows(text)
    assert [line.split(" | ")[4] for line in others] == ["2026-12-01", "2026-12-02", "2026-12-03", "2026-11-01"]
    assert "| smoke |" in others[0]
    assert "| none | no commit |" in others[1]
    assert "| steps 3501 of 5000 |" in others[2]
    assert "| overrides +trainer.max_time=00:00:02:00 |" in others[3]
    assert "no run of the recipe (see other runs)" in row(text, full)


def test_null_commit_record_is_never_the_row(runs, tmp_path):
    write(runs, record("lra/listops-full", 37.0, date="2026-12-01T00:00:00Z"))
    write(runs, record("lra/listops-full", 99.0, date="2026-12-05T00:00:00Z", commit=None))
    text = table(tmp_path)
    assert "| 37.0 |" in row(text, "lra/listops-full") and "99.0" not in row(text, "lra/listops-full")
    assert any("no commit" in line for line in other_rows(text))


def test_seeds_give_mean_and_sample_sd(runs, tmp_path):
    name = "lra/listops-mita"
    for seed, value in [(0, 37.0), (1, 37.5), (2, 38.0)]:
        overrides = [f"experiment={name}", f"seed={seed}", "data.root=/data/listops"]
        write(runs, record(name, value, overrides=overrides, date=f"2026-12-0{seed + 1}T00:00:00Z",
                           wall_time_s=3600 * (seed + 1)))  # fmt: skip
    # An older run of seed 1: superseded by the newer one, so listed under other runs.
    write(runs, record(name, 10.0, overrides=[f"experiment={name}", "seed=1"], date="2026-11-01T00:00:00Z"))
    text = table(tmp_path)
    line = row(text, name)
    assert "| 37.5 ± 0.5 (3 seeds) |" in line
    assert "| 2.00 h (mean of 3 seeds) |" in line
    assert "seed 0: 2026-12-01" in line and "seed 2: 2026-12-03" in line
    (other,) = other_rows(text)
    assert "older run of seed 1" in other
    assert "sample standard deviation" in text


def test_one_seed_takes_the_newest_run(runs, tmp_path):
    write(runs, record("lra/listops-full", 30.0, date="2026-12-01T00:00:00Z"))
    write(runs, record("lra/listops-full", 31.0, date="2026-12-02T00:00:00Z"))
    assert "| 31.0 |" in row(table(tmp_path), "lra/listops-full")


def test_epoch_recipes_check_the_epochs(runs, tmp_path):
    name = "synthetic/shapes-full"
    write(runs, record(name, 90.0, date="2026-12-01T00:00:00Z", max_steps=-1, max_epochs=4, epochs=4, steps=256))
    write(runs, record(name, 50.0, date="2026-12-02T00:00:00Z", max_steps=-1, max_epochs=4, epochs=2, steps=128))
    text = table(tmp_path, "main")
    assert "| 90.0 |" in row(text, name)
    assert any("| epochs 2 of 4 |" in line for line in other_rows(text))


def test_unresolved_max_steps_is_read_from_the_experiment_file(runs, tmp_path):
    write(runs, record("lra/listops-full", 36.0, max_steps="${oc.env:STEPS}", steps=5000))
    assert "| 36.0 |" in row(table(tmp_path), "lra/listops-full")


def _all_tasks(runs: Path, method: str, tasks: list[str], value: float = 50.0) -> None:
    for i, task in enumerate(tasks):
        steps = LRA_STEPS[task]
        write(runs, record(f"lra/{task}-{method}", value + i, steps=steps, max_steps=steps, wall_time_s=1800))


def summary_row(text: str, label: str) -> str:
    summary = text.split("**5-task averages**", 1)[1]
    return next(line for line in summary.splitlines() if line.startswith(f"| {label} |"))


def test_five_task_average_only_when_complete(runs, tmp_path):
    _all_tasks(runs, "mita", ["listops", "text", "retrieval", "image"])
    text = table(tmp_path)
    assert "| incomplete: 4 of 5 tasks | 58.91 | — | 2.4 h |" in summary_row(text, "MiTA")
    _all_tasks(runs, "mita", ["pathfinder"], value=54.0)
    text = table(tmp_path)
    # (50 + 51 + 52 + 53 + 54) / 5 = 52.00; 5 x 0.5 h.
    assert summary_row(text, "MiTA") == "| MiTA | 52.00 | 58.91 | 2.50 h | 2.4 h |"
    assert "| incomplete: 0 of 5 tasks | 58.19 |" in summary_row(text, "Full attention")


def test_table_d_layout_and_not_run_text(runs, tmp_path):
    text = table(tmp_path)
    header = next(line for line in text.splitlines() if line.startswith("| row |"))
    assert (
        header == "| row | experiment | ours (test accuracy) | PyTorch ports (softmax) | training time | provenance |"
    )
    names = [line.split(" | ")[1].strip("`") for line in text.splitlines() if line.startswith("| ") and "`lra/" in line]
    tasks = [n.split("/")[1].split("-")[0] for n in names]
    assert tasks == [t for t in make_tables.LRA_TASKS for _ in make_tables.LRA_METHODS]
    assert [n.split("-", 1)[1] for n in names[:6]] == make_tables.LRA_METHODS
    assert "| not run: needs the release data |" in row(text, "lra/text-mita")
    assert "| not run: needs the release data |" in row(text, "lra/image-full")
    assert "| not run |" in row(text, "lra/pathfinder-moba") and "release" not in row(text, "lra/listops-full")


def test_ports_column_reads_the_paper_block(runs, tmp_path, monkeypatch):
    text = table(tmp_path)
    ports = {t: row(text, f"lra/{t}-full").split(" | ")[3] for t in make_tables.LRA_TASKS}
    assert ports == {"listops": "37.10", "text": "65.02", "retrieval": "79.35", "image": "38.20", "pathfinder": "74.16"}
    assert row(text, "lra/listops-mita").split(" | ")[3] == "—"
    assert "| PyTorch ports, softmax (published recipe) | — | 58.77 |" in text
    blocks = make_tables.paper_blocks()
    blocks["lra/listops-full"] = dict(blocks["lra/listops-full"], recipe_softmax_pytorch_ports=12.34)
    monkeypatch.setattr(make_tables, "paper_blocks", lambda: blocks)
    assert row(table(tmp_path), "lra/listops-full").split(" | ")[3] == "12.34"


def test_time_column_says_when_the_gpu_was_shared(runs, tmp_path):
    shared = {"processes": 18, "group": "batch-1"}
    write(runs, record("lra/listops-mita", 37.0, wall_time_s=288, concurrency=shared))
    write(runs, record("lra/listops-full", 37.0, wall_time_s=288, concurrency={"processes": 1, "group": "solo"}))
    text = table(tmp_path)
    assert "| 0.08 h (GPU shared by 18 runs) |" in row(text, "lra/listops-mita")
    assert "| 0.08 h |" in row(text, "lra/listops-full")


def test_time_column_counts_the_sharing_of_every_segment(runs, tmp_path):
    """A resumed run that shared the GPU in an earlier process says so even if its last process ran alone; varied
    sharing reads "up to"; unknown segments are passed over."""
    write(runs, record("lra/listops-mita", 37.0, wall_time_s=288, segment_processes=[3, None, 1], concurrency=None))
    write(runs, record("lra/listops-full", 37.0, wall_time_s=288, segment_processes=[2, 2], concurrency=None))
    write(runs, record("lra/listops-moba", 37.0, wall_time_s=288, segment_processes=[None, 1], concurrency=None))
    older = record("lra/listops-topk", 37.0, wall_time_s=288, concurrency={"processes": 5, "group": "g"})
    del older["segment_processes"]  # records written before the key: the last process's concurrency
    write(runs, older)
    text = table(tmp_path)
    assert "| 0.08 h (GPU shared by 5 runs) |" in row(text, "lra/listops-topk")
    assert "| 0.08 h (GPU shared by up to 3 runs) |" in row(text, "lra/listops-mita")
    assert "| 0.08 h (GPU shared by 2 runs) |" in row(text, "lra/listops-full")
    assert "| 0.08 h |" in row(text, "lra/listops-moba")


def test_stamped_commit_is_marked(runs, tmp_path):
    write(runs, record("lra/listops-full", 37.0, source="stamped"))
    assert "01234567 (stamped)" in row(table(tmp_path), "lra/listops-full")


def test_run_continued_across_commits_names_the_earlier_ones(runs, tmp_path):
    last = "0123456789abcdef0123456789abcdef01234567"
    write(runs, record("lra/listops-full", 37.0, segment_commits=[None, "feedbeef" * 5, "feedbeef" * 5, last]))
    cell = row(table(tmp_path), "lra/listops-full")
    assert "01234567, earlier segments at ?, feedbeef" in cell


def test_time_cell_prefers_the_run_and_marks_estimates():
    estimate = {"estimate_h": "0.25", "hardware": "NVIDIA H200", "date": "2026-11-30T10:00:00Z"}
    assert make_tables.time_cell([{"wall_time_s": 7200}], estimate) == "2.00 h"
    assert make_tables.time_cell([], estimate) == "est. 0.25 h (NVIDIA H200, 2026-11-30)"
    assert make_tables.time_cell(None, None) == "—"


def test_table_d_reads_time_estimates(tmp_path, monkeypatch):
    csv_path = tmp_path / "time_estimate.csv"
    csv_path.write_text("experiment,estimate_h,hardware,date\nlra/listops-mita,0.5,GPU X,2026-11-30T00:00:00Z\n")
    monkeypatch.setattr(make_tables, "TIME_ESTIMATES", csv_path)
    text = make_tables.build_table("D", tmp_path / "no-records", tmp_path / "no-flops.csv", tmp_path)
    line = row(text, "lra/listops-mita")
    assert "est. 0.50 h (GPU X, 2026-11-30)" in line and "not run" in line


def _populate(runs: Path) -> None:
    for seed in range(3):
        overrides = ["experiment=lra/listops-mita", f"seed={seed}"]
        write(
            runs,
            record("lra/listops-mita", 37.0 + seed / 3, overrides=overrides, date=f"2026-12-0{seed + 1}T00:00:00Z"),
        )
    write(runs, record("lra/listops-full", 1.0, steps=3, max_steps=3, overrides=["trainer.max_steps=3"]))
    write(runs, record("synthetic/shapes-mita", 95.6, max_steps=-1, max_epochs=3, epochs=3))


def _build_all(root: Path) -> dict[str, bytes]:
    tables = root / "results" / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    for name in ("D", "main"):
        (tables / f"{name}.md").write_text(
            make_tables.build_table(name, root / "results" / "runs", root / "no-flops.csv", tables)
        )
    readme = root / "README.md"
    readme.write_text(f"intro\n{make_tables.README_BEGIN}\n{make_tables.README_END}\n")
    make_tables.update_readme(readme, tables)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted([readme, *tables.glob("*.md")])}


def test_tables_are_byte_identical_across_builds_and_clones(tmp_path, monkeypatch):
    monkeypatch.setattr(make_tables, "TIME_ESTIMATES", tmp_path / "no-estimates.csv")
    first = tmp_path / "a"
    _populate(first / "results" / "runs")
    once = _build_all(first)
    assert _build_all(first) == once
    clone = tmp_path / "elsewhere" / "clone"
    shutil.copytree(first / "results" / "runs", clone / "results" / "runs")
    assert _build_all(clone) == once
    text = once["README.md"].decode()
    assert str(tmp_path) not in text and "[D.md](results/tables/D.md)" in text
    assert "](../runs/lra/listops-mita/" in once["results/tables/D.md"].decode()


def test_readme_block_summarises_each_table_with_its_run_rows(tmp_path):
    tables = tmp_path / "results" / "tables"
    tables.mkdir(parents=True)
    (tables / "A.md").write_text(
        "# Table A: one\n\n| row | experiment | ours | provenance |\n|---|---|---|---|\n"
        "| Row 1 | `a/x` | 71.2 | 2026-12-01, 0123abcd, 8x NVIDIA H200, 100 epochs ([record](../runs/x.json)) |\n"
        "| Row 2 | `a/y` | not run | not run |\n\nA note.\n"
    )
    (tables / "main.md").write_text("# Main\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{make_tables.README_BEGIN}\nold\n{make_tables.README_END}\noutro\n")
    assert make_tables.update_readme(readme, tables)
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro") and text.rstrip().endswith("outro")
    assert text.index("| Main |") < text.index("| Table A: one |")
    assert "| Table A: one | 1 of 2 | Row 1: 71.2 (2026-12-01, 8x NVIDIA H200) | [A.md](results/tables/A.md) |" in text
    assert "| Main | — | — | [main.md](results/tables/main.md) |" in text
    assert make_tables.update_readme(readme, tables) and readme.read_text() == text
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    assert not make_tables.update_readme(plain, tables) and plain.read_text() == "no markers\n"


def test_dirty_tree_record_never_fills_the_row(runs, tmp_path):
    clean = record("lra/listops-full", 30.0, date="2026-12-01T10:00:00Z")
    dirty = record("lra/listops-full", 40.0, date="2026-12-02T10:00:00Z")
    dirty["git"]["dirty"] = True
    write(runs, clean)
    write(runs, dirty)
    text = table(tmp_path)
    assert "| 30.0 |" in row(text, "lra/listops-full")
    assert any("dirty tree" in line and "40.0" in line for line in other_rows(text))


def test_import_copies_qualifying_records_with_their_files_and_indexes_relative_paths(tmp_path):
    from tasks.common.records import write_index

    source, target = tmp_path / "outputs" / "runs", tmp_path / "results" / "runs"
    good = write(source, record("lra/listops-full", 30.0))
    (good.parent / (good.stem + ".metrics.csv")).write_text("step,loss\n1,2.0\n")
    (good.parent / (good.stem + "-metrics-before-resume-0.metrics.csv")).write_text("step,loss\n0,2.3\n")
    dirty_rec = record("lra/listops-mita", 31.0)
    dirty_rec["git"]["dirty"] = True
    dirty = write(source, dirty_rec)
    smoke = write(source, record("lra/listops-topk", 32.0, smoke=True))
    lines = make_tables.import_records(source, target)
    rel = good.relative_to(source)
    assert f"copied {rel}" in lines
    assert any(line.startswith(f"skipped {dirty.relative_to(source)}: dirty tree") for line in lines)
    assert any(line.startswith(f"skipped {smoke.relative_to(source)}: smoke") for line in lines)
    copied = sorted(p.name for p in (target / rel).parent.iterdir())
    assert copied == sorted([good.name, good.stem + ".metrics.csv", good.stem + "-metrics-before-resume-0.metrics.csv"])
    assert not (target / "lra" / "listops-mita").exists() and not (target / "lra" / "listops-topk").exists()
    assert f"already there: {rel}" in make_tables.import_records(source, target)
    index = write_index(target).read_text().splitlines()
    assert index[0].startswith("experiment,date,metric,value")
    assert len(index) == 2 and index[1].split(",")[-1] == rel.as_posix()


def test_listops_rule_note_reads_the_record(tmp_path: Path) -> None:
    splits = {
        "train": {"n": 7, "first_operator": 5 / 7, "majority": 3 / 7},
        "val": {"n": 4, "first_operator": 0.75, "majority": 0.25},
        "test": {"n": 4, "first_operator": 0.5, "majority": 0.25},
    }
    path = tmp_path / "rule.json"
    path.write_text(json.dumps({"command": "python x --baseline", "date": "2026-12-04T16:05:32Z", "splits": splits}))
    note = "\n".join(make_tables.listops_rule_note(path))
    assert "71.43 on our train split, 75.00 on val and 50.00 on test" in note
    assert "(2026-12-04, `python x --baseline`)" in note
    assert make_tables.listops_rule_note(tmp_path / "missing.json") == []
