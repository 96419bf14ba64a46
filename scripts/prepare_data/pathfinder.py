"""Generate Pathfinder-32 (LRA ``pathfinder32/curv_contour_length_14``) in the release layout.

The algorithm is the one of Linsley et al.'s reference generator (``snakes2``) with the LRA settings, re-implemented
and vectorised over many candidate images at once. Everything lives on the 32 x 32 output grid; every paddle is a
9 x 9 stamp (a 1-px line drawn at 2x and Lanczos-resized) chosen by its heading, stamps are computed once.

- Seeding: the first target snake's tail is drawn among the pixels left free when a 14-px band on every side is
  dilated by the first paddle's footprint (kernel anchored one pixel off the paddle's start), so it lies in the
  centre. As with OpenCV's dilation on a float mask, a heading whose kernel leaves some image pixel with no sample
  inside the image yields a negative minimum and is rejected; only headings reaching up and left survive. The same
  rule rejects distractor seeds. The second tail is ``seed_distance`` away at a whole-degree angle.
- Growth: each pivot moves ``paddle_length + 2 * margin`` along the last heading (ceil rounding); the next head is
  drawn among the distinct pixels on a circle of radius ``paddle_length + margin`` around it, weighted by
  ``(1 - cross-dilated mask) * cos(min(turn, pi / 2)) ** 2``, and its paddle is drawn back from the head, which leaves
  gaps (dashed snakes). A paddle is accepted when ``max(mask + its fuzzy footprint) < 1.8``, three draws at most;
  a snake's newest footprint joins the mask only when the next paddle is placed (the first target's last one never).
  A target pair that cannot be completed is discarded whole; a distractor gets five attempts and is then skipped.
- Intensities: target paddles at 0.75 * 2 = 1.5 times the stamp, distractors at 2, markers (discs of radius 3 at 2x,
  Lanczos-resized) at most 1, combined by maximum and min-max scaled to uint8 (Lanczos ringing inks ~34% of pixels).
- Label 1: markers on the tail and head of one target snake; label 0: the tail of one and the head of the other.

Checked against an emulation of the reference code (3,000 images each): marker-position kNN accuracy 0.64-0.66
(reference 0.65), ink fraction 0.341 (0.342), mean pixel 20.2 (20.2), tails of the first snake in the same 3 x 3
pixels with the same shares. Paddle and marker stamps, seeding sets and heading rejections, growth weights and the
collision test equal those of the reference functions (run with OpenCV) on every heading and on random masks.

Speed: 4,000 images with PNG writing (``--n 4000 --workers 1``) in 6.0 s wall, 5.7 s of CPU, on one process
(about 660 images/s per core) while another job kept both cores of a 2-core machine busy (load 3.5).

Output::

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
from PIL import Image, ImageDraw
from tqdm import tqdm

LANCZOS = Image.Resampling.LANCZOS


@dataclass(frozen=True)
class Params:
    """Generator settings in output pixels (the LRA Pathfinder-32 setting by default)."""

    size: int = 32
    contour_length: int = 14
    paddle_length: int = 2
    paddle_thickness: float = 0.5
    margin: int = 1
    padding: int = 1
    antialias: int = 2
    continuity: float = 1.0
    seed_distance: int = 7
    marker_radius: float = 1.5
    target_contrast: float = 1.5
    distractor_contrast: float = 2.0
    segment_trials: int = 3
    distractor_attempts: int = 5

    @property
    def distractor_length(self) -> int:
        return self.contour_length // 3

    @property
    def num_distractors(self) -> int:
        return 20 // self.distractor_length


def _ceil_shift(base: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Integer pixel reached from integer ``base`` by a float displacement, rounded up as the reference does."""
    return np.ceil(base + delta).astype(np.int64)


