"""Inpainting masks for a rendered scene (render.py's label map): the garment's shape grown by
a margin, a rectangle around it, or brush strokes over the figure, each with its area between
`lo` and `hi` of the image. A mask is a (size, size) bool array (True: edit).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from instgenie.dataset.render import GARMENT

KINDS = ("garment", "rect", "brush")
#: mask area bounds, fraction of the image (the issue's 0.05-0.5)
LO, HI = 0.05, 0.5


class MaskError(ValueError):
    """No mask of that kind fits the area bounds on this scene."""


def make(kind: str, labels: np.ndarray, rng: np.random.Generator, lo: float = LO,
         hi: float = HI) -> np.ndarray:  # fmt: skip
    """A mask of `kind` (KINDS) for the scene whose label map is `labels`."""
    if kind not in KINDS:
        raise ValueError(f"mask kind {kind!r}; known: {KINDS}")
    garment = labels == GARMENT
    if not garment.any():
        raise MaskError("the scene has no garment")
    make_one = {"garment": _grown, "rect": _rect, "brush": _brush}[kind]
    mask = make_one(garment, rng, lo, hi)
    ratio = float(mask.mean())
    if not lo <= ratio <= hi:
        raise MaskError(f"{kind} mask covers {ratio:.3f} of the image, not {lo}-{hi}")
    return mask


def _grown(garment: np.ndarray, rng: np.random.Generator, lo: float, hi: float) -> np.ndarray:
    """The garment's shape dilated by a margin of 1-4 % of the side, more while it is under `lo`."""
    n = garment.shape[0]
    img = Image.fromarray(garment.astype(np.uint8) * 255)
    margin = int(rng.uniform(0.01, 0.04) * n)
    while True:
        k = 2 * margin + 1
        mask = np.asarray(img.filter(ImageFilter.MaxFilter(k)) if margin else img) > 127
        if mask.mean() >= lo or margin > n // 4:
            return mask
        margin += max(1, n // 64)


def _bbox(m: np.ndarray) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero(m)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def _rect(garment: np.ndarray, rng: np.random.Generator, lo: float, hi: float) -> np.ndarray:
    """A rectangle holding the garment, grown on each side so its area is a draw in [lo, hi]."""
    n = garment.shape[0]
    x0, y0, x1, y1 = _bbox(garment)
    target = rng.uniform(max(lo, (x1 - x0) * (y1 - y0) / n / n), hi) * n * n
    step = max(1, n // 128)  # pixels a side grows by at a time
    while (x1 - x0) * (y1 - y0) < target and (x0 > 0 or y0 > 0 or x1 < n or y1 < n):
        side = int(rng.integers(4))
        if side == 0:
            x0 = max(0, x0 - step)
        elif side == 1:
            y0 = max(0, y0 - step)
        elif side == 2:
            x1 = min(n, x1 + step)
        else:
            y1 = min(n, y1 + step)
    mask = np.zeros((n, n), bool)
    mask[y0:y1, x0:x1] = True
    return mask


def _brush(garment: np.ndarray, rng: np.random.Generator, lo: float, hi: float) -> np.ndarray:
    """Thick random strokes starting on the garment, added until the area reaches a draw in
    [lo, hi] (the last stroke may pass it; make() checks the bound)."""
    n = garment.shape[0]
    target = rng.uniform(lo, (lo + hi) / 2)
    img = Image.new("L", (n, n), 0)
    d = ImageDraw.Draw(img)
    ys, xs = np.nonzero(garment)
    for _ in range(64):
        i = int(rng.integers(len(xs)))
        x, y = float(xs[i]), float(ys[i])
        width = int(rng.uniform(0.04, 0.09) * n)
        points = [(x, y)]
        for _ in range(int(rng.integers(3, 7))):
            a = rng.uniform(0, 2 * math.pi)
            step = rng.uniform(0.05, 0.15) * n
            x = min(n - 1.0, max(0.0, x + step * math.cos(a)))
            y = min(n - 1.0, max(0.0, y + step * math.sin(a)))
            points.append((x, y))
        d.line(points, fill=255, width=width, joint="curve")
        for px, py in points:
            d.ellipse([px - width / 2, py - width / 2, px + width / 2, py + width / 2], fill=255)
        mask = np.asarray(img) > 127
        if mask.mean() >= target:
            break
    return mask
