"""The op benchmark's points and options (scripts/bench/bench_op.py); its timings need a GPU and run there only."""

from __future__ import annotations

import pytest
from script_loader import fresh_bench_script


@pytest.fixture
def bench(monkeypatch):
    return fresh_bench_script(monkeypatch, "bench_op")


def test_training_points_are_the_training_shapes(bench):
    pts = {p["name"]: p for p in bench.shapes(1 << 20, "training")}
    assert [n for n in pts if n.startswith("lra_")] == [f"lra_{t}" for t in bench.LRA_TASKS]
    shape = {n: (p["B"], p["H"], p["N"], p["d"], p["m"], p["k"], p["layout"]) for n, p in pts.items()}
    assert shape["deit_s"] == (256, 6, 197, 64, 25, 25, "official")
    assert shape["seg_1025"] == (64, 6, 1025, 64, 49, 49, "official")
    assert pts["seg_1025"]["grid"] == (32, 32) and 1 + 32 * 32 == 1025
    assert shape["B8_N4096"] == (8, 2, 4096, 64, 32, 32, "1d")
    assert shape["N16384"] == (1, 2, 16384, 64, 64, 64, "1d")
    assert shape["N65536"] == (1, 2, 65536, 64, 128, 128, "1d")
    # LRA: each task's MiTA experiment file (model width 2 heads x 128; Retrieval encodes two documents per row).
    assert shape["lra_listops"] == (32, 2, 2000, 128, 32, 64, "1d")
    assert shape["lra_text"] == (32, 2, 4096, 128, 32, 128, "1d")
    assert shape["lra_retrieval"] == (64, 2, 4000, 128, 32, 128, "1d")
    assert shape["lra_image"] == (256, 2, 1024, 128, 16, 64, "1d")
    assert shape["lra_pathfinder"] == (256, 2, 1024, 128, 16, 64, "1d")


def test_max_n_caps_both_sets(bench):
    assert max(p["N"] for p in bench.shapes(4096, "training")) == 4096
    assert "N65536" not in {p["name"] for p in bench.shapes(16384, "training")}
    assert [p["name"] for p in bench.shapes(4096, "long")] == ["deit_s", "N1024", "N4096"]
    with pytest.raises(ValueError, match="point_set"):
        bench.shapes(4096, "short")


def test_timing_list(bench):
    assert bench.parse_timings("eager") == ["eager"]
    assert bench.parse_timings("eager, cuda_graph_queued,eager") == ["eager", "cuda_graph_queued"]
    for bad in ("", "graph", "eager,cuda"):
        with pytest.raises(ValueError, match="--timing"):
            bench.parse_timings(bad)
    with pytest.raises(SystemExit, match="--timing"):
        bench.main(["--timing", "fast"])


def test_csv_names(bench):
    assert bench.csv_name("long", ["eager"]) == "op_bench.csv"
    assert bench.csv_name("long", ["cuda_graph_queued"]) == "op_bench_cuda_graph_queued.csv"
    assert bench.csv_name("training", ["eager", "cuda_graph_queued"]) == "op_bench_training_eager_cuda_graph_queued.csv"
    assert bench.csv_name("long", ["eager"], rho=0.9, block_top=2) == "op_bench_rho0.9_top2.csv"


def test_profiler_takes_the_same_points(monkeypatch):
    """profiler.py names the benchmark's points (training set, LRA shapes on demand, long rows) and refuses others."""
    prof = fresh_bench_script(monkeypatch, "profiler")
    bench = __import__("bench_op")
    assert prof.point("seg_1025") is next(p for p in bench.TRAINING_POINTS if p["name"] == "seg_1025")
    assert (prof.point("lra_text")["N"], prof.point("lra_text")["d"]) == (4096, 128)
    assert prof.point("N1048576")["m"] == 512 and prof.point("N1048576")["d"] == 64
    with pytest.raises(SystemExit, match="unknown point"):
        prof.point("N999")