def _paddle_stamps(theta: float, p: Params) -> tuple[np.ndarray, np.ndarray]:
    """(ink, footprint) of one paddle starting at a window's centre pixel with heading ``theta``: uint8 squares of
    side ``2 * reach + 1`` (a 1-px line drawn at the antialias scale, Lanczos-resized; the footprint is the line
    dilated by a disc of ``margin`` before resizing)."""
    s = p.antialias
    reach = p.paddle_length + math.ceil(p.paddle_thickness) + p.margin
    big = 2 * reach * s + 1
    c = reach * s
    end_y = math.ceil(c + float(p.paddle_length * s) * np.sin(theta))
    end_x = math.ceil(c + float(p.paddle_length * s) * np.cos(theta))
    canvas = Image.new("F", (big, big), 0.0)
    ImageDraw.Draw(canvas).line([(c, c), (end_x, end_y)], fill=255.0, width=round(p.paddle_thickness * s))
    line = np.asarray(canvas) > 0
    r = p.margin * s
    grown = np.zeros_like(line)
    for dy in range(-r, r + 1):
        for dx in range(-r, r + 1):
            if dy * dy + dx * dx <= r * r:
                grown[max(dy, 0) : big + min(dy, 0), max(dx, 0) : big + min(dx, 0)] |= line[
                    max(-dy, 0) : big + min(-dy, 0), max(-dx, 0) : big + min(-dx, 0)
                ]
    small = (2 * reach + 1,) * 2
    ink = np.asarray(Image.fromarray(line.astype(np.uint8) * 255).resize(small, LANCZOS))
    foot = np.asarray(Image.fromarray(grown.astype(np.uint8) * 255).resize(small, LANCZOS))
    return ink, foot


