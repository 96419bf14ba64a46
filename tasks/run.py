"""Train and evaluate one configuration: ``python -m tasks.run experiment=<task>/<row> [key=value ...]``.

Any config key can be overridden on the command line; ``-m`` sweeps (``-m model.attention.m=16,25,36``).
A configuration error (unknown attention, a landmark count that does not fit the patch grid, a missing data
folder) ends the run with one line on stderr and exit code 2; set ``MITA_FULL_ERROR=1`` for the traceback.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from tasks.common.callbacks import BestTracker, RunClock
from tasks.common.config import CONFIG_DIR as CONFIG_PATH
from tasks.common.config import register_resolvers
from tasks.common.quiet import silence_known_noise

register_resolvers()
silence_known_noise()

CONFIG_DIR = str(CONFIG_PATH)


class ConfigError(Exception):
    """A configuration that cannot run; reported as one line."""


def describe(exc: BaseException) -> str:
    """One line naming the root cause of ``exc`` (Hydra wraps errors raised while instantiating)."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    message = " ".join(str(root).split())
    where = ""
    full_key = getattr(exc, "full_key", None)
    if full_key:
        where = f" (config key: {full_key})"
    if type(root).__name__ in ("ValueError", "ConfigError", "KeyError"):
        return f"{message}{where}"
    return f"{type(root).__name__}: {message}{where}"


def _instantiate_dict(node: Any) -> list[Any]:
    from hydra.utils import instantiate

    if not node:
        return []
    return [instantiate(v) for v in node.values() if isinstance(v, DictConfig) and "_target_" in v]


