"""``scripts/bench/profiler.py host --device cpu``: an eager call's host side on any machine, with the Triton launches
replaced by no-ops after the project's launch wrapper. Run in a subprocess (the stubs patch module globals). Checks
the launch and PyTorch-op counts of both paths, so a change that adds a launch or a PyTorch kernel to a call shows
up here."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path


def test_host_counts_on_cpu(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(root / "scripts" / "bench" / "profiler.py"), "host", "--device", "cpu", "--points",
         "N1024,deit_s", "--reps", "2", "--profile", "5", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cProfile of 2 forward + backward calls" in run.stdout
    with open(tmp_path / "host_cpu.csv") as f:
        rows = {(r["point"], r["pass_"]): r for r in csv.DictReader(f)}
    # General path at 1024 keys: the medium-row top-k (order keys with the landmark values' partials; search with their
    # merge), routing, plan, fused attention; backward: dq, routed dk / dv, shared expert and its merge, per-key
    # dk / dv, the landmark values' dR and the dR merge. Short path: 2 and 1.
    expect = {("N1024", "forward"): 5, ("N1024", "backward"): 7, ("deit_s", "forward"): 2, ("deit_s", "backward"): 1}
    for key, n in expect.items():
        r = rows[key]
        assert int(r["launches"]) == n, (key, r)
        assert int(r["torch_ops"]) == 0, (key, r["torch_op_names"])
        assert float(r["host_us"]) > 0 and r["call"] == "op" and r["device"] == "cpu"


def test_host_counts_of_an_lra_step_on_cpu(tmp_path):
    """``--lra``: a whole ListOps MiTA training step (2 layers) makes 15 Triton launches per layer (the backward's
    key lists three of them), plus the masked landmark pooling's two when rows are padded (picked as on CUDA), and no
    PyTorch prefix sums or searches."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(root / "scripts" / "bench" / "profiler.py"), "host", "--device", "cpu", "--points",
         "none", "--lra", "lra/listops-mita", "--reps", "8", "--valid-fraction", "0.6", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    with open(tmp_path / "host_cpu.csv") as f:
        rows = {r["call"]: r for r in csv.DictReader(f)}
    assert int(rows["step (valid 1)"]["launches"]) == 30
    padded = rows["step (valid 0.6)"]
    assert int(padded["launches"]) == 34
    assert "cumsum" not in padded["torch_op_names"] and "searchsorted" not in padded["torch_op_names"]