class _Tables:
    """Stamps, candidate moves and seeding rules for one ``Params``, computed once per process.

    Canvases are flat arrays of a square of side ``size + 2 * pad``; orientation ids 0..359 are the whole-degree
    seed headings (-180..179), ids from 360 on the distinct moves of a growth step (their paddles are drawn reversed).
    """

    def __init__(self, p: Params) -> None:
        n = p.size
        self.reach = reach = p.paddle_length + math.ceil(p.paddle_thickness) + p.margin
        self.pad = pad = reach
        self.side = side = n + 2 * pad
        self.area = side * side

        seed_theta = [d * np.pi / 180 for d in range(-180, 180)]
        # Growth moves: pixels on a circle of radius paddle_length + margin, one sample per pixel of arc.
        radius = p.paddle_length + p.margin
        arc = np.arange(0, 360, 360.0 / (2 * radius * np.pi)) * np.pi / 180
        moves = sorted(
            set(
                zip(
                    np.floor(radius * np.sin(arc)).astype(int).tolist(),
                    np.floor(radius * np.cos(arc)).astype(int).tolist(),
                )
            )
        )
        self.moves = np.array(moves, dtype=np.int64)
        move_theta = [float(np.arctan2(dy, dx)) for dy, dx in moves]
        theta = np.array(seed_theta + move_theta)
        self.theta = theta
        # Paddle drawn for each orientation id: seeds forward from the tail, moves backward from the new head.
        drawn = list(seed_theta) + [t + np.pi if t < 0 else t - np.pi for t in move_theta]
        stride = float(p.paddle_length + 2 * p.margin)
        self.stride = np.stack([stride * np.sin(theta), stride * np.cos(theta)], 1)
        back = [t + np.pi if t + np.pi < np.pi else t - np.pi for t in seed_theta]
        self.seed_head = np.stack(
            [float(p.paddle_length) * np.sin(seed_theta), float(p.paddle_length) * np.cos(seed_theta)], 1
        )
        self.seed_pivot = np.stack([float(radius) * np.sin(back), float(radius) * np.cos(back)], 1)

        # Continuity weight of each move after each orientation.
        turn = np.abs(theta[:, None] - np.array(move_theta)[None, :])
        turn = np.minimum(turn, 2 * np.pi - turn)
        self.bend = np.maximum(np.cos(np.minimum(turn * p.continuity, 0.5 * np.pi)), 0) ** 2

        ry, rx = np.mgrid[-reach : reach + 1, -reach : reach + 1]
        rel = (ry * side + rx).ravel()
        inks, foots = zip(*(_paddle_stamps(t, p) for t in drawn))
        inks, foots = np.stack(inks), np.stack(foots)

        def sparse(stamps: np.ndarray, keep, levels: bool = False) -> tuple[np.ndarray, ...]:
            sel = [np.flatnonzero(keep(st.ravel())) for st in stamps]
            width = max(len(s) for s in sel)
            off = np.zeros((len(stamps), width), dtype=np.int64)
            val = np.zeros((len(stamps), width), dtype=np.uint8 if levels else np.float64)
            dy = np.zeros((len(stamps), width), dtype=np.int64)
            dx = np.zeros((len(stamps), width), dtype=np.int64)
            for i, s in enumerate(sel):
                # Short lists are padded with their first pixel: a repeated index then writes one value.
                s = np.concatenate([s, np.repeat(s[:1], width - len(s))])
                off[i] = rel[s]
                val[i] = stamps[i].ravel()[s] if levels else stamps[i].ravel()[s].astype(np.float64) / 255
                dy[i] = ry.ravel()[s]
                dx[i] = rx.ravel()[s]
            return off, val, dy, dx

        # Masks hold the footprints' uint8 levels k; the reference keeps them as float32(k / 255), and its 1.8
        # collision test depends on that rounding for a few level pairs.
        self.value = np.float32(np.arange(256) / 255).astype(np.float64)
        self.ink = sparse(inks, lambda v: v > 0)
        self.foot = sparse(foots, lambda v: v > 0, levels=True)
        # Only footprint pixels of at least 0.8 can reach the 1.8 collision level over a mask of at most 1.
        off, lev = sparse(foots, lambda v: v >= 200, levels=True)[:2]
        self.hard = off, self.value[lev]
        # Mask levels above 0.3 (busy for seeding): ``ceil(value - 0.3) != 0``.
        self.busy = next(k for k in range(256) if math.ceil(k / 255 - 0.3) != 0)

        # Seeding kernels: the footprint of a seed paddle cut to (L + m) * 2 + 1 pixels with its start one pixel
        # past the kernel's anchor; pixels of full value count.
        k = 2 * radius + 1
        start = radius + 1
        kernels = []
        for st in foots[:360]:
            crop = st[reach - start : reach - start + k, reach - start : reach - start + k]
            ky, kx = np.nonzero(crop == 255)
            kernels.append(np.stack([ky - radius, kx - radius], 1))
        # A heading is usable when every image pixel keeps at least one kernel sample inside the image.
        yy, xx = np.mgrid[0:n, 0:n]
        self.valid = np.zeros(360, dtype=bool)
        for d, ker in enumerate(kernels):
            if len(ker) == 0:
                continue
            inside = np.zeros((n, n), dtype=bool)
            for oy, ox in ker:
                inside |= (yy + oy >= 0) & (yy + oy < n) & (xx + ox >= 0) & (xx + ox < n)
            self.valid[d] = inside.all()
        kmax = max(len(k) for k in kernels)
        self.kernel = np.zeros((360, kmax), dtype=np.int64)
        for d, ker in enumerate(kernels):
            if len(ker):
                flat = ker[:, 0] * side + ker[:, 1]
                self.kernel[d] = np.concatenate([flat, np.repeat(flat[:1], kmax - len(flat))])

        # Starting mask: the image border; the in-image pixels as flat canvas positions.
        base = np.zeros((side, side))
        base[pad : pad + p.padding, pad : pad + n] = 1.0
        base[pad + n - p.padding : pad + n, pad : pad + n] = 1.0
        base[pad : pad + n, pad : pad + p.padding] = 1.0
        base[pad : pad + n, pad + n - p.padding : pad + n] = 1.0
        self.blank = (base.ravel() * 255).astype(np.uint8)
        self.pixels = ((yy + pad) * side + xx + pad).ravel()

        # First target tail: free pixels of the border plus a band of 2 * seed_distance, dilated by the kernel.
        band = np.ones((n, n), dtype=bool)
        b = 2 * p.seed_distance
        band[b : n - b, b : n - b] = False
        band |= base[pad : pad + n, pad : pad + n] > 0.3
        self.first_tails: list[np.ndarray] = []
        for d, ker in enumerate(kernels):
            hit = np.zeros((n, n), dtype=bool)
            for oy, ox in ker:
                sy, sx = yy + oy, xx + ox
                ok = (sy >= 0) & (sy < n) & (sx >= 0) & (sx < n)
                hit[ok] |= band[sy[ok], sx[ok]]
            free = np.flatnonzero(~hit) if self.valid[d] else np.zeros(0, dtype=np.int64)
            self.first_tails.append(free)
        self.first_headings = np.array([d for d in range(360) if len(self.first_tails[d])], dtype=np.int64)
        self.cross = np.array([0, 1, -1, side, -side], dtype=np.int64)

    def flat(self, yx: np.ndarray) -> np.ndarray:
        return (yx[..., 0] + self.pad) * self.side + yx[..., 1] + self.pad


