"""Helpers of the benchmarks that run without a GPU (scripts/bench/common.py, make_report.py, bench_figf.py)."""

from __future__ import annotations

import pytest
import torch
from script_loader import fresh_bench_script, load_bench_script


@pytest.fixture
def common(monkeypatch):
    return fresh_bench_script(monkeypatch, "common")


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9, 0.99])
def test_correlated_tokens_have_unit_variance_and_lag1_correlation_rho(common, rho):
    g = torch.Generator().manual_seed(0)
    x = common.correlated_tokens((2, 2, 40000, 8), rho, g, device="cpu", dtype=torch.float32)
    assert x.shape == (2, 2, 40000, 8)
    var = x.var().item()
    lag1 = (x[..., 1:, :] * x[..., :-1, :]).mean().item() / var
    assert abs(var - 1) < 0.1
    assert abs(lag1 - rho) < 0.02
    # Independent across channels and heads: correlation of two channels near 0.
    c = (x[..., 0] * x[..., 1]).mean().item() / var
    assert abs(c) < 0.1


def test_correlated_tokens_rejects_rho_out_of_range(common):
    with pytest.raises(ValueError, match="rho"):
        common.correlated_tokens((1, 8, 2), 1.0, torch.Generator(), device="cpu")


@pytest.fixture
def report(monkeypatch):
    return fresh_bench_script(monkeypatch, "make_report")


