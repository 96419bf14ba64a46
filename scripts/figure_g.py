"""Figure G (emergent token pruning): which key positions MiTA's routed experts select, layer by layer.

For each image, the figure shows the input and one heatmap per layer: how often each patch was selected into a
routed expert, summed over heads and landmarks. A CSV beside it gives per-layer statistics (share of
selections on background patches when a foreground mask is known, the share of distinct patches selected, the
entropy of the selection histogram) with the command, commit, date, hardware and library versions.

    # no-download demo: train the 2-layer shapes ViT (configs/experiment/synthetic/shapes-mita) briefly, then map
    python scripts/figure_g.py --synthetic
    # the paper's setting: an ImageNet-trained MiTA DeiT-S on ImageNet val images
    python scripts/figure_g.py --experiment imagenet/deit_s-mita init_weights=/path/to/mita_deit_s.ckpt \\
        data.root=/data/imagenet
    # any timm entrypoint and a folder of images (optional foreground masks: same relative path, .png)
    python scripts/figure_g.py --model mita_deit_small_patch16_224 --init-weights w.pth --images imgs/ --masks m/

Outputs: ``<out>/<name>.png`` and ``<out>/<name>.csv`` (default out: results/figure_g).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mita.analysis import concentration_stats, patch_mask, selection_maps  # noqa: E402

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
STAT_FIELDS = [
    "layer",
    "name",
    "selections_per_image",
    "prefix_fraction",
    "distinct_patch_fraction",
    "entropy_nats",
    "normalized_entropy",
    "background_selection_fraction",
    "background_patch_fraction",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--synthetic", action="store_true", help="generated shape images and a briefly trained model")
    source.add_argument("--experiment", help="compose configs/experiment/<EXPERIMENT> and build its model")
    source.add_argument("--model", help="timm entrypoint, e.g. mita_deit_small_patch16_224 (default when no source)")
    p.add_argument("overrides", nargs="*", help="config overrides with --experiment / --synthetic (key=value)")
    p.add_argument("--init-weights", help="checkpoint to load (timm / torch state dict, .safetensors, Lightning)")
    p.add_argument("--m", type=int, help="landmarks of every MiTA layer (--model only)")
    p.add_argument("--k", type=int, help="keys per routed expert (--model only)")
    p.add_argument("--images", help="folder of images (searched recursively; an ImageFolder's val/ works)")
    p.add_argument("--masks", help="folder of foreground masks: same relative path as the image, .png, >0 = object")
    p.add_argument("--mask-threshold", type=float, default=0.5, help="share of a patch's pixels that make it object")
    p.add_argument("--num-images", type=int, default=8, help="images to analyse (statistics average over them)")
    p.add_argument("--show", type=int, default=4, help="images drawn in the figure")
    p.add_argument("--steps", type=int, default=256, help="--synthetic: training steps")
    p.add_argument("--eval-images", type=int, default=1024, help="--synthetic: held-out images for the accuracy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", help="output file stem (default: from the source)")
    p.add_argument("--out", default=str(REPO / "results" / "figure_g"))
    args = p.parse_args(argv)
    if args.overrides and not (args.experiment or args.synthetic):
        p.error("config overrides (key=value) need --experiment or --synthetic")
    if not (args.synthetic or args.experiment or args.model):
        args.model = "mita_deit_small_patch16_224"
    return args


def shape_masks(n: int, size: int, seed: int, shape_size: int = 9) -> torch.Tensor:
    """Foreground masks of ``make_shapes(n, size, seed=seed)``: the ``shape_size`` box holding each shape.

    The shapes are rendered again without noise (same seed, so same positions and colours); the box is the
    window holding the most lit pixels (a shape lights at least 17 of its 81, a distractor is one pixel).

    Returns:
        ``[n, size, size]`` bool.
    """
    from tasks.synthetic.data import make_shapes

    clean, _ = make_shapes(n, size, shape_size=shape_size, noise=0.0, seed=seed)
    lit = (clean.abs().sum(1) > 0).float()
    window = F.avg_pool2d(lit[:, None], shape_size, stride=1)[:, 0]  # [n, size - s + 1, size - s + 1]
    pos = window.flatten(1).argmax(1)
    side = window.shape[-1]
    masks = torch.zeros(n, size, size, dtype=torch.bool)
    for i, p in enumerate(pos.tolist()):
        y, x = divmod(p, side)
        masks[i, y : y + shape_size, x : x + shape_size] = True
    return masks


def train_synthetic(net: torch.nn.Module, cfg: Any, steps: int, seed: int, eval_images: int = 1024) -> float:
    """Train the shapes model for ``steps`` AdamW steps (the experiment's lr and weight decay, one-cycle schedule);
    return its top-1 on ``eval_images`` held-out images."""
    from tasks.synthetic.data import make_shapes

    torch.manual_seed(seed)
    size = int(cfg.data.img_size)
    x, y = make_shapes(int(cfg.data.num_train), size, seed=int(cfg.data.seed))
    batch = int(cfg.data.batch_size)
    opt = torch.optim.AdamW(
        net.parameters(), lr=float(cfg.optimizer.lr), weight_decay=float(cfg.optimizer.weight_decay)
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=float(cfg.optimizer.lr), total_steps=max(steps, 1))
    net.train()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,), generator=g)
        loss = F.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    net.eval()
    xv, yv = make_shapes(eval_images, size, seed=int(cfg.data.seed) + 1000)
    with torch.no_grad():
        pred = torch.cat([net(xv[i : i + 256]).argmax(-1) for i in range(0, eval_images, 256)])
    return (pred == yv).float().mean().item()


def collect_images(root: Path, n: int) -> list[Path]:
    """Up to ``n`` image files under ``root``, taken in turn from each subfolder (so an ImageFolder's val/
    gives images of different classes), sorted within each folder."""
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise SystemExit(f"--images: no image files under {root}")
    groups: dict[Path, list[Path]] = {}
    for f in files:
        groups.setdefault(f.parent, []).append(f)
    picked: list[Path] = []
    lists = list(groups.values())
    i = 0
    while len(picked) < n and any(i < len(g) for g in lists):
        picked.extend(g[i] for g in lists if i < len(g))
        i += 1
    return picked[:n]


def load_images(
    paths: list[Path], root: Path, masks_root: Path | None, data_cfg: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Images resized and centre-cropped as for evaluation; returns (normalised batch, display batch in [0, 1],
    pixel masks [B, H, W] bool or None)."""
    import torchvision.transforms as T
    from PIL import Image

    size = data_cfg["input_size"][-2:]
    resize = [int(s / data_cfg.get("crop_pct", 1.0)) for s in size]
    geometry = T.Compose([T.Resize(resize, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size)])
    mask_geometry = T.Compose([T.Resize(resize, interpolation=T.InterpolationMode.NEAREST), T.CenterCrop(size)])
    shown, masks = [], []
    for path in paths:
        shown.append(T.functional.to_tensor(geometry(Image.open(path).convert("RGB"))))
        if masks_root is not None:
            mask_path = (masks_root / path.relative_to(root)).with_suffix(".png")
            if not mask_path.exists():
                raise SystemExit(f"--masks: no mask {mask_path} for image {path}")
            masks.append(T.functional.to_tensor(mask_geometry(Image.open(mask_path).convert("L")))[0] > 0)
    display = torch.stack(shown)
    mean = torch.tensor(data_cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(data_cfg["std"]).view(1, 3, 1, 1)
    return (display - mean) / std, display, torch.stack(masks) if masks else None


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The network and a description of it (model, weights, training, images) for the provenance."""
    import timm

    import mita  # noqa: F401  (registers the timm entrypoints)

    info: dict[str, Any] = {}
    cfg = None
    if args.synthetic or args.experiment:
        from hydra.utils import instantiate

        from tasks.common.config import compose

        experiment = "synthetic/shapes-mita" if args.synthetic else args.experiment
        cfg = compose([f"experiment={experiment}", *args.overrides])
        net = instantiate(cfg.model)
        info["model"] = f"experiment={experiment} {' '.join(args.overrides)}".strip()
    else:
        kwargs = {key: getattr(args, key) for key in ("m", "k") if getattr(args, key) is not None}
        net = timm.create_model(args.model, attention="mita", attention_kwargs=kwargs)
        info["model"] = f"{args.model} mita {kwargs or 'defaults'}"
    weights = args.init_weights or (cfg.get("init_weights") if cfg is not None else None)
    if weights:
        from tasks.common.weights import load_init_weights

        loaded = load_init_weights(net, weights)
        info["weights"] = f"{weights} ({len(loaded['missing'])} parameters not in the checkpoint)"
    elif args.synthetic:
        acc = train_synthetic(net, cfg, args.steps, args.seed, args.eval_images)
        info["weights"] = (
            f"trained here: {args.steps} steps, seed {args.seed}; top-1 {100 * acc:.1f}% on {args.eval_images} "
            "held-out images"
        )
    else:
        info["weights"] = "NONE: random initialisation (the maps then say nothing about a trained model)"
        print("figure_g: no --init-weights: the model has random weights", file=sys.stderr)
    info["cfg"] = cfg
    return net.eval(), info


def inputs(args: argparse.Namespace, net: torch.nn.Module, info: dict[str, Any]):
    """(normalised images, display images [0, 1], pixel foreground masks or None, description, threshold)."""
    if args.synthetic:
        from tasks.synthetic.data import make_shapes

        cfg = info["cfg"]
        size, seed = int(cfg.data.img_size), int(cfg.data.seed) + 2000
        x, _ = make_shapes(args.num_images, size, seed=seed)
        display = ((x - x.amin()) / (x.amax() - x.amin())).clamp(0, 1)
        # Object patches: any pixel of the shape's box (a 9-pixel box covers parts of 3 to 4 patches per side).
        return x, display, shape_masks(args.num_images, size, seed), f"make_shapes(seed={seed})", 1e-6
    import timm.data

    images = args.images
    cfg = info.get("cfg")
    if images is None and cfg is not None and cfg.get("data") is not None and cfg.data.get("root"):
        images = str(Path(cfg.data.root) / "val")
    if images is None:
        raise SystemExit("figure_g: give --images DIR (or data.root=... with --experiment), or use --synthetic")
    root = Path(images)
    paths = collect_images(root, args.num_images)
    data_cfg = timm.data.resolve_data_config({}, model=net)
    x, display, masks = load_images(paths, root, Path(args.masks) if args.masks else None, data_cfg)
    return x, display, masks, f"{len(paths)} images from {root}", args.mask_threshold


def draw(path: Path, display: torch.Tensor, maps, foreground: torch.Tensor | None, stats, show: int, title: str):
    """Rows: images (input, then one heatmap per layer); last row: per-layer statistics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = maps.patches.shape[0]
    rows = min(show, display.shape[0])
    cols = L + 1
    fig = plt.figure(figsize=(1.7 * cols + 0.6, 1.7 * rows + 2.4))
    grid = fig.add_gridspec(rows + 1, cols, height_ratios=[1] * rows + [1.3])
    for r in range(rows):
        ax = fig.add_subplot(grid[r, 0])
        ax.imshow(display[r].permute(1, 2, 0).numpy())
        ax.set_axis_off()
        if r == 0:
            ax.set_title("input", fontsize=8)
        for i in range(L):
            ax = fig.add_subplot(grid[r, i + 1])
            ax.imshow(maps.patches[i, r].numpy(), cmap="magma", interpolation="nearest")
            if foreground is not None and foreground[r].any() and not foreground[r].all():
                # Upsampled so the outline follows patch borders rather than patch centres.
                fine = foreground[r].float().repeat_interleave(16, 0).repeat_interleave(16, 1).numpy()
                h, w = foreground.shape[-2:]
                extent = (-0.5, w - 0.5, -0.5, h - 0.5)
                ax.contour(fine, levels=[0.5], colors="cyan", linewidths=0.8, extent=extent)
            ax.set_axis_off()
            if r == 0:
                ax.set_title(f"layer {i + 1}", fontsize=8)
    ax = fig.add_subplot(grid[rows, :])
    layers = list(range(1, L + 1))
    ax.plot(layers, [s["distinct_patch_fraction"] for s in stats], "o-", label="patches selected at least once")
    ax.plot(layers, [s["normalized_entropy"] for s in stats], "s-", label="entropy / log(#patches)")
    if foreground is not None:
        ax.plot(layers, [s["background_selection_fraction"] for s in stats], "^-", label="selections on background")
        ax.plot(layers, [s["background_patch_fraction"] for s in stats], "k--", label="background patches (uniform)")
    ax.set_xlabel("layer")
    ax.set_xticks(layers)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_csv(path: Path, stats: list[dict[str, Any]], provenance: dict[str, str]) -> None:
    """Per-layer rows after ``# key: value`` provenance lines (``pandas.read_csv(path, comment="#")`` reads it)."""
    with path.open("w", newline="") as f:
        for key, value in provenance.items():
            f.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(f, fieldnames=STAT_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in stats:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def main(argv: list[str] | None = None) -> dict[str, Path]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    from tasks.common.records import git_state, hardware, hardware_summary, versions

    net, info = build(args)
    x, display, masks, source, threshold = inputs(args, net, info)
    maps = selection_maps(net, x)
    h, w = maps.patches.shape[-2:]
    foreground = patch_mask(masks, (h, w), threshold) if masks is not None else None
    stats = concentration_stats(maps, foreground)

    name = args.name or ("synthetic_shapes" if args.synthetic else (args.experiment or args.model).replace("/", "_"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    git = git_state()
    hw = hardware()
    provenance = {
        "command": shlex.join(["python", "scripts/figure_g.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": f"{git['commit']}{' (uncommitted changes)' if git['dirty'] else ''}",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": f"{hardware_summary(hw)}, {hw['cpu']}",
        "versions": ", ".join(f"{k} {v}" for k, v in versions().items() if v),
        "model": info["model"],
        "weights": info["weights"],
        "images": source,
        "foreground": "none given" if masks is None else f"patch is object when >= {threshold:g} of its pixels are",
        "counts": f"{maps.heads[0]} heads x {maps.landmarks[0]} landmarks x {maps.k[0]} keys per layer and image",
    }
    csv_path, png_path = out / f"{name}.csv", out / f"{name}.png"
    write_csv(csv_path, stats, provenance)
    draw(png_path, display, maps, foreground, stats, args.show, f"{name}: routed-expert key selections per layer")
    print(f"figure_g: {png_path} {csv_path}")
    for row in stats:
        extra = (
            f" background {row['background_selection_fraction']:.3f} (uniform {row['background_patch_fraction']:.3f})"
            if foreground is not None
            else ""
        )
        print(
            f"  layer {row['layer'] + 1}: distinct {row['distinct_patch_fraction']:.3f}, "
            f"entropy/log(n) {row['normalized_entropy']:.3f}, prefix {row['prefix_fraction']:.3f}{extra}"
        )
    return {"png": png_path, "csv": csv_path}


if __name__ == "__main__":
    main()
