"""The layer-level benchmark (scripts/bench/bench_layers.py) end to end on the CPU at its smoke point: every
registered attention gets a row, a correctness verdict and speed-ups over the dense reference; a layer whose gate
fails is refused a speed-up."""

from __future__ import annotations

import csv

import pytest
import torch
from script_loader import fresh_bench_script


@pytest.fixture
def bench(monkeypatch):
    return fresh_bench_script(monkeypatch, "bench_layers")


def test_every_registered_attention_is_benchmarked_on_cpu(bench, tmp_path):
    from mita.registry import list_attentions

    rows = bench.main(
        ["--device", "cpu", "--points", "tiny", "--dtype", "float32", "--reps", "1", "--out", str(tmp_path)]
    )
    with open(tmp_path / "layer_bench.csv") as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows)
    by_method = {r["method"]: r for r in written}
    expected = {"full[auto]"} | {a for a in list_attentions() if a != "full"}
    assert set(by_method) == expected
    for method, r in by_method.items():
        assert r["correctness"] == "PASS", (method, r)
        assert float(r["fwd_ms"]) > 0 and float(r["fwdbwd_ms"]) > 0
        assert r["best_dense_fwd"] == "full[auto]"
        if method != "full[auto]":
            ratio = float(by_method["full[auto]"]["fwd_ms"]) / float(r["fwd_ms"])
            assert float(r["speedup_fwd"]) == pytest.approx(ratio)


def test_failed_gate_refuses_the_speedup(bench, tmp_path, monkeypatch):
    real_gate = bench.gate
    monkeypatch.setattr(bench, "gate", lambda name, *a: (False, "forced") if name == "linear" else real_gate(name, *a))
    rows = bench.main(
        ["--device", "cpu", "--points", "tiny", "--dtype", "float32", "--out", str(tmp_path), "--attentions",
         "full,linear,mita"]
    )  # fmt: skip
    by_method = {r["method"]: r for r in rows}
    assert set(by_method) == {"full[auto]", "linear", "mita"}
    assert by_method["linear"]["correctness"].startswith("FAIL")
    assert by_method["linear"]["speedup_fwd"] == "refused: correctness gate"
    assert isinstance(by_method["mita"]["speedup_fwd"], float)


def test_unknown_attention_is_a_clear_error(bench, tmp_path):
    with pytest.raises(SystemExit, match="unknown attention"):
        bench.main(["--device", "cpu", "--points", "tiny", "--attentions", "nope", "--out", str(tmp_path)])


def test_long_point_uses_1d_layouts_on_cpu(bench, tmp_path):
    """Long points have no patch grid: MiTA, Agent Attention and MoBA run their 1D layouts (no prefix token), and
    the gate shrinks nothing there (N = 1024 is its own size)."""
    rows = bench.main(
        ["--device", "cpu", "--points", "N1024", "--dtype", "float32", "--out", str(tmp_path), "--attentions",
         "full,agent,moba,mita"]
    )  # fmt: skip
    by_method = {r["method"]: r for r in rows}
    assert set(by_method) == {"full[auto]", "agent", "moba", "mita"}
    for method, r in by_method.items():
        assert "error" not in r, (method, r)
        assert r["correctness"] == "PASS", (method, r)
    assert all(p["grid"] is None for p in bench.points(1 << 12) if p["layout"] == "1d")


