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
snake that cannot grow is regenerated. A snake's first segment takes a uniform whole-degree heading, its end
snapped to a pixel centre like every later head. Everything is drawn at ``antialias`` times the resolution with
soft-edged strokes, box-downsampled, and min-max scaled to uint8.

Speed: every head lies on a high-resolution pixel centre, so a segment is one of a few integer offsets and its
stroke, ink and dilated footprint are patterns computed once (``_Tables``); occupancy is one Python int with a bit
per pixel, so a collision test is a shift and an AND on a small window, and the ink is drawn once per image.
Measured 2026-12-03 on 2 cores (PNG writing included): 4,000 images in 3.8 s with one process (about 1,050
images/s per core) and 2.0-2.2 s with two (about 900-1,000 images/s per core); runs that met a file-system stall
there took up to twice as long.

Output (the release's ``pathfinder32/curv_contour_length_14``)::

    OUT/curv_contour_length_14/imgs/<b>/sample_<i>.png           32 x 32 grayscale PNG
    OUT/curv_contour_length_14/metadata/<b>.npy                   TEXT despite the suffix, one line per image:
        imgs/<b> sample_<i>.png <i> <label> <continuity> <contour_length> <distractor_length> <paddle_length>
        <paddle_thickness> <margin> 1

Batches hold ``--per-batch`` images with exactly balanced labels (one extra 0 when odd); batch ``b`` is drawn
from ``numpy.random.default_rng([seed, b])`` alone, so the output does not depend on the number of processes.

Usage::

    python scripts/prepare_data/pathfinder.py --out data/lra_release/pathfinder32 --n 200000 --seed 0
"""

from __future__ import annotations

import argparse
import functools
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


class _Tables:
    """Everything about one segment that does not depend on where it is drawn, computed once per ``Params``.

    Heads sit on high-resolution pixel centres, so a segment is one of a few integer offsets from its start and its
    stroke, its ink and its occupancy footprint are the same pattern wherever it lies. The canvas is held flat with a
    border of ``pad`` pixels on every side (marked occupied), so that a window of ``±r`` pixels around any head stays
    inside it; occupancy is a Python int with one bit per flat pixel, and a window is a shift and a mask of it.
    """

    def __init__(self, p: Params) -> None:
        s = p.antialias
        self.n = n = p.size * s
        length = p.paddle_length * s
        stroke = p.paddle_thickness * s / 2 + 0.5
        dilate = p.paddle_thickness * s / 2 + p.margin * s
        disc = p.marker_radius * s + 0.5

        # Grow candidates: one per pixel of arc length on the circle around a head, deduplicated pixels.
        angles = np.arange(0.0, 2 * math.pi, 1.0 / length)
        grow = sorted(
            set(
                zip(
                    np.floor(0.5 + length * np.sin(angles)).astype(int).tolist(),
                    np.floor(0.5 + length * np.cos(angles)).astype(int).tolist(),
                )
            )
        )
        # First segments: a heading in whole degrees, its end snapped to the pixel centre it falls in.
        deg = np.arange(-180, 180) * math.pi / 180
        first = list(
            zip(
                np.floor(0.5 + length * np.sin(deg)).astype(int).tolist(),
                np.floor(0.5 + length * np.cos(deg)).astype(int).tolist(),
            )
        )
        offsets = grow + sorted(set(first) - set(grow))
        index = {o: i for i, o in enumerate(offsets)}
        self.first = [index[o] for o in first]

        reach = max(max(abs(dy), abs(dx)) for dy, dx in offsets)
        self.r = r = reach + int(math.ceil(max(dilate, disc))) + 1
        self.pad = pad = r
        self.w = w = n + 2 * pad
        self.rw = r * w + r  # flat distance from a window's first pixel to its centre
        rows = 2 * r + 1
        self.win_mask = (1 << (rows * w)) - 1
        ry, rx = np.mgrid[-r : r + 1, -r : r + 1].astype(np.float64)
        bit = ((ry + r) * w + (rx + r)).astype(np.int64)
        rel = (ry * w + rx).astype(np.int64)

        def to_int(sel: np.ndarray) -> int:
            flat = np.zeros(rows * w, dtype=bool)
            flat[bit[sel]] = True
            return int.from_bytes(np.packbits(flat, bitorder="little").tobytes(), "little")

        self.delta = [dy * w + dx for dy, dx in offsets]
        self.stroke, self.dilated, ink_idx, ink_val = [], [], [], []
        for dy, dx in offsets:
            t = np.clip((ry * dy + rx * dx) / float(dy * dy + dx * dx), 0.0, 1.0)
            dist = np.hypot(ry - t * dy, rx - t * dx)
            self.stroke.append(to_int(dist <= stroke))
            self.dilated.append(to_int(dist <= dilate))
            ink = np.clip(stroke - dist, 0.0, 1.0)
            ink_idx.append(rel[ink > 0])
            ink_val.append(ink[ink > 0])
        dist = np.hypot(ry, rx)
        ink = np.clip(disc - dist, 0.0, 1.0)
        ink_idx.append(rel[ink > 0])
        ink_val.append(ink[ink > 0])
        self.disc = len(offsets)  # row of the marker disc in the ink tables
        # Ink patterns padded to one length (value 0 at offset 0 is a no-op under max).
        width = max(len(i) for i in ink_idx)
        self.ink_idx = np.zeros((len(ink_idx), width), dtype=np.int64)
        self.ink_val = np.zeros((len(ink_idx), width))
        for i, (idx, val) in enumerate(zip(ink_idx, ink_val)):
            self.ink_idx[i, : len(idx)] = idx
            self.ink_val[i, : len(val)] = val

        # Continuity weights: for the offset a snake last took, the grow candidates of nonzero weight as
        # (offset index, weight, candidate-pixel bit, stroke bits).
        heading = [math.atan2(dy, dx) for dy, dx in offsets]
        self.choices = []
        for prev in range(len(offsets)):
            row = []
            for g, (dy, dx) in enumerate(grow):
                turn = abs(heading[g] - heading[prev])
                turn = min(turn, 2 * math.pi - turn)
                weight = max(math.cos(min(turn * p.continuity, math.pi / 2)), 0.0) ** 2
                if weight > 0:
                    row.append((g, weight, 1 << ((dy + r) * w + dx + r), self.stroke[g]))
            self.choices.append(row)

        # Occupancy before anything is drawn: the image border (``padding``) and everything outside the canvas.
        border = int(round(p.padding * s))
        occ = np.ones((w, w), dtype=bool)
        occ[pad + border : pad + n - border, pad + border : pad + n - border] = False
        self.empty = int.from_bytes(np.packbits(occ.ravel(), bitorder="little").tobytes(), "little")


@functools.lru_cache(maxsize=8)
def _tables(p: Params) -> _Tables:
    return _Tables(p)


class Uniforms:
    """Uniform [0, 1) numbers from a numpy Generator, drawn a block at a time (one numpy call per block)."""

    def __init__(self, rng: np.random.Generator, block: int = 1024) -> None:
        self.rng = rng
        self.block = block
        self.buf: list[float] = []
        self.i = 0

    def __call__(self) -> float:
        if self.i == len(self.buf):
            self.buf = self.rng.random(self.block).tolist()
            self.i = 0
        self.i += 1
        return self.buf[self.i - 1]


def _first_segment(tb: _Tables, p: Params, occ: int, head: int, u: Uniforms) -> int | None:
    """Offset index of a first segment from ``head`` in a uniform whole-degree heading whose stroke avoids ``occ``."""
    win = (occ >> (head - tb.rw)) & tb.win_mask
    for _ in range(p.max_segment_trial + 1):
        k = tb.first[int(u() * 360)]
        if not win & tb.stroke[k]:
            return k
    return None


def _grow(tb: _Tables, p: Params, occ: int, head: int, prev: int, u: Uniforms) -> int | None:
    """Offset index of the next segment from ``head`` (last offset ``prev``) by the continuity-weighted circle
    sampling over free candidate pixels, rejecting strokes that touch ``occ``; None at a dead end."""
    win = (occ >> (head - tb.rw)) & tb.win_mask
    cands = [(g, weight, stroke) for g, weight, bit, stroke in tb.choices[prev] if not win & bit]
    weights = [c[1] for c in cands]
    for _ in range(p.max_segment_trial + 1):
        total = sum(weights)
        if total < 1e-6:
            return None
        x = u() * total
        acc = 0.0
        i = last = -1
        for j, weight in enumerate(weights):
            if weight > 0:
                last = j
                acc += weight
                if x < acc:
                    i = j
                    break
        if i < 0:  # rounding at the top end
            i = last
        g, _, stroke = cands[i]
        if not win & stroke:
            return g
        weights[i] = 0.0
    return None


def _two_targets(tb: _Tables, p: Params, u: Uniforms) -> tuple[int, list[tuple[int, int]], list[int], list[int]] | None:
    """Both target snakes grown in turn, or None when either cannot be completed.

    Returns (occupancy, segments as (offset index, start), the two tails, the two heads); a snake's last segment is
    held out of the occupancy until its next one is placed (so a segment never collides with its predecessor) and is
    checked against the other snake as extra occupancy.
    """
    s, n, w, pad = p.antialias, tb.n, tb.w, tb.pad
    lo, hi = p.seed_distance * s, n - p.seed_distance * s
    y1 = math.floor(lo + u() * (hi - lo))
    x1 = math.floor(lo + u() * (hi - lo))
    angle = int(u() * 360) * math.pi / 180
    y2 = math.floor(y1 + 0.5 + p.seed_distance * s * math.sin(angle))
    x2 = math.floor(x1 + 0.5 + p.seed_distance * s * math.cos(angle))
    border = p.padding * s
    if not (border <= y2 + 0.5 < n - border and border <= x2 + 0.5 < n - border):
        return None
    tails = [(y1 + pad) * w + x1 + pad, (y2 + pad) * w + x2 + pad]
    heads = list(tails)
    occ = tb.empty
    pending = [0, 0]
    prev = [0, 0]
    segs: list[tuple[int, int]] = []
    rw, dilated, delta = tb.rw, tb.dilated, tb.delta
    for i in (0, 1):
        k = _first_segment(tb, p, occ | pending[1 - i], heads[i], u)
        if k is None:
            return None
        pending[i] = dilated[k] << (heads[i] - rw)
        segs.append((k, heads[i]))
        heads[i] += delta[k]
        prev[i] = k
    for _ in range(p.contour_length - 1):
        for i in (0, 1):
            k = _grow(tb, p, occ | pending[1 - i], heads[i], prev[i], u)
            if k is None:
                return None
            occ |= pending[i]
            pending[i] = dilated[k] << (heads[i] - rw)
            segs.append((k, heads[i]))
            heads[i] += delta[k]
            prev[i] = k
    return occ | pending[0] | pending[1], segs, tails, heads


def _free_pixel(tb: _Tables, occ: int, u: Uniforms) -> int | None:
    """A uniformly drawn unoccupied canvas pixel (flat index), or None when there is none."""
    n, w, pad = tb.n, tb.w, tb.pad
    for _ in range(64):
        y, x = divmod(int(u() * n * n), n)
        pos = (y + pad) * w + x + pad
        if not (occ >> pos) & 1:
            return pos
    # Nearly full canvas: draw among the free pixels directly.
    bits = np.unpackbits(np.frombuffer(occ.to_bytes(w * w // 8 + 1, "little"), dtype=np.uint8), bitorder="little")
    free = np.flatnonzero(~bits[: w * w].reshape(w, w)[pad : pad + n, pad : pad + n].astype(bool))
    if len(free) == 0:
        return None
    y, x = divmod(int(free[int(u() * len(free))]), n)
    return (y + pad) * w + x + pad


def _distractor(tb: _Tables, p: Params, occ: int, segs: list[tuple[int, int]], u: Uniforms) -> int:
    """Add one distractor snake of ``distractor_length`` segments to ``segs``; returns the new occupancy (the old
    one, with ``segs`` untouched, when every attempt fails)."""
    rw, dilated, delta = tb.rw, tb.dilated, tb.delta
    for _ in range(p.max_distractor_trial + 1):
        head = _free_pixel(tb, occ, u)
        if head is None:
            return occ
        k = _first_segment(tb, p, occ, head, u)
        if k is None:
            continue
        mine = [(k, head)]
        work, pending = occ, dilated[k] << (head - rw)
        head += delta[k]
        for _ in range(p.distractor_length - 1):
            k = _grow(tb, p, work, head, k, u)
            if k is None:
                break
            work |= pending
            pending = dilated[k] << (head - rw)
            mine.append((k, head))
            head += delta[k]
        else:
            segs.extend(mine)
            return work | pending
    return occ


def layout(
    label: int, rng: np.random.Generator | Uniforms, p: Params = Params(), distractors: bool = True
) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """The geometry of one image: segments as (offset index, flat start pixel) and the two marker pixels.

    Args:
        label: 1 if the two markers are to sit on the same snake, else 0.
        rng: random source.
        p: generator settings.
        distractors: add the distractor snakes (off only to look at the targets alone).
    """
    u = rng if isinstance(rng, Uniforms) else Uniforms(rng)
    tb = _tables(p)
    while True:
        made = _two_targets(tb, p, u)
        if made is not None:
            break
    occ, segs, tails, heads = made
    if distractors:
        for _ in range(p.num_distractors):
            occ = _distractor(tb, p, occ, segs, u)
    first = int(u() * 2)
    second = first if label == 1 else 1 - first
    return segs, (tails[first], heads[second])


def render(segs: list[tuple[int, int]], markers: tuple[int, ...], p: Params = Params()) -> np.ndarray:
    """High-resolution ink of ``segs`` and marker discs centred on ``markers`` -> [n, n] float in [0, 1]."""
    tb = _tables(p)
    rows = np.array([k for k, _ in segs] + [tb.disc] * len(markers), dtype=np.int64)
    starts = np.array([pos for _, pos in segs] + list(markers), dtype=np.int64)
    ink = np.zeros(tb.w * tb.w)
    np.maximum.at(ink, (tb.ink_idx[rows] + starts[:, None]).ravel(), tb.ink_val[rows].ravel())
    pad, n = tb.pad, tb.n
    return ink.reshape(tb.w, tb.w)[pad : pad + n, pad : pad + n]


def pixel(pos: int, p: Params = Params()) -> tuple[int, int]:
    """(y, x) of a flat pixel index of ``layout`` on the high-resolution canvas."""
    tb = _tables(p)
    y, x = divmod(pos, tb.w)
    return y - tb.pad, x - tb.pad


def make_image(label: int, rng: np.random.Generator | Uniforms, p: Params = Params()) -> np.ndarray:
    """One Pathfinder image.

    Args:
        label: 1 if the two markers are to sit on the same snake, else 0.
        rng: random source (a numpy Generator, or ``Uniforms`` over one to share its buffered draws).
        p: generator settings.

    Returns:
        [size, size] uint8 image, min-max scaled to 0..255.
    """
    segs, markers = layout(label, rng, p)
    hi = render(segs, markers, p)
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
    u = Uniforms(rng)
    lines = []
    for i, label in enumerate(labels):
        Image.fromarray(make_image(int(label), u, p)).save(img_dir / f"sample_{i}.png")
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