def build(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate the data module, network, LightningModule, callbacks, loggers and trainer from ``cfg``."""
    import lightning as L
    import torch
    from hydra.utils import instantiate

    import mita.models  # noqa: F401  (registers the timm entrypoints)

    if cfg.get("requires_init_weights") and not cfg.get("init_weights"):
        raise ConfigError(
            f"init_weights: {cfg.name} starts from pretrained full-attention weights; pass "
            "init_weights=/path/to/weights (.pth, .safetensors or a .ckpt of this project)"
        )
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    datamodule = instantiate(cfg.data)
    root = getattr(datamodule, "root", None)
    uses_data = cfg.get("train", True) or cfg.get("validate", True) or cfg.get("test", False)
    if root is not None and uses_data and not Path(root).exists():
        raise ConfigError(f"data.root: {root} does not exist (pass data.root=/path/to/the/data set)")
    net = instantiate(cfg.model)
    if cfg.get("init_weights"):
        from tasks.common.weights import WeightsError, load_init_weights

        try:
            loaded = load_init_weights(
                net,
                cfg.init_weights,
                skip=list(cfg.get("init_weights_skip") or []),
                prefix=cfg.get("init_weights_prefix") or "",
            )
        except WeightsError as exc:
            raise ConfigError(str(exc)) from exc
        print(
            f"init_weights: {cfg.init_weights}: {len(loaded['missing'])} parameters kept their initial values "
            f"{loaded['missing'][:6]}, {len(loaded['unexpected'])} checkpoint tensors unused, "
            f"{len(loaded['skipped'])} skipped",
            file=sys.stderr,
        )
    if cfg.get("preflight", True) and hasattr(datamodule, "example_input"):
        # One eval forward on a single example: shape/grid errors surface now, as configuration errors.
        was_training = net.training
        net.eval()
        with torch.no_grad():
            net(**datamodule.example_input())
        net.train(was_training)
    optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True)
    scheduler = OmegaConf.to_container(cfg.scheduler, resolve=True) if cfg.get("scheduler") else None
    module = instantiate(cfg.task, net=net, optimizer=optimizer, scheduler=scheduler, _convert_="all")
    loggers = _instantiate_dict(cfg.get("logger"))
    callbacks = _instantiate_dict(cfg.get("callbacks"))
    if not loggers:
        callbacks = [c for c in callbacks if type(c).__name__ != "LearningRateMonitor"]
    if not cfg.trainer.get("enable_progress_bar", True):
        callbacks = [c for c in callbacks if "ProgressBar" not in type(c).__name__]
    deterministic = cfg.get("deterministic", False)
    trainer = instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=loggers if loggers else False,
        deterministic=deterministic,
        use_distributed_sampler=not getattr(datamodule, "handles_distributed_sampling", False),
        _convert_="all",
    )
    if "FSDP" in type(trainer.strategy).__name__ and module.ema is not None:
        raise ValueError("task.ema: the EMA copy cannot be sharded with trainer=fsdp; set task.ema=null")
    return {"datamodule": datamodule, "net": net, "module": module, "trainer": trainer, "callbacks": callbacks}


def resolve_checkpoint(cfg: DictConfig, output_dir: Path) -> str | None:
    """The checkpoint to continue from: None, ``<output_dir>/checkpoints/last.ckpt`` (resume=auto), or a path."""
    resume = cfg.get("resume")
    if not resume:
        return None
    if resume == "auto":
        last = output_dir / "checkpoints" / "last.ckpt"
        return str(last) if last.exists() else None
    if not Path(resume).exists():
        raise ConfigError(f"resume: checkpoint {resume} does not exist")
    return str(resume)


# Exit status of a run stopped at its deadline (``deadline=<unix time>``) before its last step; resume=auto continues.
PAUSED_EXIT_CODE = 3

# File name of the eval_weights=best checkpoint; the step it was saved at is read back from it.
BEST_CHECKPOINT_NAME = "best-step{step}"


def checkpoint_step(path: str) -> int:
    """The optimiser step in a BEST_CHECKPOINT_NAME file name (``.../best-step1200.ckpt`` -> 1200)."""
    return int(re.search(r"best-step(\d+)", Path(path).name).group(1))


def best_checkpoint_callback(cfg: DictConfig, output_dir: Path):
    """With ``eval_weights=best``: a checkpoint callback keeping the weights with the best ``eval_monitor``
    (maximised) among the validation runs during training; None with ``eval_weights=last``."""
    which = cfg.get("eval_weights", "last")
    if which not in ("last", "best"):
        raise ConfigError(f"eval_weights must be 'last' or 'best', got {which!r}")
    if which == "last" or not cfg.get("train", True):
        return None
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint(
        dirpath=str(output_dir / "checkpoints" / "best"),
        filename=BEST_CHECKPOINT_NAME,
        auto_insert_metric_name=False,
        monitor=cfg.get("eval_monitor", "val/acc1"),
        mode="max",
        save_top_k=1,
    )


def keep_previous_logs(output_dir: Path) -> None:
    """Move CSV metrics of the interrupted run aside (Lightning's CSV logger would delete them on resume)."""
    if os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get("NODE_RANK", "0") != "0":
        return
    for metrics in output_dir.glob("*/metrics.csv"):
        index = len(list(metrics.parent.glob("metrics-before-resume-*.csv")))
        metrics.rename(metrics.with_name(f"metrics-before-resume-{index}.csv"))


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train / evaluate as ``cfg`` says and write the run record. Returns the final metrics and the record path."""
    start = time.time()
    output_dir = Path(cfg.paths.output_dir)
    try:
        ckpt_path = resolve_checkpoint(cfg, output_dir)
        if ckpt_path:
            keep_previous_logs(output_dir)
        objects = build(cfg)
        best_checkpoint = best_checkpoint_callback(cfg, output_dir)
    except Exception as exc:  # noqa: BLE001 - every failure while building is a configuration problem
        if os.environ.get("MITA_FULL_ERROR"):
            raise
        print(f"config error: {describe(exc)}  [MITA_FULL_ERROR=1 for the traceback]", file=sys.stderr)
        sys.exit(2)
    trainer, module, datamodule = objects["trainer"], objects["module"], objects["datamodule"]
    best = BestTracker(cfg.report.key if cfg.get("report") else None, cfg.report.scale if cfg.get("report") else 1)
    trainer.callbacks.append(best)
    from tasks.common.records import concurrency, git_state

    sharing = concurrency()
    clock = RunClock(
        start, cfg.get("deadline"), commit=git_state()["commit"], processes=sharing["processes"] if sharing else 1
    )
    trainer.callbacks.append(clock)
    if best_checkpoint is not None:
        trainer.callbacks.append(best_checkpoint)
    if ckpt_path and trainer.is_global_zero:
        print(f"resuming from {ckpt_path}", file=sys.stderr)
    if cfg.get("train", True):
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        max_steps = int(cfg.trainer.get("max_steps") or -1)
        if clock.stopped and (max_steps < 0 or trainer.global_step < max_steps):
            # Stopped at the deadline: keep the state to continue from and leave evaluation to the finished run.
            trainer.save_checkpoint(str(output_dir / "checkpoints" / "last.ckpt"))
            if trainer.is_global_zero:
                print(
                    f"paused at step {trainer.global_step} (deadline reached); resume=auto continues from "
                    f"{output_dir / 'checkpoints' / 'last.ckpt'}",
                    file=sys.stderr,
                )
            sys.exit(PAUSED_EXIT_CODE)
        if cfg.get("save_final_checkpoint", True):
            trainer.save_checkpoint(str(output_dir / "checkpoints" / "last.ckpt"))
    # Evaluating from a checkpoint restores the callbacks' state too: keep the training's own values.
    fit_elapsed, fit_end, segments, best_value = clock.elapsed(), time.time(), clock.segments, best.best
    segment_commits, segment_processes = list(clock.commits), list(clock.processes)
    # Final evaluation on the weights at the end, or on the best validation checkpoint (eval_weights=best).
    eval_ckpt = (best_checkpoint.best_model_path or None) if best_checkpoint is not None else None
    metrics: dict[str, Any] = {}
    if cfg.get("validate", True):
        for result in trainer.validate(module, datamodule=datamodule, verbose=False, ckpt_path=eval_ckpt):
            metrics.update(result)
    if cfg.get("test", False):
        for result in trainer.test(module, datamodule=datamodule, verbose=False, ckpt_path=eval_ckpt):
            metrics.update(result)
    if eval_ckpt:
        metrics["eval_checkpoint_step"] = checkpoint_step(eval_ckpt)
    for callback in trainer.callbacks:
        metrics.update(getattr(callback, "last", {}) or {})
    record_path = None
    if cfg.get("record", True) and trainer.is_global_zero:
        from hydra.core.hydra_config import HydraConfig

        from tasks.common.records import write_record

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        record_path = write_record(
            cfg.paths.results_dir,
            cfg.name,
            metrics,
            paper=OmegaConf.to_container(cfg.paper, resolve=True) if cfg.get("paper") else None,
            report=OmegaConf.to_container(cfg.report, resolve=True) if cfg.get("report") else None,
            overrides=overrides,
            steps=int(trainer.global_step),
            epochs=int(trainer.current_epoch),
            wall_time_s=fit_elapsed + time.time() - fit_end,
            world_size=int(trainer.world_size),
            config=OmegaConf.to_container(cfg, resolve=False),
            output_dir=str(output_dir),
            best=best_value,
            smoke=bool(cfg.get("smoke", False)),
            segments=segments,
            segment_commits=segment_commits,
            segment_processes=segment_processes,
        )
    if trainer.is_global_zero:
        print(
            summary_line(cfg, metrics, int(trainer.global_step), fit_elapsed + time.time() - fit_end, record_path),
            file=sys.stderr,
        )
    return {
        "metrics": metrics,
        "record": record_path,
        "global_step": int(trainer.global_step),
        "resumed_from": ckpt_path,
        "trainer": trainer,
    }


def summary_line(cfg: DictConfig, metrics: dict[str, Any], steps: int, wall_s: float, record: Any) -> str:
    """``done: <experiment>: <reported metric> ..., <steps> steps in <time>; record <path>`` (one line)."""
    shown = []
    report = cfg.get("report")
    keys = [str(report.key)] if report else []
    keys += [k for k in ("val/acc1", "test/acc1", "val/loss", "test/loss") if k not in keys]
    for key in keys:
        value = metrics.get(key)
        if value is None:
            continue
        scale = float(report.get("scale", 1.0)) if report and key.endswith("acc1") else 1.0
        shown.append(f"{key} {float(value) * scale:.{1 if scale != 1.0 else 4}f}")
    where = f"; record {record}" if record else ""
    minutes, seconds = divmod(int(round(wall_s)), 60)
    took = f"{minutes} min {seconds} s" if minutes else f"{seconds} s"
    return f"done: {cfg.name}: {', '.join(shown) or 'no metrics'}; {steps} steps in {took}{where}"


def group_choices(group: str) -> list[str]:
    """The options of a config group (``experiment`` -> ``lra/listops-full``, ...), sorted; [] if no such group."""
    root = CONFIG_PATH / group
    if not root.is_dir():
        return []
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def check_group_overrides(argv: list[str]) -> str | None:
    """One line naming the first ``group=option`` argument whose option does not exist, else None.

    Checked before Hydra composes (whose own message takes 8-17 lines); ``+group=...``, dotted keys, sweeps
    (``a,b``) and interpolations are left to Hydra.
    """
    import difflib

    for arg in argv:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        if "." in key or "/" in key or not value or any(c in value for c in ",${}()[]*"):
            continue
        choices = group_choices(key)
        if not choices or value in choices or value == "null":
            continue
        if key == "experiment":
            near = difflib.get_close_matches(value, choices, n=4, cutoff=0.0)
            return f"no experiment '{value}' under configs/experiment; nearest: {', '.join(near)}"
        known = "attentions" if key == "attention" else f"{key} configs"
        return f"unknown {key} '{value}'; known {known}: {', '.join(choices)}"
    return None


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    run(cfg)


def main() -> None:
    """Command-line entry point: check the config-group choices, then hand over to Hydra."""
    problem = check_group_overrides(sys.argv[1:])
    if problem:
        print(f"config error: {problem}", file=sys.stderr)
        sys.exit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
