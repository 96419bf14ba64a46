"""The experiment framework: configs compose, runs write records, resume continues, errors are one line, DDP."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasks.common.config import compose
from tasks.common.experiments import EXPERIMENT_DIR, list_experiments, paper_blocks
from tasks.common.testing import run_in_process

REPO = Path(__file__).resolve().parents[2]
SMOKE = ["experiment=synthetic/shapes-full", "debug=smoke", "data.num_train=16", "data.num_val=8", "data.num_test=8"]


def _cli(args: list[str], cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("MITA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "tasks.run", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_every_experiment_file_composes_and_names_itself():
    experiments = list_experiments()
    assert "imagenet/deit_s-mita" in experiments and "synthetic/shapes-mita" in experiments
    for name in experiments:
        cfg = compose([f"experiment={name}"])
        assert cfg.name == name, f"{name}: name: {cfg.name} does not match the file path"
        paper = cfg.paper
        for key in ("table", "row", "metric", "value"):
            assert key in paper, f"{name}: paper block lacks {key}"
        assert "name" in cfg.model.attention, f"{name}: no attention selected"


def test_experiment_files_have_a_header_comment():
    for name in paper_blocks():
        text = (EXPERIMENT_DIR / f"{name}.yaml").read_text()
        header = [line for line in text.splitlines()[:8] if line.startswith("#")]
        assert any("Command:" in line for line in header), f"{name}: header lacks the command"
        assert any("Hardware" in line for line in header), f"{name}: header lacks hardware/time"


def test_overrides_reach_the_attention_layer():
    cfg = compose(["experiment=imagenet/deit_s-mita", "model.attention.m=49", "model.attention.k=49"])
    assert (cfg.model.attention.m, cfg.model.attention.k) == (49, 49)
    cfg = compose(["experiment=imagenet/deit_s-mita", "attention=agent_minus"])
    assert cfg.model.attention.name == "agent_minus"
    # The DeiT recipe: lr 5e-4 x batch / 512 (global batch 1024 -> 1e-3), EMA, Mixup / CutMix, label smoothing.
    assert cfg.optimizer.lr == 5e-4 and cfg.optimizer.lr_batch_ref == 512
    assert cfg.task.ema.decay == 0.99996 and cfg.task.mixup.cutmix_alpha == 1.0 and cfg.task.label_smoothing == 0.1


def test_smoke_run_writes_a_record_with_provenance(tmp_path):
    # Also exercises bf16 autocast, gradient clipping, deterministic mode and a validated EMA.
    extra = [
        "trainer.precision=bf16-mixed",
        "trainer.gradient_clip_val=1.0",
        "deterministic=true",
        "task.ema={decay:0.9,validate:true}",
    ]
    result = run_in_process([*SMOKE, "trainer.max_steps=2", "test=true", *extra], tmp_path / "run")
    assert result["global_step"] == 2
    record = json.loads(Path(result["record"]).read_text())
    assert record["experiment"] == "synthetic/shapes-full" and record["smoke"] is True
    for key in ("command", "git", "hardware", "versions", "date", "metrics", "wall_time_s", "steps"):
        assert key in record
    assert 0.0 <= record["metrics"]["val/acc1"] <= 1.0 and "test/acc1" in record["metrics"]
    assert "val/acc1_ema" in record["metrics"] and record["metrics"]["perf/mean_samples_per_s"] > 0
    assert record["result"]["value"] == pytest.approx(100 * record["metrics"]["val/acc1"])
    assert (tmp_path / "run" / "csv" / "metrics.csv").exists()
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
    with (tmp_path / "run" / "csv" / "metrics.csv").open() as f:
        train_acc = [float(r["train/acc1"]) for r in csv.DictReader(f) if r.get("train/acc1")]
    assert train_acc and all(0.0 <= a <= 1.0 for a in train_acc)


def test_resume_auto_continues_the_step_count(tmp_path):
    out = tmp_path / "run"
    first = run_in_process([*SMOKE, "trainer.max_steps=2", "validate=false", "record=false"], out)
    assert first["global_step"] == 2
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2
    second = run_in_process([*SMOKE, "trainer.max_steps=3", "resume=auto", "validate=false", "record=false"], out)
    assert second["resumed_from"] == str(out / "checkpoints" / "last.ckpt")
    assert second["global_step"] == 3
    # The optimiser state came back too: the schedule continued from step 2, not from 0.
    assert second["trainer"].lr_scheduler_configs[0].scheduler.last_epoch == 3
    # The first run's metrics are kept beside the resumed run's.
    assert (out / "csv" / "metrics-before-resume-0.csv").exists() and (out / "csv" / "metrics.csv").exists()


def test_resumed_run_records_the_commit_and_sharing_of_every_segment(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("MITA_COMMIT", "a" * 40)
    monkeypatch.setenv("MITA_CONCURRENT_RUNS", "3")
    run_in_process([*SMOKE, "trainer.max_steps=1", "validate=false", "record=false"], out)
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    clock = next(v for k, v in ckpt["callbacks"].items() if "RunClock" in k)
    assert clock["segments"] == 1 and clock["commits"] == ["a" * 40] and clock["processes"] == [3]
    monkeypatch.setenv("MITA_COMMIT", "b" * 40)
    monkeypatch.delenv("MITA_CONCURRENT_RUNS")
    second = run_in_process([*SMOKE, "trainer.max_steps=2", "resume=auto", "validate=false"], out)
    record = json.loads(Path(second["record"]).read_text())
    assert record["segments"] == 2 and record["segment_commits"] == ["a" * 40, "b" * 40]
    # The first process shared its accelerator with two other runs, the second ran alone.
    assert record["segment_processes"] == [3, 1] and record["concurrency"] is None
    assert record["git"]["commit"] == "b" * 40


def test_run_clock_reads_checkpoints_without_commits():
    from tasks.common.callbacks import RunClock

    clock = RunClock(0.0, commit="c")
    clock.load_state_dict({"elapsed": 5.0, "segments": 2})
    assert clock.segments == 3 and clock.commits == [None, None, "c"] and clock.before == 5.0
    assert clock.processes == [None, None, None]
    clock.load_state_dict({"elapsed": 5.0, "segments": 2, "commits": ["a", "b"]})
    assert clock.commits == ["a", "b", "c"] and clock.processes == [None, None, None]
    shared = RunClock(0.0, commit="c", processes=2)
    shared.load_state_dict({"elapsed": 5.0, "segments": 2, "commits": ["a", "b"], "processes": [4, None]})
    assert shared.processes == [4, None, 2] and shared.state_dict()["processes"] == [4, None, 2]


def test_throughput_monitor_counts_tokens_without_a_readback_per_step(monkeypatch):
    """Valid tokens are summed on the batch's device and read once per logged window, not once per step (a read
    is a GPU synchronisation in a training step); the logged rate counts exactly the valid tokens."""
    from types import SimpleNamespace

    from tasks.common.callbacks import ThroughputMonitor

    reads = []
    real_int = torch.Tensor.__int__
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: reads.append(1) or real_int(t))
    logged = []
    module = SimpleNamespace(
        device=torch.device("cpu"),
        log_dict=lambda metrics, **kw: logged.append(dict(metrics)),
        log=lambda *a, **kw: None,
    )
    trainer = SimpleNamespace(world_size=1)
    monitor = ThroughputMonitor(log_every_n_steps=3)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 7:] = True  # 17 valid tokens per batch
    batch = {"x": torch.ones(2, 10, dtype=torch.long), "key_padding_mask": mask, "valid_lengths": (7, 10)}
    times = iter([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    monkeypatch.setattr("tasks.common.callbacks.time.perf_counter", lambda: next(times))
    for step in range(7):
        monitor.on_train_batch_end(trainer, module, None, batch, step)
    # Step 0 starts the window; steps 1-3 and 4-6 are two windows of 3 steps, 1 s each: one read per window.
    assert len(logged) == 2 and len(reads) == 2
    assert logged[0]["perf/tokens_per_s"] == 17.0 and logged[0]["perf/samples_per_s"] == 2.0


def test_config_error_in_process_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_in_process(["experiment=synthetic/shapes-mita", "debug=smoke", "model.attention.m=100"], tmp_path / "run")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "10x10 landmark grid does not fit the 8x8 patch grid" in err[0]


def test_config_error_from_the_command_line_is_one_line(tmp_path):
    proc = _cli(["debug=smoke", "model.attention.name=nope", f"paths.log_dir={tmp_path}"])
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert lines[-1].startswith("config error: unknown attention 'nope'; known attentions:")
    assert len([line for line in lines if "error" in line.lower()]) == 1


def _only_record(root: Path) -> dict:
    records = list(root.rglob("records/**/*.json"))
    assert len(records) == 1, records
    return json.loads(records[0].read_text())


def test_ddp_two_processes_match_one_process(tmp_path):
    """A 2-process gloo DDP run on CPU writes its metrics and one record where a 1-process run does."""
    common = [*SMOKE, "trainer.max_steps=2", f"paths.log_dir={tmp_path}"]
    one = _cli([*common, "run_name=one"])
    assert one.returncode == 0, one.stderr[-2000:]
    two = _cli([*common, "run_name=two", "trainer.strategy=ddp", "trainer.devices=2"])
    assert two.returncode == 0, two.stderr[-2000:]
    paths = {}
    for name in ("one", "two"):
        record = _only_record(tmp_path / name)
        out = Path(record["output_dir"])
        metrics = [p.relative_to(out).as_posix() for p in (tmp_path / name).rglob("metrics.csv")]
        paths[name] = metrics
        assert record["steps"] == 2
    assert paths["one"] == paths["two"] == ["csv/metrics.csv"]
    assert _only_record(tmp_path / "two")["hardware"]["world_size"] == 2


@pytest.mark.slow
def test_multirun_sweep_runs_every_combination(tmp_path):
    common = [*SMOKE, "trainer.max_steps=1", f"paths.log_dir={tmp_path}"]
    sweep = _cli(["-m", *common, "run_name=sweep", "attention=full,mita"])
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    jobs = sorted(p.parent.parent.name for p in (tmp_path / "multirun" / "sweep").rglob("metrics.csv"))
    assert len(jobs) == 2 and any("attention=mita" in j for j in jobs), jobs


def test_strategies_and_loggers_instantiate(monkeypatch, tmp_path):
    from hydra.utils import instantiate
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    cfg = compose(["experiment=imagenet/deit_s-mita", "trainer=fsdp"])
    assert isinstance(instantiate(cfg.trainer.strategy), FSDPStrategy)
    cfg = compose(["experiment=imagenet/deit_s-mita", "trainer=ddp"])
    assert isinstance(instantiate(cfg.trainer.strategy), DDPStrategy) and cfg.trainer.precision == "bf16-mixed"
    from tasks.common.callbacks import wandb_logger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = wandb_logger(project="mita", save_dir=str(tmp_path), offline=None, tags="imagenet/deit_s-mita")
    assert logger._offline is True


def test_deit_schedule_and_optimizer_groups():
    import timm

    from tasks.common.optim import build_optimizer, build_scheduler

    net = timm.create_model("mita_deit_tiny_patch16_224", attention="full", depth=1)
    cfg = {"name": "adamw", "lr": 5e-4, "lr_batch_ref": 512, "weight_decay": 0.05}
    opt = build_optimizer(net, cfg, global_batch=1024)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    # No weight decay on biases, norms, the cls token and the position embedding.
    no_decay = [g for g in opt.param_groups if g["weight_decay"] == 0.0]
    assert no_decay and sum(p.numel() for g in no_decay for p in g["params"]) > net.pos_embed.numel()
    sched = build_scheduler(opt, {"name": "cosine", "warmup_epochs": 5, "warmup_lr": 1e-6, "min_lr": 1e-5}, 3000, 100)
    lrs = []
    for _ in range(3000):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert (
        lrs[0] == pytest.approx(1e-6) and lrs[500] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-5, rel=1e-2)
    )
    assert max(lrs) == pytest.approx(1e-3)


def test_eval_weights_best_evaluates_the_best_validation_checkpoint(tmp_path):
    every_2 = ["trainer.max_steps=6", "trainer.val_check_interval=2", "trainer.check_val_every_n_epoch=null"]
    result = run_in_process([*SMOKE, *every_2, "eval_weights=best", "test=true"], tmp_path / "run")
    record = json.loads(Path(result["record"]).read_text())
    assert record["metrics"]["eval_checkpoint_step"] in (2, 4, 6)
    (best,) = (tmp_path / "run" / "checkpoints" / "best").glob("best-step*.ckpt")
    saved = torch.load(best, map_location="cpu", weights_only=False)
    assert saved["global_step"] == record["metrics"]["eval_checkpoint_step"]
    # The final validation ran on the weights that gave the best validation during training.
    assert record["result"]["best"] == pytest.approx(100 * record["metrics"]["val/acc1"])
    last = run_in_process([*SMOKE, "trainer.max_steps=1", "record=false"], tmp_path / "last")
    assert "eval_checkpoint_step" not in last["metrics"]


def test_eval_weights_rejects_unknown_values(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_in_process([*SMOKE, "eval_weights=median"], tmp_path / "run")
    assert "eval_weights must be 'last' or 'best'" in capsys.readouterr().err


def test_missing_data_root_is_a_one_line_config_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_in_process(["experiment=lra/listops-mita", "debug=smoke", f"data.root={tmp_path / 'nope'}"], tmp_path / "r")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.root" in err[0] and "does not exist" in err[0]


def test_machine_load_counts_other_gpu_processes(monkeypatch, tmp_path):
    from tasks.common.records import machine_load

    assert float(machine_load()["load_1m"]) >= 0
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert machine_load()["gpu_other_procs"] == "unknown"
    # A fake nvidia-smi listing this process and two others: two.
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\nprintf '{os.getpid()}\\n4242\\n4343\\n'\n")
    fake.chmod(0o755)
    assert machine_load()["gpu_other_procs"] == "2"
