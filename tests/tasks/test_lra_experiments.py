"""Every LRA (Table D) and arXiv (Table E) experiment file composes and trains one step on CPU on tiny files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tasks.lra.fake import smoke_overrides, write_all, write_listops

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(
    str(p.relative_to(ROOT / "configs" / "experiment").with_suffix(""))
    for folder in ("lra", "arxiv")
    for p in (ROOT / "configs" / "experiment" / folder).rglob("*.yaml")
)


def _task(experiment: str) -> str:
    if experiment.startswith("arxiv/"):
        return "arxiv"
    return Path(experiment).name.split("-")[0]


@pytest.fixture(scope="module")
def data_roots(tmp_path_factory) -> dict[str, Path]:
    return write_all(tmp_path_factory.mktemp("lra_data"))


def test_every_table_row_has_a_file() -> None:
    for task in ("listops", "text", "retrieval", "image", "pathfinder"):
        for row in ("full", "mita", "mita_routing", "agent_minus", "moba", "topk"):
            assert f"lra/{task}-{row}" in EXPERIMENTS
    for length in ("16k", "32k", "64k"):
        for row in ("full", "mita"):
            assert f"arxiv/{length}-{row}" in EXPERIMENTS


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_one_step(experiment: str, data_roots: dict[str, Path]) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    sys.path.insert(0, str(ROOT))
    import tasks.run  # noqa: F401  (registers the config resolvers)
    from tasks.common.module import split_batch

    task = _task(experiment)
    overrides = [f"experiment={experiment}", "debug=smoke", *smoke_overrides(task, data_roots[task].parent)]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=False)
    paper = OmegaConf.to_container(cfg.paper, resolve=True) if cfg.paper else None
    if "recipe" not in experiment:
        assert paper["table"] in ("D", "E") and "value" in paper
    torch.manual_seed(0)
    dm = instantiate(cfg.data)
    net = instantiate(cfg.model)
    if cfg.model.attention.name.startswith("mita"):
        assert all(block.attn.landmark_layout == "1d" for block in net.blocks)
    batch = next(iter(dm.train_dataloader()))
    inputs, labels = split_batch(batch)
    assert ("x2" in inputs) == (task == "retrieval")
    opt = torch.optim.AdamW(net.parameters(), lr=float(cfg.optimizer.lr))
    logits = net(**inputs)
    assert logits.shape == (labels.shape[0], dm.num_classes)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)
    opt.step()


@pytest.mark.slow
def test_listops_mita_end_to_end(tmp_path) -> None:
    """The real entry point (tasks.run) trains, evaluates and writes a record for one LRA row."""
    import subprocess

    root = write_listops(tmp_path / "listops-1000")
    cmd = [
        sys.executable,
        "-m",
        "tasks.run",
        "experiment=lra/listops-mita",
        "debug=smoke",
        f"data.root={root}",
        f"paths.log_dir={tmp_path / 'logs'}",
        "logger=none",
        "data.max_length=64",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert list((tmp_path / "logs").rglob("*.json"))