def test_speed_survey_names_known_points_and_experiments(monkeypatch):
    """scripts/gpu/speed_survey.sh (GPU only) names points profiler.py knows and experiment files that exist."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "scripts" / "gpu" / "speed_survey.sh").read_text()
    prof = fresh_bench_script(monkeypatch, "profiler")
    names = re.search(r"points=\$\{POINTS:-([^}]*)\}", text).group(1).split(",")
    assert {p["name"] for p in prof.TRAINING_POINTS} <= set(names)
    for name in names + re.search(r"HOST_POINTS:-([^}]*)\}", text).group(1).split(","):
        assert prof.point(name)["name"] == name
    experiments = set(re.findall(r"lra/[a-z]+-[a-z_]+", text))
    assert len(experiments) == 8
    for exp in experiments:
        assert (root / "configs" / "experiment" / f"{exp}.yaml").exists(), exp
    # The short path's A/B sweep names settings sweep.py knows; the before / after step names known points.
    sweep = fresh_bench_script(monkeypatch, "sweep")
    sweeps = re.findall(r"--sweep (\S+)", text)
    assert sweeps == [
        "small.attn.tail=0,1",
        "small.bwd.tail=0,1",
        "small.route.maxnreg=168,None,128",
        "small.attn.maxnreg=168,None,128",
        "fwd.route_stream=3,0",
    ]
    values = [[0, 1], [0, 1], [168, None, 128], [168, None, 128], [3, 0]]
    assert [sweep.parse_sweep(item)[2] for item in sweeps] == values
    # The host step's variants are settings too.
    for item in re.search(r'profiler.py host .*?--variants "([^"]*)"', text, re.S).group(1).split("|")[1:]:
        assert sweep.parse_sweep(item)[0] is sweep.afwd.FWD_CONFIG
    # The short path's variant steps (route, backward): each variant a set of the short kernels' settings.
    blocks = [b.replace("\\\n", "") for b in re.findall(r'--variants \\\n\s*"([^"]*)"', text)]
    assert len(blocks) == 3
    for block, kernel, n in zip(blocks, ("attn", "route", "bwd"), (3, 3, 7)):
        variants = block.split("|")
        assert variants[0] == "" and len(variants) == n
        for v in variants[1:]:
            for item in v.split(";"):
                assert sweep.parse_sweep(item)[0] is sweep.ts.CONFIG[kernel]
    for name in re.search(r"--points (\S+) .*--timing eager,cuda_graph_queued", text).group(1).split(","):
        assert prof.point(name)["name"] == name


def test_main_times_every_point_in_every_mode(bench, tmp_path, monkeypatch):
    """The run loop on the CPU with the timing replaced: every point of the set gets each dense backend and MiTA in
    each timing mode, speed-ups against the fastest dense backend of the same point and mode, one CSV."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "none"})
    monkeypatch.setattr(bench, "mita_correct", lambda backend: (True, "stub"))
    monkeypatch.setattr(bench, "list_backends", lambda: ["triton", "torch"])
    fast = {"eager": 1.0, "cuda_graph_queued": 0.5}

    def measure(f, ins, do, long_run, timing="eager", reps_long=3):
        name = f.__qualname__  # dense_fn.<locals>.f or mita_fn.<locals>.f
        ms = fast[timing] * (2.0 if name.startswith("mita") else 1.0)
        return {"fwd_ms": ms, "fwdbwd_ms": 3 * ms, "fwd_peak_mib": 1.0, "fwdbwd_peak_mib": 2.0}

    monkeypatch.setattr(bench, "measure", measure)
    bench.main(["--out", str(tmp_path), "--point-set", "training", "--points", "deit_s,B8_N4096",
                "--timing", "eager,cuda_graph_queued", "--backends", "triton"])  # fmt: skip
    import csv

    with open(tmp_path / "op_bench_training_eager_cuda_graph_queued.csv") as f:
        rows = list(csv.DictReader(f))
    got = {(r["point"], r["timing"], r["method"]) for r in rows}
    methods = {"dense_flash", "dense_cudnn", "dense_efficient", "mita_triton"}
    assert got == {(p, t, m) for p in ("deit_s", "B8_N4096") for t in fast for m in methods}
    for r in rows:
        if r["method"] == "mita_triton":
            assert float(r["speedup_fwd"]) == 0.5 and r["correctness"] == "PASS"


def test_unknown_point_names_fail_before_any_timing(bench, tmp_path, monkeypatch):
    """A --points name outside the chosen point set (here a training point with the default long set) stops the run
    with the set's names, before the correctness gate or any timing (it used to be skipped silently)."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "mita_correct", lambda backend: pytest.fail("the gate ran"))
    with pytest.raises(SystemExit, match=r"\['seg_1025'\] not in point set 'long'.*N1048576"):
        bench.main(["--out", str(tmp_path), "--points", "deit_s,seg_1025", "--backends", "triton"])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "parts,steps",
    [
        ("short", {"short_tests", "short_tail", "ab_before_1", "ab_after_1", "ab_before_2", "ab_after_2"}),
        ("tiles", {"tiles_tests", "short_attn", "short_route", "short_bwd"}),
        ("op,lra", {"op_bench", "kernels", "layers", "lra_time", "lra_time_pathfinder", "lra_time_graph",
                    "lra_time_graph_pathfinder", "lra_time_sdpa_efficient", "lra_time_sdpa_cudnn"}),
        ("host", {"host", "route_stream", "host_before_1", "host_after_1", "host_before_2", "host_after_2"}),
        ("long", {"long_before_1", "long_after_1", "long_before_2", "long_after_2"}),
    ],
)  # fmt: skip
def test_speed_survey_parts(tmp_path, parts, steps):
    """scripts/gpu/speed_survey.sh runs the steps of the PARTS it is given and no others (python3 and nvidia-smi
    replaced by stubs that record their arguments); the before / after steps run in the BEFORE tree and here."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("python3", "nvidia-smi"):
        (stubs / name).write_text('#!/bin/sh\necho "$(pwd) $*"\n')
        (stubs / name).chmod(0o755)
    before = tmp_path / "before"
    before.mkdir()
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", PARTS=parts, BEFORE=str(before), MITA_COMMIT="abc",
               BEFORE_LONG=str(before), BEFORE_HOST=str(before))  # fmt: skip
    subprocess.run(["bash", str(root / "scripts" / "gpu" / "speed_survey.sh"), str(out)], cwd=root, env=env,
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    logs = {p.stem for p in out.glob("*.log")}
    assert logs == steps
    if "short" in parts:
        assert (out / "ab_before_1.log").read_text().startswith(f"{before} scripts/bench/bench_op.py")
        assert (out / "ab_after_2.log").read_text().startswith(f"{root} scripts/bench/bench_op.py")
    if "host" in parts:
        before_log = (out / "host_before_1.log").read_text().splitlines()
        assert before_log[0].startswith(f"{before} scripts/bench/bench_op.py")
        assert before_log[1].startswith(f"{before} scripts/lra_time.py")
        assert (out / "host_after_2.log").read_text().startswith(f"{root} scripts/bench/bench_op.py")
    if "long" in parts:
        assert "--graph --queued" in (out / "long_before_2.log").read_text()
        assert (out / "long_after_1.log").read_text().startswith(f"{root} scripts/bench/bench_op.py")
        assert "--timing cuda_graph_queued" in (out / "long_after_1.log").read_text()
