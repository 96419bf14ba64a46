"""Parameters and multiply-accumulates of every experiment file's network: results/flops.csv.

For each table-row experiment (a file under configs/experiment with a ``paper:`` block) the network is built
from the composed config on the meta device (no memory, no compute) and counted on one example input with
:func:`mita.utils.flops.count_macs` (all matmuls, MiTA's routing and pooling included). Experiments whose
network or example input cannot be built without their data are reported on stderr and left out.

    python scripts/flops.py [--out results/flops.csv] [--only imagenet/ synthetic/]

With ``--only``, rows of the other experiments already in the file are kept (rows of experiment files that no
longer exist are dropped).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from tasks.common.config import compose  # noqa: E402
from tasks.common.experiments import list_experiments  # noqa: E402


def _example_input(cfg) -> dict[str, torch.Tensor]:
    """One example input: from the data module when it can be built, else an image of ``data.img_size``."""
    from hydra.utils import instantiate

    try:
        datamodule = instantiate(cfg.data)
        example = datamodule.example_input()
    except Exception:  # noqa: BLE001 - data modules may need files; images fall back to the configured size
        size = OmegaConf.select(cfg, "data.img_size")
        if size is None:
            raise
        example = {"x": torch.zeros(1, 3, int(size), int(size))}
    return example


def count_experiment(experiment: str) -> tuple[float, float]:
    """(parameters in millions, GMACs per sample) of ``experiment``'s network."""
    from hydra.utils import instantiate

    import mita.models  # noqa: F401
    from mita.utils.flops import count_macs, count_params

    cfg = compose([f"experiment={experiment}"])
    inputs = _example_input(cfg)
    try:
        # Shapes are all the count needs: the meta device builds and runs the network without memory or compute.
        with torch.device("meta"):
            net = instantiate(cfg.model)
        macs = count_macs(net, **{k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in inputs.items()})
    except (NotImplementedError, RuntimeError):
        # Layers with data-dependent steps (1D landmarks over the valid tokens) need real tensors.
        torch.manual_seed(0)
        net = instantiate(cfg.model)
        macs = count_macs(net, **inputs)
    return count_params(net) / 1e6, macs.per_sample / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "results" / "flops.csv"))
    parser.add_argument("--only", nargs="*", default=None, help="count only experiments starting with these")
    args = parser.parse_args()
    out = Path(args.out)
    existing = list_experiments()
    kept: dict[str, dict[str, str]] = {}
    if args.only is not None and out.exists():
        with out.open() as f:
            kept = {r["experiment"]: r for r in csv.DictReader(f) if r["experiment"] in existing}
    rows = []
    for experiment in existing:
        if args.only is not None and not any(experiment.startswith(p) for p in args.only):
            if experiment in kept:
                rows.append(kept[experiment])
            continue
        try:
            params_m, gmacs = count_experiment(experiment)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other experiments
            print(f"skipped {experiment}: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}", file=sys.stderr)
            continue
        rows.append({"experiment": experiment, "params_m": f"{params_m:.2f}", "gmacs": f"{gmacs:.3f}"})
        print(f"{experiment:40s} {params_m:8.2f} M params {gmacs:8.3f} GMACs")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["experiment", "params_m", "gmacs"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out} ({len(rows)} experiments)")


if __name__ == "__main__":
    main()
