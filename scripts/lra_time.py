"""Estimate the full training time of LRA / arXiv experiments from measured step time x steps (Table D time column).

For each experiment file the script composes its config, builds the network, and times ``--steps`` optimiser
steps (forward, backward, AdamW) on random full-length batches of the task's shape (batch size, length, dual
inputs), after ``--warmup`` untimed steps, at the recipe's precision. ``--valid-fraction F`` pads each sequence at
random positions, leaving about F of its tokens valid, as Pathfinder images are (about 0.34 of the pixels inked):
the encoder then compacts each batch to its longest row, as in training. The estimate is
``median step time x trainer.max_steps``; data loading and periodic evaluation are not included. The output
says so, and the CSV it writes (``--out``) carries the hardware and versions.

Usage::

    python scripts/lra_time.py --experiments lra/listops-full lra/listops-mita --out results/lra/time_estimate.csv
    python scripts/lra_time.py --table D          # every Table D row
    python scripts/lra_time.py --table E          # every Table E row (arXiv, 16K-64K)
    python scripts/lra_time.py --experiments lra/pathfinder-full lra/pathfinder-mita --valid-fraction 0.34
    python scripts/lra_time.py --mode cuda_graph --experiments lra/listops-full lra/listops-mita   # GPU time alone

``--mode cuda_graph`` replays a captured step instead (the GPU's time without the host's launches; not what training
runs, and only for the CSV's ``mode`` column, never for the tables' time column).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from common import write_csv  # noqa: E402


def compose(experiment: str, overrides: list[str]):
    """The resolved config of ``experiment`` (path under configs/experiment) with extra overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import tasks.run  # noqa: F401  (registers the resolvers the configs use)

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return hydra_compose("train", overrides=[f"experiment={experiment}", *overrides])


# How a step is run: ``eager`` (each op launched from Python, what training does) or ``cuda_graph`` (the whole step,
# forward, backward and the optimiser, captured once and replayed: the GPU's time for it, without the host's).
MODES = ("eager", "cuda_graph")


def build_step(experiment: str, device: str, overrides: list[str], valid_fraction: float = 1.0, mode: str = "eager"):
    """One training step of ``experiment`` on a synthetic full-length batch: ``(step, cfg, B, N)``, where ``step()``
    runs forward, backward and the optimiser (bf16 autocast on CUDA when the recipe trains in bf16); ``step.net`` is
    the network.

    Args:
        experiment: e.g. ``lra/listops-mita``.
        device: ``cuda`` or ``cpu``.
        overrides: extra Hydra overrides (e.g. ``data.batch_size=8``).
        valid_fraction: share of each sequence's tokens that are valid (the rest padding at random positions):
            the encoder compacts valid tokens and cuts the batch to its longest row, as on Pathfinder images,
            where about 0.34 of the pixels are inked (zero pixels are padding).
        mode: one of MODES. ``cuda_graph`` (CUDA only) warms the step up on a side stream, captures one step (AdamW
            with ``capturable=True``, autocast without its cast cache) and returns the graph's replay; the batch is
            the same every step, as in eager mode.
    """
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from tasks.lra.data import add_valid_lengths

    if not 0.0 < valid_fraction <= 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1], got {valid_fraction}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "cuda_graph" and device != "cuda":
        raise ValueError("mode cuda_graph needs device cuda")
    graph = mode == "cuda_graph"
    cfg = compose(experiment, overrides)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=False)
    # The data module is not built (no data needed): the model reads vocab/length/classes from cfg.data.
    data = cfg.data
    net = instantiate(
        OmegaConf.create(
            {**model_cfg, "vocab_size": data.vocab_size, "max_length": data.max_length, "num_classes": data.num_classes}
        )
    )
    net = net.to(device).train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, eps=1e-6, capturable=graph)
    B, N = int(data.batch_size), int(data.max_length)
    g = torch.Generator().manual_seed(0)

    def padding() -> torch.Tensor:
        return torch.rand(B, N, generator=g) >= valid_fraction if valid_fraction < 1 else torch.zeros(B, N, dtype=bool)

    batch = {"x": torch.randint(1, int(data.vocab_size), (B, N), generator=g), "key_padding_mask": padding()}
    if net.dual:
        batch["x2"] = torch.randint(1, int(data.vocab_size), (B, N), generator=g)
        batch["key_padding_mask2"] = padding()
    # As the LRA collate does: each document's (shortest, longest) valid count, counted on the CPU.
    add_valid_lengths(batch)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    labels = torch.randint(0, int(data.num_classes), (B,), generator=g).to(device)
    bf16 = "bf16" in str(cfg.trainer.precision) and device == "cuda"

    def body() -> None:
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16, cache_enabled=not graph):
            loss = torch.nn.functional.cross_entropy(net(**batch).float(), labels)
        loss.backward()
        opt.step()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        body()

    step.net, step.batch = net, batch  # (for tests and tools)
    if not graph:
        return step, cfg, B, N
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    # Gradients start as None: the captured backward writes them into the graph's memory on every replay.
    opt.zero_grad(set_to_none=True)
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        body()

    def replay() -> None:
        captured.replay()

    # The graph reads and writes its tensors by address: the labels, the batch, the parameters and the optimiser's
    # state must live as long as the replay (freed, their memory would go to the next allocation; garbage labels
    # then failed the loss's class-range check at the first replay).
    replay.net, replay.batch, replay.captured_step = net, batch, (body, opt, labels)
    return replay, cfg, B, N


