"""Generate Pathfinder-32 (the LRA "hard" setting, contour length 14) in the release layout.

The images follow Linsley et al. 2018 ("Learning long-range spatial dependencies with horizontal gated
recurrent units"): two target curves ("snakes") of ``contour_length`` segments grown from tails
``seed_distance`` apart, short distractor snakes, and two circular markers. Label 1: the markers sit on the
two ends of one snake; label 0: one marker on each snake (the tail of one, the head of the other), so the
marker distance distribution is the same for both labels.

A snake grows one segment (paddle) at a time: the next head is drawn among the pixels on a circle of radius
``paddle_length`` around the last head, with probability proportional to
``(1 - occupancy) * max(cos(min(|turn| * continuity, pi/2)), 0) ** 2``; a segment whose stroke touches the
occupancy mask (earlier strokes dilated by ``margin``, the image border) is rejected and redrawn, and a
snake that cannot grow is regenerated. Everything is drawn at ``antialias`` times the resolution with
soft-edged strokes, box-downsampled, and min-max scaled to uint8.

Output (the release's ``pathfinder32/curv_contour_length_14``)::

    OUT/curv_contour_length_14/imgs/<b>/sample_<i>.png           32 x 32 grayscale PNG
    OUT/curv_contour_length_14/metadata/<b>.npy                   TEXT despite the suffix, one line per image:
        imgs/<b> sample_<i>.png <i> <label> <continuity> <contour_length> <distractor_length> <paddle_length>
        <paddle_thickness> <margin> 1

Batches hold ``--per-batch`` images with exactly balanced labels (one extra 0 when odd); batch ``b`` is drawn
from ``numpy.random.default_rng([seed, b])``, so the output does not depend on the number of processes.

Usage::

    python scripts/prepare_data/pathfinder.py --out data/lra_release/pathfinder32 --n 200000 --seed 0
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm


@dataclass(frozen=True)
class Params:
    """Generator settings in output-pixel units (the spec's Pathfinder-32 hard setting by default)."""

    size: int = 32
    contour_length: int = 14
    paddle_length: float = 2.0
    paddle_thickness: float = 0.5
    margin: float = 1.0
    padding: float = 1.0
    antialias: int = 2
    continuity: float = 1.0
    seed_distance: float = 7.0
    marker_radius: float = 1.5
    max_segment_trial: int = 4
    max_distractor_trial: int = 4

    @property
    def distractor_length(self) -> int:
        return self.contour_length // 3

    @property
    def num_distractors(self) -> int:
        return 20 // self.distractor_length


class _Canvas:
    """High-resolution ink image and occupancy mask, with stroke rendering by distance to a segment."""

    def __init__(self, p: Params) -> None:
        self.p = p
        self.s = p.antialias
        self.n = p.size * p.antialias
        yy, xx = np.mgrid[0 : self.n, 0 : self.n]
        # Pixel centres in high-resolution units.
        self.yy = yy.astype(np.float64) + 0.5
        self.xx = xx.astype(np.float64) + 0.5
        self.ink = np.zeros((self.n, self.n))
        self.occ = np.zeros((self.n, self.n), dtype=bool)
        pad = int(round(p.padding * self.s))
        self.occ[:pad] = self.occ[-pad:] = True
        self.occ[:, :pad] = self.occ[:, -pad:] = True
        self.half = p.paddle_thickness * self.s / 2
        self.dilate = self.half + p.margin * self.s

    def distance(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Distance of every pixel centre to the segment a-b ([2] (y, x) high-res points) -> [n, n]."""
        d = b - a
        t = ((self.yy - a[0]) * d[0] + (self.xx - a[1]) * d[1]) / max(float(d @ d), 1e-12)
        t = np.clip(t, 0.0, 1.0)
        return np.hypot(self.yy - (a[0] + t * d[0]), self.xx - (a[1] + t * d[1]))

    def inside(self, pt: np.ndarray) -> bool:
        return 0 <= pt[0] < self.n and 0 <= pt[1] < self.n


class _Snake:
    """One growing curve: tail, head, heading, and its last segment's occupancy held out of the global mask."""

    def __init__(self, tail: np.ndarray, heading: float) -> None:
        self.tail = tail
        self.head = tail
        self.heading = heading
        self.pending: np.ndarray | None = None


def _place(canvas: _Canvas, snake: _Snake, new_head: np.ndarray, extra: np.ndarray | None = None) -> bool:
    """Draw the segment head -> new_head if its stroke avoids the occupancy mask (and ``extra``); returns success."""
    if not canvas.inside(new_head):
        return False
    dist = canvas.distance(snake.head, new_head)
    stroke = dist <= canvas.half + 0.5
    if (stroke & canvas.occ).any() or (extra is not None and (stroke & extra).any()):
        return False
    canvas.ink = np.maximum(canvas.ink, np.clip(canvas.half + 0.5 - dist, 0.0, 1.0))
    # The previous segment joins the mask only now, so a segment never collides with its predecessor.
    if snake.pending is not None:
        canvas.occ |= snake.pending
    snake.pending = dist <= canvas.dilate
    delta = new_head - snake.head
    snake.heading = math.atan2(delta[0], delta[1])
    snake.head = new_head
    return True


def _first_segment(canvas: _Canvas, snake: _Snake, rng: np.random.Generator, extra: np.ndarray | None = None) -> bool:
    length = canvas.p.paddle_length * canvas.s
    for _ in range(canvas.p.max_segment_trial + 1):
        heading = rng.integers(-180, 180) * math.pi / 180
        head = snake.tail + length * np.array([math.sin(heading), math.cos(heading)])
        if _place(canvas, snake, head, extra):
            return True
    return False


def _grow(canvas: _Canvas, snake: _Snake, rng: np.random.Generator, extra: np.ndarray | None = None) -> bool:
    """Add one segment to ``snake`` by the continuity-weighted circle sampling; False at a dead end.

    ``extra`` is occupancy not yet in the canvas mask (the other target snake's last segment).
    """
    p = canvas.p
    length = p.paddle_length * canvas.s
    # One candidate per pixel of arc length on the circle around the head.
    angles = np.arange(0.0, 2 * math.pi, 1.0 / length)
    cand = snake.head[None, :] + length * np.stack([np.sin(angles), np.cos(angles)], axis=1)
    cand = np.unique(np.floor(cand), axis=0) + 0.5
    ok = (cand[:, 0] >= 0) & (cand[:, 0] < canvas.n) & (cand[:, 1] >= 0) & (cand[:, 1] < canvas.n)
    cand = cand[ok]
    if len(cand) == 0:
        return False
    disp = cand - snake.head
    turn = np.abs(np.arctan2(disp[:, 0], disp[:, 1]) - snake.heading)
    turn = np.minimum(turn, 2 * math.pi - turn)
    weight = np.maximum(np.cos(np.minimum(turn * p.continuity, math.pi / 2)), 0.0) ** 2
    occ = canvas.occ if extra is None else canvas.occ | extra
    free = ~occ[cand[:, 0].astype(int), cand[:, 1].astype(int)]
    weight = weight * free
    for _ in range(p.max_segment_trial + 1):
        total = weight.sum()
        if total < 1e-6:
            return False
        i = rng.choice(len(cand), p=weight / total)
        if _place(canvas, snake, cand[i], extra):
            return True
        weight[i] = 0.0
    return False


def _commit(canvas: _Canvas, snake: _Snake) -> None:
    if snake.pending is not None:
        canvas.occ |= snake.pending
        snake.pending = None


def _two_targets(p: Params, rng: np.random.Generator) -> tuple[_Canvas, list[_Snake]] | None:
    canvas = _Canvas(p)
    s = canvas.s
    lo, hi = p.seed_distance * s, canvas.n - p.seed_distance * s
    tail1 = np.floor(rng.uniform(lo, hi, size=2)) + 0.5
    angle = rng.integers(0, 360) * math.pi / 180
    tail2 = np.floor(tail1 + p.seed_distance * s * np.array([math.sin(angle), math.cos(angle)])) + 0.5
    pad = p.padding * s
    if not (pad <= tail2[0] < canvas.n - pad and pad <= tail2[1] < canvas.n - pad):
        return None
    snakes = [_Snake(tail1, 0.0), _Snake(tail2, 0.0)]
    if not _first_segment(canvas, snakes[0], rng) or not _first_segment(canvas, snakes[1], rng, snakes[0].pending):
        return None
    # Grow both targets in turn so that neither gets first claim on the free space.
    for _ in range(p.contour_length - 1):
        for i, snake in enumerate(snakes):
            if not _grow(canvas, snake, rng, snakes[1 - i].pending):
                return None
    for snake in snakes:
        _commit(canvas, snake)
    return canvas, snakes


def _distractor(canvas: _Canvas, p: Params, rng: np.random.Generator) -> None:
    """Add one distractor snake of ``distractor_length`` segments, leaving the canvas untouched on failure."""
    for _ in range(p.max_distractor_trial + 1):
        free = np.argwhere(~canvas.occ)
        if len(free) == 0:
            return
        saved = (canvas.ink.copy(), canvas.occ.copy())
        snake = _Snake(free[rng.integers(len(free))] + 0.5, 0.0)
        ok = _first_segment(canvas, snake, rng)
        for _ in range(p.distractor_length - 1):
            ok = ok and _grow(canvas, snake, rng)
        if ok:
            _commit(canvas, snake)
            return
        canvas.ink, canvas.occ = saved


def _disc(canvas: _Canvas, centre: np.ndarray, radius: float) -> np.ndarray:
    r = radius * canvas.s
    dist = np.hypot(canvas.yy - centre[0], canvas.xx - centre[1])
    return np.clip(r + 0.5 - dist, 0.0, 1.0)


def make_image(label: int, rng: np.random.Generator, p: Params = Params()) -> np.ndarray:
    """One Pathfinder image.

    Args:
        label: 1 if the two markers are to sit on the same snake, else 0.
        rng: random source.
        p: generator settings.

    Returns:
        [size, size] uint8 image, min-max scaled to 0..255.
    """
    while True:
        made = _two_targets(p, rng)
        if made is not None:
            break
    canvas, snakes = made
    for _ in range(p.num_distractors):
        _distractor(canvas, p, rng)
    first = int(rng.integers(0, 2))
    second = first if label == 1 else 1 - first
    markers = np.maximum(
        _disc(canvas, snakes[first].tail, p.marker_radius), _disc(canvas, snakes[second].head, p.marker_radius)
    )
    hi = np.maximum(canvas.ink, markers)
    s = p.antialias
    lo = hi.reshape(p.size, s, p.size, s).mean(axis=(1, 3))
    lo = (lo - lo.min()) / max(lo.max() - lo.min(), 1e-12)
    return np.round(lo * 255).astype(np.uint8)


def metadata_line(batch: int, index: int, label: int, p: Params) -> str:
    """The release's metadata line for one image (space separated; label in field 4)."""
    return (
        f"imgs/{batch} sample_{index}.png {index} {label} {p.continuity} {p.contour_length} "
        f"{p.distractor_length} {p.paddle_length:g} {p.paddle_thickness} {p.margin:g} 1"
    )


def _batch(args: tuple[Path, int, int, int, Params]) -> int:
    root, seed, batch, count, p = args
    rng = np.random.default_rng([seed, batch])
    labels = rng.permutation(np.arange(count) % 2 == 1).astype(int)
    img_dir = root / "imgs" / str(batch)
    img_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, label in enumerate(labels):
        Image.fromarray(make_image(int(label), rng, p), mode="L").save(img_dir / f"sample_{i}.png")
        lines.append(metadata_line(batch, i, int(label), p))
    (root / "metadata").mkdir(parents=True, exist_ok=True)
    (root / "metadata" / f"{batch}.npy").write_text("\n".join(lines) + "\n")
    return count


def generate(
    out: Path,
    n: int,
    seed: int,
    per_batch: int = 1000,
    p: Params = Params(),
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Write ``n`` images and their metadata under ``out/curv_contour_length_<L>``; returns that folder.

    Args:
        out: the pathfinder32 folder.
        n: number of images.
        seed: the seed.
        per_batch: images per ``imgs/<b>`` folder / metadata file.
        p: generator settings.
        workers: processes (default: every core).
        progress: show a progress bar.
    """
    root = Path(out) / f"curv_contour_length_{p.contour_length}"
    jobs = [(root, seed, b, min(per_batch, n - b * per_batch), p) for b in range(math.ceil(n / per_batch))]
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    bar = tqdm(total=n, desc="pathfinder", unit="img", disable=not progress)
    if workers > 1:
        with mp.Pool(workers) as pool:
            for done in pool.imap_unordered(_batch, jobs):
                bar.update(done)
    else:
        for job in jobs:
            bar.update(_batch(job))
    bar.close()
    return root


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output folder (the release's pathfinder32)")
    parser.add_argument("--n", type=int, default=200000, help="number of images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-batch", type=int, default=1000, help="images per imgs/<b> folder")
    parser.add_argument("--contour-length", type=int, default=14)
    parser.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    root = generate(
        args.out,
        args.n,
        args.seed,
        args.per_batch,
        Params(contour_length=args.contour_length),
        args.workers,
        not args.no_progress,
    )
    print(f"wrote {args.n} images to {root}")


if __name__ == "__main__":
    main()