@functools.lru_cache(maxsize=4)
def _tables(p: Params) -> _Tables:
    return _Tables(p)


@functools.lru_cache(maxsize=4)
def _marker_images(p: Params) -> np.ndarray:
    """[size * size, size, size] uint8: the marker disc centred on each pixel, drawn at 2x and Lanczos-resized."""
    n, s = p.size, p.antialias
    yy, xx = np.mgrid[0 : n * s, 0 : n * s]
    out = np.zeros((n * n, n, n), dtype=np.uint8)
    for i in range(n * n):
        cy, cx = divmod(i, n)
        disc = ((yy - cy * s) ** 2 + (xx - cx * s) ** 2 <= (p.marker_radius * s) ** 2).astype(np.uint8) * 255
        out[i] = np.asarray(Image.fromarray(disc).resize((n, n), LANCZOS))
    return out


def _stamp_max(
    tb: _Tables,
    canvas: np.ndarray,
    rows: np.ndarray,
    where: np.ndarray,
    ids: np.ndarray,
    table: tuple,
    scale: float = 1.0,
) -> None:
    """Raise ``canvas`` (flat, rows of ``tb.area``) to the stamps ``ids`` at pixels ``where`` ([k, 2]) of ``rows``,
    dropping the parts outside the image."""
    off, val, dy, dx = table
    y = where[:, 0:1] + dy[ids]
    x = where[:, 1:2] + dx[ids]
    n = tb.side - 2 * tb.pad
    # Ink is held in float32 by the reference (uint8 / 255 times the contrast, then stored in a float32 image).
    v = val[ids] if canvas.dtype == np.uint8 else (val[ids] * scale).astype(np.float32)
    v = np.where((y >= 0) & (y < n) & (x >= 0) & (x < n), v, 0).astype(canvas.dtype, copy=False)
    idx = (rows * tb.area + tb.flat(where))[:, None] + off[ids]
    flat = canvas.reshape(-1)
    flat[idx] = np.maximum(flat[idx], v)


