"""The CPU model of the long-row top-k's start threshold (scripts/bench/sweep.py --model) against the Triton
kernel's own per-row counts (exact_topk(stats=...), interpreter on the CPU): same count of keys at or above the
start threshold in every row, for independent and for correlated tokens (where rows overflow the list). Also
sweep.py's GPU sweeps end to end on the CPU, and the 1D pooling kernel's settings."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from script_loader import fresh_bench_script  # noqa: E402

from mita.ops.mita.triton import topk as ttk  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


@pytest.fixture
def ovf(monkeypatch):
    return fresh_bench_script(monkeypatch, "sweep")


@pytest.mark.parametrize(
    "rho,block_top,start",
    [(0.0, 1, None), (0.95, 1, None), (0.0, 2, None), (0.95, 3, None), (0.95, 1, (32, 0)), (0.0, 2, (20, 0))],
)
def test_model_matches_kernel_counts(ovf, monkeypatch, rho, block_top, start):
    # The long-row path's start (rows of 2048 keys would otherwise take the medium-row path, which has none).
    monkeypatch.setattr(ttk, "MEDIUM_N", 0)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "block_top", block_top)
    if start is not None:
        monkeypatch.setitem(ttk.SCAN_CONFIG, "start_steps", start[0])
        monkeypatch.setitem(ttk.SCAN_CONFIG, "start_narrow", start[1])
    n, d, mk = 2048, 32, 16
    gen = torch.Generator().manual_seed(1)
    x = ovf.ar1_tokens(n, d, rho, gen)
    w_q, w_k = (torch.randn(d, d, generator=gen) / math.sqrt(d) for _ in range(2))
    q, k = x @ w_q, x @ w_k
    r = q.view(mk, n // mk, d).mean(1)
    model = ovf.start_overflow(
        r,
        k,
        mk,
        block_top=block_top,
        steps=ttk.SCAN_CONFIG["start_steps"],
        narrow=bool(ttk.SCAN_CONFIG["start_narrow"]),
    )
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    stats = {}
    idx = ttk.exact_topk(r[None].to(dev), k[None].to(dev), None, mk, stats=stats)
    assert stats["cap"] == model["cap"]
    assert torch.equal(stats["counts"].cpu().long(), model["counts"].long())
    assert int(stats["overflow_rows"]) == round(model["overflow"] * mk)
    if rho > 0 and block_top == 1:
        assert model["overflow"] > 0.5  # correlated tokens: most rows take the refinement passes
    elif rho > 0:
        # Several scores per block: a tighter start, far fewer rows left for the refinement passes.
        base = ovf.start_overflow(r, k, mk)
        assert model["overflow"] < base["overflow"] / 2
        assert model["median_count"] < base["median_count"]
    else:
        assert model["overflow"] == 0.0
    # The result is exact either way.
    ref = torch.topk(r.float() @ k.float().T, mk, dim=-1).indices.sort(-1).values
    assert torch.equal(idx[0].cpu().long(), ref)


@pytest.mark.parametrize(
    "sweep,vals,extra",
    [
        ("fwd.bm_max=16,32", ["16", "32"], ["--backward"]),
        # The same script path without --backward: in the slow selection (the case above covers it).
        pytest.param("block_top=1,2", ["1", "2"], [], marks=pytest.mark.slow),
        # Launch options and non-default switches (the interpreter ignores warps): in the slow selection.
        pytest.param("num_warps=4,8", ["4", "8"], [], marks=pytest.mark.slow),
        pytest.param("fwd.route_stream=0,3", ["0", "3"], [], marks=pytest.mark.slow),
        pytest.param("route.bm=32,64", ["32", "64"], ["--set", "fwd.bm_max=32;route.bs=16"], marks=pytest.mark.slow),
    ],
)
def test_ab_script_runs_on_cpu(sweep, vals, extra):
    """scripts/bench/sweep.py (the GPU A/B of one SCAN_CONFIG or FWD_CONFIG key) end to end on the CPU at one tiny
    long-row point: one line per value, the same selection at every value (and a forward + backward time with
    --backward)."""
    import os
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, str(BENCH / "sweep.py"), "--device", "cpu", "--points", "640:4", "--rho", "0.9",
         "--sweep", sweep, "--reps", "1", *extra],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    ).stdout  # fmt: skip
    lines = [ln for ln in out.splitlines() if ln.startswith("N 640")]
    key = sweep.split("=")[0]
    assert [ln.split(f"{key}=")[1].split(":")[0] for ln in lines] == vals
    assert all(ln.endswith("same selection as the first value: True") for ln in lines)
    assert all(("fwd+bwd" in ln) == ("--backward" in extra) for ln in lines)
    if "--set" in extra:
        assert "fixed settings: bm_max=32, bs=16" in out
    diffs = [float(ln.split("rel. diff ")[1].split(";")[0]) for ln in lines]
    assert diffs[0] == 0.0 and all(0.0 <= x < 0.05 for x in diffs)


@pytest.mark.slow  # register caps and warps only, which the interpreter ignores: 2 min on 2 cores
def test_ab_script_several_sweeps_on_cpu():
    """Several --sweep options in one sweep.py run: each setting's values in turn on the same point, register caps,
    warps and the emission's block step included (launch options only: the same selection and output)."""
    import os
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    sweeps = ["lv.num_warps=None,8", "select_eb=None,16", "fwd.maxnreg=None,96", "route.maxnreg=None,96"]
    args = [a for sw in sweeps for a in ("--sweep", sw)]
    out = subprocess.run(
        [sys.executable, str(BENCH / "sweep.py"), "--device", "cpu", "--points", "640:4", "--rho", "0",
         "--reps", "1", *args],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    ).stdout  # fmt: skip
    lines = [ln for ln in out.splitlines() if ln.startswith("N 640")]
    labels = [ln.split(" rho 0.0 ")[1].split(":")[0] for ln in lines]
    assert labels == [f"{sw.split('=')[0]}={v}" for sw in sweeps for v in sw.split("=")[1].split(",")]
    assert all(ln.endswith("same selection as the first value: True") for ln in lines)
    assert all(float(ln.split("rel. diff ")[1].split(";")[0]) == 0.0 for ln in lines)