def test_rounds_interleave_methods_and_take_the_median(bench, tmp_path, monkeypatch):
    """--rounds R times every method R times, the methods interleaved; each stage reports the median of the rounds'
    medians and their range as spread."""
    order = []
    real = bench.measure

    def spy(layer, x, *a, **kw):
        order.append(type(layer).__name__)
        return real(layer, x, *a, **kw)

    monkeypatch.setattr(bench, "measure", spy)
    rows = bench.main(
        ["--device", "cpu", "--points", "tiny", "--dtype", "float32", "--out", str(tmp_path), "--attentions",
         "full,mita", "--rounds", "3", "--reps", "2"]
    )  # fmt: skip
    assert all(r["rounds"] == 3 and r["fwd_ms"] > 0 and r["fwdbwd_spread_ms"] >= 0 for r in rows)
    # Round 1 per method as it is built, then rounds 2 and 3 alternate between the two layers.
    assert len(order) == 6 and order[2:4] == order[:2] and order[4:] == order[:2] and order[0] != order[1]
    first = {"fwd_ms": 3.0, "fwdbwd_ms": 9.0, "fwd_spread_ms": 0.1, "fwd_peak_mib": 5.0}
    later = [{"fwd_ms": 1.0, "fwdbwd_ms": 8.0}, {"fwd_ms": 2.0, "fwdbwd_ms": 4.0}]
    row = bench.combine_rounds(first, later)
    assert row["fwd_ms"] == 2.0 and row["fwd_spread_ms"] == 2.0
    assert row["fwdbwd_ms"] == 8.0 and row["fwdbwd_spread_ms"] == 5.0
    assert row["fwd_peak_mib"] == 5.0 and row["rounds"] == 3


def test_timing_modes_need_cuda_and_are_checked(bench, tmp_path):
    base = ["--device", "cpu", "--points", "tiny", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="need a CUDA device"):
        bench.main([*base, "--timing", "eager,cuda_graph_queued"])
    with pytest.raises(SystemExit, match="--timing takes"):
        bench.main([*base, "--timing", "graph"])
    assert not list(tmp_path.iterdir())


def test_rows_carry_their_timing_and_a_failed_capture_is_an_error(bench, monkeypatch):
    """Each timing mode is its own set of rows: speed-ups against the fastest dense layer of the same mode; a layer
    whose CUDA-graph capture fails keeps the stages it timed and gets the capture's error."""
    calls = []

    def fake_time_call(fn, device, warmup, reps, timing="eager"):
        calls.append(timing)
        if timing == "cuda_graph" and len(calls) == 6:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return (2.0 if timing == "eager" else 1.0), 0.0

    monkeypatch.setattr(bench, "time_call", fake_time_call)
    p = next(q for q in bench.points(1 << 12) if q["name"] == "tiny")
    layer = bench.build("full", {}, p)
    x = torch.randn(p["B"], p["N"], p["H"] * p["d"], requires_grad=True)
    eager = bench.measure(layer, x, p["grid"], "cpu", False, timing="eager")
    graph_ok = bench.measure(layer, x, p["grid"], "cpu", False, timing="cuda_graph")
    graph_failed = bench.measure(layer, x, p["grid"], "cpu", False, timing="cuda_graph")
    assert calls == ["eager"] * 2 + ["cuda_graph"] * 4
    assert eager["fwd_ms"] == eager["fwdbwd_ms"] == 2.0 and "error" not in eager
    assert graph_ok["fwd_ms"] == 1.0 and "error" not in graph_ok
    assert graph_failed["fwd_ms"] == 1.0 and "fwdbwd_ms" not in graph_failed
    assert "fwd+bwd" in graph_failed["error"]
    # An eager failure is a failure, not a row.
    monkeypatch.setattr(bench, "time_call", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        bench.measure(layer, x, p["grid"], "cpu", False)

    class Args:
        device, dtype = "cuda", "bfloat16"

    res = {"full[flash]": {"fwd_ms": 2.0, "fwdbwd_ms": 6.0}, "full[cudnn]": {"fwd_ms": 1.0, "fwdbwd_ms": 8.0},
           "mita": {"fwd_ms": 0.5, "error": "capture failed (fwd+bwd)"}}  # fmt: skip
    gates = dict.fromkeys(res, (True, "ok"))
    rows = {r["method"]: r for r in bench.point_rows(p, res, gates, "cuda_graph_queued", {"gpu": "x"}, Args)}
    assert {r["timing"] for r in rows.values()} == {"cuda_graph_queued"}
    assert rows["mita"]["best_dense_fwd"] == "full[cudnn]" and rows["mita"]["speedup_fwd"] == 2.0
    assert "speedup_fwdbwd" not in rows["mita"] and rows["mita"]["error"].startswith("capture failed")
    assert rows["full[cudnn]"]["best_dense_fwdbwd"] == "full[flash]"
