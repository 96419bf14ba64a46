"""scripts/lra_time.py on the CPU at tiny sizes: it composes each experiment file, times optimiser steps on
synthetic batches of the task's shape and writes the estimate CSV; --table picks Table D's and E's rows."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lra_time():
    spec = importlib.util.spec_from_file_location("lra_time_under_test", ROOT / "scripts" / "lra_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_estimates_full_and_mita_side_by_side(lra_time, tmp_path):
    out = tmp_path / "time.csv"
    rows = lra_time.main(
        ["--experiments", "lra/listops-full", "lra/listops-mita", "arxiv/16k-mita", "--steps", "2", "--warmup", "1",
         "--device", "cpu", "--out", str(out), "data.batch_size=2", "data.max_length=256"]
    )  # fmt: skip
    assert [r["experiment"] for r in rows] == ["lra/listops-full", "lra/listops-mita", "arxiv/16k-mita"]
    for r in rows:
        assert (r["batch"], r["length"]) == (2, 256) and r["step_s"] > 0 and r["kind"] == "estimate"
        assert float(r["load_1m"]) >= 0 and r["gpu_other_procs"]  # whether the machine was shared
        assert r["estimate_h"] == pytest.approx(r["step_s"] * r["max_steps"] / 3600, rel=1e-3, abs=1e-4)
    assert rows[0]["max_steps"] == 5000
    with open(out) as f:
        written = list(csv.DictReader(f))
    assert [w["experiment"] for w in written] == [r["experiment"] for r in rows]


def test_rows_written_as_each_experiment_finishes(lra_time, tmp_path, monkeypatch):
    """The CSV holds every finished experiment's row at once, so a run cut short (a time limit, a crash) keeps them:
    here the second experiment fails and the first row is on disk."""
    real = lra_time.time_experiment

    def flaky(experiment, *a, **kw):
        if experiment == "lra/listops-mita":
            raise RuntimeError("cut")
        return real(experiment, *a, **kw)

    monkeypatch.setattr(lra_time, "time_experiment", flaky)
    monkeypatch.setenv("MITA_COMMIT", "abc1234def")
    out = tmp_path / "time.csv"
    with pytest.raises(RuntimeError, match="cut"):
        lra_time.main(
            ["--experiments", "lra/listops-full", "lra/listops-mita", "--steps", "1", "--warmup", "0", "--device",
             "cpu", "--out", str(out), "data.batch_size=2", "data.max_length=128"]
        )  # fmt: skip
    with open(out) as f:
        written = list(csv.DictReader(f))
    assert [w["experiment"] for w in written] == ["lra/listops-full"] and float(written[0]["step_s"]) > 0
    # Provenance beside the number: the commit timed (stamped on a machine without .git) and the steps behind it.
    assert written[0]["commit"] == "abc1234" and written[0]["timed_steps"] == "1"
    assert not out.with_name("time.csv.tmp").exists()


def test_table_options_list_every_row(lra_time, monkeypatch):
    seen = []
    monkeypatch.setattr(
        lra_time, "time_experiment", lambda exp, *a, **kw: seen.append(exp) or {"experiment": exp, "batch": 1,
                                                                          "length": 1, "max_steps": 1, "step_s": 0.0,
                                                                          "estimate_h": 0.0}
    )  # fmt: skip
    lra_time.main(["--table", "D", "--table", "E", "--device", "cpu"])
    # Hydra overrides go before --experiments (speed_survey.sh's form), which would take them as experiment names.
    calls = []

    def record(exp, steps, warmup, device, overrides, vf, mode):
        calls.append((exp, overrides, vf, mode))
        return {"experiment": exp, "batch": 1, "length": 1, "max_steps": 1, "step_s": 0.0, "estimate_h": 0.0}

    monkeypatch.setattr(lra_time, "time_experiment", record)
    lra_time.main(["model.attention.chunk_size=64", "--valid-fraction", "0.34", "--experiments", "lra/listops-topk",
                   "--device", "cpu"])  # fmt: skip
    assert calls == [("lra/listops-topk", ["model.attention.chunk_size=64"], 0.34, "eager")]
    assert len(seen) == 30 + 6
    rows = ("full", "mita", "mita_routing", "agent_minus", "moba", "topk")
    tasks = ("listops", "text", "retrieval", "image", "pathfinder")
    assert seen[:30] == sorted(f"lra/{t}-{r}" for t in tasks for r in rows)
    assert seen[-6:] == [f"arxiv/{n}-{a}" for n in ("16k", "32k", "64k") for a in ("full", "mita")]
    for exp in seen:
        assert (ROOT / "configs" / "experiment" / f"{exp}.yaml").exists(), exp


def test_valid_fraction_pads_the_batches(lra_time, monkeypatch):
    """With padding the encoder compacts each batch to its longest row (here 256 -> at most 128 tokens) and the row
    records the fraction."""
    import mita.models.lra as lra_model

    real, lengths = lra_model.compact_padding, []

    def compact(*args, **kwargs):
        out = real(*args, **kwargs)
        lengths.append(out[0].shape[1])
        return out

    monkeypatch.setattr(lra_model, "compact_padding", compact)
    kw = dict(steps=1, warmup=1, device="cpu", overrides=["data.batch_size=2", "data.max_length=256"])
    row = lra_time.time_experiment("lra/pathfinder-mita", valid_fraction=0.3, **kw)
    assert row["valid_fraction"] == 0.3 and row["length"] == 256 and row["step_s"] > 0
    assert lengths and max(lengths) <= 128
    with pytest.raises(ValueError, match="valid_fraction"):
        lra_time.time_experiment("lra/pathfinder-mita", valid_fraction=0.0, **kw)


def test_cuda_graph_mode_is_refused_off_cuda_and_kept_out_of_the_tables(lra_time, tmp_path):
    """--mode cuda_graph needs CUDA (a clear error on the CPU, before any model is built), an unknown mode is
    refused, and make_tables reads only eager rows of an estimate CSV (a replayed step is not what training runs)."""
    import importlib.util

    with pytest.raises(ValueError, match="mode cuda_graph needs device cuda"):
        lra_time.build_step("lra/listops-full", "cpu", [], mode="cuda_graph")
    with pytest.raises(ValueError, match="mode must be one of"):
        lra_time.build_step("lra/listops-full", "cpu", [], mode="compiled")
    with pytest.raises(SystemExit):
        lra_time.main(["--mode", "compiled", "--experiments", "lra/listops-full", "--device", "cpu"])
    spec = importlib.util.spec_from_file_location("make_tables_under_test", ROOT / "scripts" / "make_tables.py")
    make_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tables)
    csv_path = tmp_path / "estimates.csv"
    csv_path.write_text(
        "experiment,mode,step_s,estimate_h\n"
        "lra/listops-full,eager,0.009,0.0125\n"
        "lra/listops-full,cuda_graph,0.002,0.0028\n"
        "lra/listops-mita,cuda_graph,0.003,0.0042\n"
    )
    rows = make_tables.read_time_estimates(csv_path)
    assert set(rows) == {"lra/listops-full"} and rows["lra/listops-full"]["step_s"] == "0.009"
    # Older CSVs without a mode column are eager.
    csv_path.write_text("experiment,step_s,estimate_h\nlra/listops-full,0.009,0.0125\n")
    assert set(make_tables.read_time_estimates(csv_path)) == {"lra/listops-full"}


@pytest.mark.gpu
@pytest.mark.parametrize("experiment", ["lra/listops-full", "lra/listops-mita", "lra/listops-topk"])
def test_cuda_graph_step_captures_and_trains(lra_time, experiment):
    """A whole training step captures on CUDA (no host synchronisation in it, padding included: the batch's valid
    lengths come from the CPU) and each replay updates the parameters, which stay finite; the row records the
    mode."""
    import gc

    import torch

    overrides = ["data.batch_size=4", "data.max_length=512"]
    step, cfg, B, N = lra_time.build_step(experiment, "cuda", overrides, 0.6, "cuda_graph")
    params = [p for p in step.net.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    # Whatever the graph reads must outlive build_step: memory freed since then is overwritten here (labels and
    # optimiser state the replay no longer held became garbage at the first replay).
    gc.collect()
    junk = [torch.full((n,), -1, device="cuda", dtype=torch.int64) for n in (4, 64, 512, 4096, 65536)]
    junk += [torch.full_like(p, float("nan")) for p in params for _ in range(2)]
    step()
    torch.cuda.synchronize()
    del junk
    changed = [not torch.equal(a, p) for a, p in zip(before, params)]
    assert sum(changed) > len(params) // 2
    assert all(torch.isfinite(p).all() for p in params)
    row = lra_time.time_experiment(experiment, 2, 1, "cuda", overrides, 0.6, mode="cuda_graph")
    assert row["mode"] == "cuda_graph" and row["step_s"] > 0