def test_ab_sweep_keys_parse():
    """sweep.py's setting names: SCAN_CONFIG keys, fwd. / route. / lv. / pool. / small. prefixes; an unknown
    key stops the run with the list of known ones."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sweep_script", BENCH / "sweep.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    from mita.ops.mita.triton import landmark_values, pool, topk

    assert ab.parse_sweep("lv.num_warps=8")[:2] == (landmark_values.LV_CONFIG, "num_warps")
    assert ab.parse_sweep("fwd.maxnreg=0,96")[1:] == ("maxnreg", [0, 96])
    assert ab.parse_sweep("select_eb=64")[0] is topk.SCAN_CONFIG
    assert ab.parse_sweep("pool.BL=128") == (pool.CONFIG["fwd1d"], "BL", [128])
    from mita.ops.mita.triton import short

    assert ab.parse_sweep("small.attn.BM=32,64") == (short.CONFIG["attn"], "BM", [32, 64])
    with pytest.raises(SystemExit, match="small.<kernel>.<key>"):
        ab.parse_sweep("small.nope.BM=1")
    with pytest.raises(SystemExit, match="lv.<key>"):
        ab.parse_sweep("bwd.maxnreg=1")


def test_ab_variants_apply_and_restore():
    """sweep.py --variants: each value sets its keys (undoing the previous value's first); the sweep's end puts
    every key back; a bad key stops the run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sweep_script", BENCH / "sweep.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    from mita.ops.mita.triton import attention_fwd, topk

    scan, fwd = topk.SCAN_CONFIG, attention_fwd.FWD_CONFIG
    before = (scan["bs"], scan["num_warps"], fwd["bm_infer"])
    v = ab.Variants()
    v["variant"] = "bs=128;num_warps=8"
    assert (scan["bs"], scan["num_warps"], fwd["bm_infer"]) == (128, 8, before[2])
    assert v["variant"] == "bs=128;num_warps=8"
    v["variant"] = "fwd.bm_infer=7"
    assert (scan["bs"], scan["num_warps"], fwd["bm_infer"]) == (before[0], before[1], 7)
    v["variant"] = ""
    assert (scan["bs"], scan["num_warps"], fwd["bm_infer"]) == before
    with pytest.raises(SystemExit, match="--sweep needs"):
        v["variant"] = "nope=1"


@pytest.mark.parametrize("n,m", [(1024, 8), (600, 3)])
def test_pool1d_settings_give_the_same_output(monkeypatch, n, m):
    """The 1D landmark pooling kernel at several of its settings (pool.CONFIG["fwd1d"], which sweep.py's
    pool.<key> sets): every setting's output bitwise the defaults' and within bf16 rounding of the float32 means."""
    from mita.ops.mita.triton import pool as tp

    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, 2, n, 64, generator=g).to(torch.bfloat16)
    ref = x.reshape(1, 2, m, n // m, 64).sum(3, dtype=torch.float32) / (n // m)
    base = dict(tp.CONFIG["fwd1d"])
    first = None
    for cfg in ({}, {"unmasked": 0}, {"BL": 128, "num_warps": 8}):
        monkeypatch.setitem(tp.CONFIG, "fwd1d", {**base, **cfg})
        out = tp.pool1d_fwd(x, m)
        first = out if first is None else first
        assert torch.equal(out, first), cfg
        assert (out.float() - ref).abs().max().item() < 1e-2, cfg


def test_model_mode_prints_the_overflow_share_per_value():
    """sweep.py --model: one line per (point, rho, value) of a start setting; correlated tokens overflow at
    block_top 1; a setting the model does not follow stops the run."""
    import subprocess

    run = [sys.executable, str(BENCH / "sweep.py"), "--model", "--points", "2048:16", "--rho", "0,0.95"]
    out = subprocess.run(
        [*run, "--sweep", "block_top=1,2"], capture_output=True, text=True, timeout=600, check=True
    ).stdout  # fmt: skip
    lines = [ln for ln in out.splitlines() if ln.startswith("N 2048")]
    assert [ln.split("block_top=")[1].split(":")[0] for ln in lines] == ["1", "2", "1", "2"]
    assert "'overflow': 0.0" in lines[0] and "'overflow': 0.0" not in lines[2]
    bad = subprocess.run([*run, "--sweep", "fwd.bm_max=16"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--model sweeps only" in bad.stderr
