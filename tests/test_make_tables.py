"""scripts/make_tables.py: the training-time column and the README's generated block."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("make_tables", ROOT / "scripts" / "make_tables.py")
make_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_tables)


def test_time_cell_prefers_the_run_and_marks_estimates():
    estimate = {"estimate_h": "0.25", "hardware": "NVIDIA H200", "date": "2026-11-30T10:00:00Z"}
    assert make_tables.time_cell({"wall_time_s": 7200}, estimate) == "2.00 h"
    assert make_tables.time_cell(None, estimate) == "est. 0.25 h (NVIDIA H200, 2026-11-30)"
    assert make_tables.time_cell(None, None) == "—"


def test_table_d_reads_time_estimates(tmp_path, monkeypatch):
    csv_path = tmp_path / "time_estimate.csv"
    csv_path.write_text("experiment,estimate_h,hardware,date\nlra/listops-mita,0.5,GPU X,2026-11-30T00:00:00Z\n")
    monkeypatch.setattr(make_tables, "TIME_ESTIMATES", csv_path)
    text = make_tables.build_table("D", tmp_path / "no-records", tmp_path / "no-flops.csv", tmp_path)
    row = next(line for line in text.splitlines() if "`lra/listops-mita`" in line)
    assert "est. 0.50 h (GPU X, 2026-11-30)" in row and "not run" in row


def test_readme_block_is_replaced_and_links_rewritten(tmp_path):
    tables = tmp_path / "results" / "tables"
    tables.mkdir(parents=True)
    (tables / "A.md").write_text("# Table A\n\n| a | [record](../runs/x.json) |\n")
    (tables / "main.md").write_text("# Main\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{make_tables.README_BEGIN}\nold\n{make_tables.README_END}\noutro\n")
    assert make_tables.update_readme(readme, tables)
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro") and text.rstrip().endswith("outro")
    assert text.index("#### Main") < text.index("#### Table A")
    assert "(results/runs/x.json)" in text
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    assert not make_tables.update_readme(plain, tables) and plain.read_text() == "no markers\n"