def test_report_orders_runs_by_number_and_labels_fused_mlp(report, tmp_path):
    assert sorted(["h200_run16", "h200_run9", "h200_run10"], key=report.run_order) == [
        "h200_run9",
        "h200_run10",
        "h200_run16",
    ]
    rows = []
    for run, mlp in (("h200_run9", ""), ("h200_run16", "fused (Triton, {})")):
        (tmp_path / run).mkdir()
        path = tmp_path / run / "figf.csv"
        path.write_text(
            "N,method,tokens_per_s,batch,m,k,speedup,timing,model,mlp\n"
            f"65536,full (cudnn),4.5e6,1,,,,eager,compiled,{mlp}\n"
            f"65536,mita (triton),9.0e7,32,128,128,20.0,eager,compiled,{mlp}\n"
        )
        rows += report.read([str(path)])
    assert [r["timing"] for r in rows] == ["eager+compile"] * 2 + ["eager+compile+fused-mlp"] * 2
    table = report.figf_table([dict(r, gpu="g", torch="t", triton="tr") for r in rows])
    assert "| 65536 | h200_run16 | eager+compile+fused-mlp | full (cudnn) |" in table
    report.figf_plot(rows, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 0
    # The full-attention curve takes each N from the latest run that measured it.
    extra = dict(rows[0], run="h200_run20", N="1048576", tokens_per_s="2.6e5")
    series = sorted({(r["run"], r["timing"]) for r in [*rows, extra]})
    assert report.full_curve([*rows, extra], series) == {65536: (4.5e6, "h200_run16"), 1048576: (2.6e5, "h200_run20")}


@pytest.fixture
def figf():
    return load_bench_script("bench_figf")


def test_fused_mlp_gate_passes_and_can_fail(figf, monkeypatch):
    """The gate bench_figf.py --fused-mlp runs (on the CPU the kernel runs under TRITON_INTERPRET=1)."""
    pytest.importorskip("triton")
    fm = figf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    ok, msg = figf.fused_mlp_correct(device, dim=32, hidden=64, dtype=dtype)
    assert ok, msg
    # A kernel that dropped fc2's bias fails it.
    real = fm.residual_mlp_op

    def no_b2(x, a, ln_w, ln_b, eps, w1, b1, w2, b2, tanh):
        return real(x, a, ln_w, ln_b, eps, w1, b1, w2, None, tanh)

    monkeypatch.setattr(fm, "residual_mlp_op", no_b2)
    ok, msg = figf.fused_mlp_correct(device, dim=32, hidden=64, dtype=dtype)
    assert not ok and "rel err" in msg


def test_mlp_settings_parse_and_reject_unknown_keys(figf):
    assert figf.mlp_settings("bh=32, reload=1") == {"bh": 32, "reload": 1}
    assert figf.mlp_settings("") == {}
    with pytest.raises(SystemExit, match="unknown fused MLP setting 'bhh'"):
        figf.mlp_settings("bhh=32")


def test_report_add_run_updates_history_and_current_csvs(report, tmp_path):
    """make_report.py --add-run: a run's CSVs go to history.csv (run, benchmark, source, commit first) and become
    the current CSVs of their benchmarks; then README.md and figf.png are regenerated from them."""
    env = "date,gpu,driver,torch,triton"
    vals = "2026-12-05T00:00:00Z,g,d,t,tr"
    op = tmp_path / "new" / "op_bench_cuda_graph.csv"
    op.parent.mkdir()
    op.write_text(f"point,method,timing,fwd_ms,fwdbwd_ms,{env}\nN65536,mita_triton,cuda_graph,0.1,0.5,{vals}\n")
    figf = tmp_path / "new" / "figf_compiled.csv"
    figf.write_text(
        f"N,method,tokens_per_s,batch,m,k,speedup,timing,model,{env}\n"
        f"65536,full (cudnn),4.5e6,1,,,,eager,compiled,{vals}\n"
        f"65536,mita (triton),9.0e7,32,128,128,20.0,eager,compiled,{vals}\n"
    )
    out = tmp_path / "bench"
    out.mkdir()
    report.main(["--out", str(out), "--add-run", "h200_run25", "--commit", "abc1234", str(op), str(figf)])
    report.main(["--out", str(out), "--add-run", "h200_run26", str(op)])
    hist = report.read_rows(str(out / "history.csv"))
    assert [(r["run"], r["benchmark"], r["source"], r["commit"]) for r in hist] == [
        ("h200_run25", "op", "h200_run25/op_bench_cuda_graph.csv", "abc1234"),
        ("h200_run25", "figf", "h200_run25/figf_compiled.csv", "abc1234"),
        ("h200_run25", "figf", "h200_run25/figf_compiled.csv", "abc1234"),
        ("h200_run26", "op", "h200_run26/op_bench_cuda_graph.csv", ""),
    ]
    assert [r["run"] for r in report.read_rows(str(out / "op_bench.csv"))] == ["h200_run26"]
    assert [r["run"] for r in report.read_rows(str(out / "figf.csv"))] == ["h200_run25"] * 2
    text = (out / "README.md").read_text()
    assert "| N65536 | h200_run26 | cuda_graph | mita_triton | 0.100 | 0.500 |" in text
    assert "| 65536 | h200_run25 | eager+compile | full (cudnn) |" in text and "![Figure F](figf.png)" in text
    assert (out / "figf.png").stat().st_size > 0


def test_speed_table_puts_newest_eager_beside_newest_graph(report, tmp_path):
    """README's speed table: per point the newest eager and the newest CUDA-graph (queued) MiTA rows of the history
    measured on an H200, each with its own run; --history-only adds a run without replacing the current CSVs."""
    env = "B,H,N,d,m,k,date,gpu,driver,torch,triton"
    head = f"point,method,timing,fwd_ms,fwdbwd_ms,speedup_fwd,speedup_fwdbwd,{env}\n"
    at = "1,2,4096,64,32,32,2026-12-0{}T00:00:00Z,NVIDIA H200,d,t,tr\n"
    out = tmp_path / "bench"
    out.mkdir()
    runs = {
        "h200_run9": "N4096,mita_triton,eager,2.0,4.0,0.1,0.2," + at.format(1),
        "h200_run10": "N4096,mita_triton,cuda_graph_queued,0.07,0.15,0.5,0.9,"
        + at.format(2)
        + "N4096,dense_cudnn,cuda_graph_queued,0.04,0.14,,,"
        + at.format(2),
        "h200_run11": "N4096,mita_triton,eager,1.0,2.0,0.2,0.4," + at.format(3),
        # Newer, but another GPU: in the history, not in the table.
        "h100_run12": "N4096,mita_triton,eager,0.5,1.0,0.4,0.8," + at.format(4).replace("H200", "H100 80GB HBM3"),
    }
    for i, (run, rows) in enumerate(runs.items()):
        csv_path = tmp_path / run / "op_bench.csv"
        csv_path.parent.mkdir()
        csv_path.write_text(head + rows)
        only = ["--history-only"] if i >= 2 else []
        report.main(["--out", str(out), "--add-run", run, "--commit", f"c{i}", *only, str(csv_path)])
    assert [r["run"] for r in report.read_rows(str(out / "op_bench.csv"))] == ["h200_run10"] * 2  # 11, 12: history only
    assert "h100_run12" in {r["run"] for r in report.read_rows(str(out / "history.csv"))}
    readme = tmp_path / "README.md"
    readme.write_text(f"top\n{report.SPEED_BEGIN}\nold\n{report.SPEED_END}\nbottom\n")
    report.main(["--out", str(out), "--readme", str(readme)])
    text = readme.read_text()
    assert text.startswith("top\n") and text.endswith("bottom\n") and "old" not in text
    line = next(x for x in text.splitlines() if x.startswith("| N4096"))
    assert line == (
        "| N4096 (1 x 2, 4096, 64, 32, 32) | 1.000 / 2.000 | 0.20x / 0.40x | h200_run11, c2, 2026-12-03 "
        "| 0.070 / 0.150 | 0.50x / 0.90x | h200_run10, c1, 2026-12-02 |"
    )
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no speed-table markers"):
        report.main(["--out", str(out), "--readme", str(readme)])


def test_environment_says_whether_the_machine_was_shared(common):
    env = common.environment()
    assert float(env["load_1m"]) >= 0 and (env["gpu_other_procs"] == "unknown" or env["gpu_other_procs"].isdigit())