def step_times(step, device: str, warmup: int, steps: int) -> list[float]:
    """Wall seconds of ``steps`` calls of ``step`` after ``warmup`` untimed ones, each synchronised on CUDA."""
    times = []
    for i in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def time_experiment(
    experiment: str,
    steps: int,
    warmup: int,
    device: str,
    overrides: list[str],
    valid_fraction: float = 1.0,
    mode: str = "eager",
) -> dict:
    """Median seconds per optimiser step (:func:`build_step`'s step, synchronised) and the estimated total for one
    experiment file: dict with experiment, batch, length, valid_fraction, mode, max_steps, step_s, estimate_h.
    ``warmup``: untimed steps first (compilation, autotuning, allocator)."""
    step, cfg, B, N = build_step(experiment, device, overrides, valid_fraction, mode)
    step_s = statistics.median(step_times(step, device, warmup, steps))
    max_steps = int(cfg.trainer.max_steps)
    return {
        "experiment": experiment,
        "batch": B,
        "length": N,
        "valid_fraction": valid_fraction,
        "mode": mode,
        "overrides": " ".join(overrides),
        "max_steps": max_steps,
        "step_s": round(step_s, 6),
        "estimate_h": round(step_s * max_steps / 3600, 4),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", nargs="*", default=[], help="experiment paths, e.g. lra/listops-mita")
    parser.add_argument(
        "--table",
        choices=["D", "E"],
        action="append",
        help="every row of Table D (5 tasks x 6 attentions) or E (3 lengths x full / MiTA); may be repeated",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--out", type=Path, help="CSV to write (rewritten after each experiment: a run cut short keeps its rows)"
    )
    parser.add_argument(
        "--valid-fraction",
        type=float,
        default=1.0,
        help="share of valid tokens per sequence, padding at random positions (Pathfinder images: about 0.34)",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="eager",
        help="eager (what training runs) or cuda_graph (whole steps captured and replayed: the GPU's time alone)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every experiment")
    args = parser.parse_args(argv)
    from tasks.common.experiments import list_experiments
    from tasks.common.records import git_state, machine_load

    experiments = list(args.experiments)
    for table in args.table or []:
        experiments += list_experiments(table)  # the table's row files, by their paper: blocks
    if not experiments:
        parser.error("give --experiments or --table")
    hw = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    git = git_state()
    commit = (git["commit"] or "unknown")[:7] + ("+dirty" if git["dirty"] else "")
    print(
        f"ESTIMATE, not a measured training time: median step time over {args.steps} synthetic steps ({args.mode}, "
        f"valid fraction {args.valid_fraction:g}) x "
        f"trainer.max_steps; excludes data loading and evaluation. {hw}, torch {torch.__version__}, {stamp}"
    )
    rows = []
    for exp in experiments:
        row = time_experiment(
            exp, args.steps, args.warmup, args.device, args.overrides, args.valid_fraction, mode=args.mode
        )
        row.update(
            {
                "hardware": hw,
                "torch": torch.__version__,
                "date": stamp,
                "kind": "estimate",
                "commit": commit,
                "timed_steps": args.steps,
                **machine_load(),
            }
        )
        rows.append(row)
        if args.out:
            write_csv(args.out, rows)
        print(
            f"{exp:32s} batch {row['batch']:4d} N {row['length']:6d}  {row['step_s'] * 1000:9.2f} ms/step x "
            f"{row['max_steps']} steps = {row['estimate_h']:.3f} h (estimate)"
        )
    totals: dict[str, float] = {}
    for row in rows:
        attention = row["experiment"].split("-", 1)[-1]
        if row["experiment"].startswith("lra/"):
            totals[attention] = totals.get(attention, 0.0) + row["estimate_h"]
    for attention, hours in totals.items():
        print(f"total over the LRA tasks timed, {attention}: {hours:.2f} h (estimate)")
    return rows


if __name__ == "__main__":
    main()