def _grow(
    tb: _Tables,
    p: Params,
    masks: np.ndarray,
    rows: np.ndarray,
    pivot: np.ndarray,
    orient: np.ndarray,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One growth step for walkers on canvases ``rows`` -> (placed, new pivot, new orientation id, new head)."""
    n = p.size
    k = len(rows)
    step = _ceil_shift(pivot, tb.stride[orient])
    cand = step[:, None, :] + tb.moves[None]
    inside = ((cand >= 0) & (cand < n)).all(-1)
    flat = masks.reshape(-1)
    at = (rows * tb.area)[:, None] + tb.flat(np.clip(cand, 0, n - 1))
    near = tb.value[flat[at[..., None] + tb.cross].max(-1)]
    weight = np.where(inside, (1 - near) * tb.bend[orient], 0.0)
    total = weight.sum(1)
    ok = total >= 1e-4
    cmf = np.cumsum(weight, 1) / np.where(ok, total, 1.0)[:, None]
    draws = rng.random((k, p.segment_trials))
    pick = np.minimum((cmf[:, None, :] <= draws[:, :, None]).sum(-1), len(tb.moves) - 1)
    ids = 360 + pick
    off, val = tb.hard
    heads = at[np.arange(k)[:, None], pick]
    level = (tb.value[flat[heads[..., None] + off[ids]]] + val[ids]).max(-1)
    free = level < 1.8
    placed = ok & free.any(1)
    first = free.argmax(1)
    chosen = pick[np.arange(k), first]
    return placed, step, 360 + chosen, cand[np.arange(k), chosen]


def _targets(tb: _Tables, p: Params, count: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``count`` completed target pairs (attempts run in parallel pools; failed pairs are discarded whole)."""
    n = p.size
    got: list[dict[str, np.ndarray]] = []
    have = 0
    while have < count:
        k = min(max(64, 40 * (count - have)), 2048)
        heading = tb.first_headings[rng.integers(0, len(tb.first_headings), k)]
        pick = (rng.random(k) * np.array([len(tb.first_tails[d]) for d in heading])).astype(np.int64)
        t1 = np.array([tb.first_tails[d][i] for d, i in zip(heading, pick)], dtype=np.int64)
        tail1 = np.stack([t1 // n, t1 % n], 1)
        heading2 = rng.integers(0, 360, k)
        angle = rng.integers(0, 360, k) * np.pi / 180
        tail2 = np.stack(
            [
                np.round(tail1[:, 0] + p.seed_distance * np.sin(angle)),
                np.round(tail1[:, 1] + p.seed_distance * np.cos(angle)),
            ],
            1,
        ).astype(np.int64)
        tails = np.stack([tail1, tail2], 1)
        orient = np.stack([heading, heading2], 1)
        heads = _ceil_shift(tails, tb.seed_head[orient])
        pivots = _ceil_shift(heads, tb.seed_pivot[orient])
        alive = ((heads >= 0) & (heads < n) & (pivots >= 0) & (pivots < n)).all((1, 2))
        masks = np.tile(tb.blank, (k, 1))
        segs = np.zeros((k, 2 * p.contour_length), dtype=np.int64)
        where = np.zeros((k, 2 * p.contour_length, 2), dtype=np.int64)
        segs[:, 0], segs[:, 1] = orient[:, 0], orient[:, 1]
        where[:, 0], where[:, 1] = tails[:, 0], tails[:, 1]
        pend_id = orient.copy()
        pend_at = tails.copy()
        ends = tails.copy()
        for step in range(p.contour_length - 1):
            for s in (0, 1):
                rows = np.flatnonzero(alive)
                if len(rows) == 0:
                    break
                placed, piv, new, head = _grow(tb, p, masks, rows, pivots[rows, s], orient[rows, s], rng)
                alive[rows[~placed]] = False
                r = rows[placed]
                _stamp_max(tb, masks, r, pend_at[r, s], pend_id[r, s], tb.foot)
                pivots[r, s], orient[r, s], ends[r, s] = piv[placed], new[placed], head[placed]
                pend_id[r, s], pend_at[r, s] = new[placed], head[placed]
                segs[r, 2 + 2 * step + s], where[r, 2 + 2 * step + s] = new[placed], head[placed]
        r = np.flatnonzero(alive)[: count - have]
        _stamp_max(tb, masks, r, pend_at[r, 1], pend_id[r, 1], tb.foot)
        got.append(dict(mask=masks[r], segs=segs[r], where=where[r], tails=tails[r], heads=ends[r]))
        have += len(r)
    return {key: np.concatenate([g[key] for g in got]) for key in got[0]}


def _distractors(tb: _Tables, p: Params, masks: np.ndarray, rng: np.random.Generator) -> list[tuple[np.ndarray, ...]]:
    """Add distractor snakes to every canvas in ``masks`` (updated in place) -> per placed snake
    (canvas rows, orientation ids [k, L], pixels [k, L, 2])."""
    n = p.size
    count = len(masks)
    placed_snakes = []
    for _ in range(p.num_distractors):
        done = np.zeros(count, dtype=bool)
        for _ in range(p.distractor_attempts):
            heading = rng.integers(0, 360, count)
            rows = np.flatnonzero(~done & tb.valid[heading])
            if len(rows) == 0:
                continue
            heading = heading[rows]
            busy = masks[rows][:, tb.pixels] >= tb.busy
            roomy = (~busy).sum(1) >= 0.01 * n * n
            hit = masks[rows[:, None, None], tb.pixels[None, None, :] + tb.kernel[heading][:, :, None]] >= tb.busy
            free = ~hit.any(1)
            have = free.sum(1)
            keep = roomy & (have > 0)
            rows, heading, free, have = rows[keep], heading[keep], free[keep], have[keep]
            if len(rows) == 0:
                continue
            nth = (rng.random(len(rows)) * have).astype(np.int64)
            idx = (np.cumsum(free, 1) <= nth[:, None]).sum(1)
            tail = np.stack([idx // n, idx % n], 1)
            head = _ceil_shift(tail, tb.seed_head[heading])
            pivot = _ceil_shift(head, tb.seed_pivot[heading])
            keep = ((head >= 0) & (head < n) & (pivot >= 0) & (pivot < n)).all(1)
            rows, heading, tail, pivot = rows[keep], heading[keep], tail[keep], pivot[keep]
            work = masks[rows].copy()
            local = np.arange(len(rows))
            segs = [heading]
            where = [tail]
            pend_id, pend_at, orient = heading, tail, heading
            alive = np.ones(len(rows), dtype=bool)
            for _ in range(p.distractor_length - 1):
                live = local[alive]
                ok, piv, new, hd = _grow(tb, p, work, live, pivot[live], orient[live], rng)
                alive[live[~ok]] = False
                w = live[ok]
                _stamp_max(tb, work, w, pend_at[w], pend_id[w], tb.foot)
                pivot, orient, pend_id, pend_at = pivot.copy(), orient.copy(), pend_id.copy(), pend_at.copy()
                pivot[w], orient[w], pend_id[w], pend_at[w] = piv[ok], new[ok], new[ok], hd[ok]
                segs.append(orient.copy())
                where.append(pend_at.copy())
            w = local[alive]
            _stamp_max(tb, work, w, pend_at[w], pend_id[w], tb.foot)
            masks[rows[w]] = work[w]
            done[rows[w]] = True
            placed_snakes.append((rows[w], np.stack(segs, 1)[w], np.stack(where, 1)[w]))
    return placed_snakes


def make_batch(
    labels: np.ndarray, rng: np.random.Generator, p: Params = Params(), distractors: bool = True
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Images for ``labels`` -> ([k, size, size] uint8, record).

    The record holds per image ``tails`` and ``heads`` ([k, 2, 2], pixel (y, x) of each target snake's ends),
    ``markers`` ([k, 2, 2], origin then terminal marker), ``origin`` (which target snake carries the origin marker),
    ``targets`` and ``distractors`` (float images of the target and distractor ink before scaling).
    """
    tb = _tables(p)
    n = p.size
    k = len(labels)
    made = _targets(tb, p, k, rng)
    rows = np.arange(k)
    tgt = np.zeros((k, tb.area))
    for j in range(2 * p.contour_length):
        _stamp_max(tb, tgt, rows, made["where"][:, j], made["segs"][:, j], tb.ink, p.target_contrast)
    dis = np.zeros((k, tb.area))
    if distractors:
        for r, segs, where in _distractors(tb, p, made["mask"], rng):
            for j in range(segs.shape[1]):
                _stamp_max(tb, dis, r, where[:, j], segs[:, j], tb.ink, p.distractor_contrast)
    origin = rng.integers(0, 2, k)
    terminal = np.where(np.asarray(labels) == 1, origin, 1 - origin)
    o = made["tails"][rows, origin]
    t = made["heads"][rows, terminal]
    marks = _marker_images(p)
    marker = np.maximum(marks[o[:, 0] * n + o[:, 1]], marks[t[:, 0] * n + t[:, 1]]).astype(np.float64) / 255
    crop = (slice(None), slice(tb.pad, tb.pad + n), slice(tb.pad, tb.pad + n))
    tgt = tgt.reshape(k, tb.side, tb.side)[crop]
    dis = dis.reshape(k, tb.side, tb.side)[crop]
    img = np.maximum(np.maximum(tgt, dis), marker)
    lo = img.min((1, 2), keepdims=True)
    span = img.max((1, 2), keepdims=True) - lo
    scaled = (img - lo) * (255.0 / np.where(span == 0, 1.0, span))
    out = (scaled.clip(0, 255) + 0.5).astype(np.uint8)
    record = dict(
        tails=made["tails"],
        heads=made["heads"],
        markers=np.stack([o, t], 1),
        origin=origin,
        targets=tgt,
        distractors=dis,
    )
    return out, record


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
    imgs, _ = make_batch(labels, rng, p)
    lines = []
    for i, label in enumerate(labels):
        Image.fromarray(imgs[i]).save(img_dir / f"sample_{i}.png")
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
