"""What the load tester sends: arrival offsets, mask ratios, masks and template images.

Everything is drawn from one seeded numpy Generator, so a (seed, arguments) pair is one exact
workload: two servers (or two policies of one) can be compared on the same arrivals and masks.

Mask-ratio distributions (`parse_mask_ratios`):
  fixed:R          every mask covers R of the image
  uniform:A,B      R ~ U(A, B)
  beta:MEAN,K      R ~ Beta(MEAN*K, (1-MEAN)*K): mean MEAN, concentration K (small K: wide)
  hist:FILE.json   {"bin_edges": [e0, ..., en], "weights": [w1, ..., wn]}: a bin by weight,
                   then uniform inside it (traces/ holds examples)
Ratios are clipped to [one grid cell, 1]: a mask is a rectangle on a GRID_PX grid, so the
ratio the server reports is the drawn one rounded to whole cells.

Arrival traces (`read_trace`): CSV with a header; `at_s` (seconds from the start,
non-decreasing) is required, `mask_ratio` (0 < r <= 1) and `template` (an index >= 0) optional.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

#: px: masks are rectangles of whole GRID_PX cells — SDXL/SD2's coarsest transformer grid
#: (latent /8, then /4), a multiple of Flux's 16 px tokens — so pixel and token ratios agree
GRID_PX = 32


class WorkloadError(ValueError):
    """A mask-ratio spec, trace file or size that cannot describe a workload (usage error)."""


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float  # offset from the phase's start, seconds (non-decreasing within a phase)
    mask_ratio: float  # requested fraction of the image to edit, (0, 1]
    template: int  # index into the phase's templates, >= 0
    seed: int  # the edit's seed


class MaskRatios:
    """A distribution of mask ratios; `sample` returns values in (0, 1]."""

    def __init__(self, spec: str, mean: float, draw) -> None:
        self.spec = spec
        self.mean = mean  # of the distribution before clipping to whole grid cells
        self._draw = draw  # (rng, n) -> np.ndarray of n ratios

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(self._draw(rng, n), 1e-6, 1.0)


def _numbers(spec: str, body: str, count: int) -> list[float]:
    try:
        values = [float(v) for v in body.split(",")]
    except ValueError:
        raise WorkloadError(f"mask ratios {spec!r}: {body!r} are not numbers") from None
    if len(values) != count or not all(math.isfinite(v) for v in values):
        raise WorkloadError(f"mask ratios {spec!r}: expected {count} finite number(s)")
    return values


def parse_mask_ratios(spec: str) -> MaskRatios:
    kind, _, body = spec.partition(":")
    if kind == "fixed":
        (r,) = _numbers(spec, body, 1)
        if not 0 < r <= 1:
            raise WorkloadError(f"mask ratios {spec!r}: need 0 < R <= 1")
        return MaskRatios(spec, r, lambda rng, n: np.full(n, r))
    if kind == "uniform":
        a, b = _numbers(spec, body, 2)
        if not 0 < a <= b <= 1:
            raise WorkloadError(f"mask ratios {spec!r}: need 0 < A <= B <= 1")
        return MaskRatios(spec, (a + b) / 2, lambda rng, n: rng.uniform(a, b, n))
    if kind == "beta":
        mean, k = _numbers(spec, body, 2)
        if not (0 < mean < 1 and k > 0):
            raise WorkloadError(f"mask ratios {spec!r}: need 0 < MEAN < 1 and K > 0")
        return MaskRatios(spec, mean, lambda rng, n: rng.beta(mean * k, (1 - mean) * k, n))
    if kind == "hist":
        return _histogram(spec, Path(body))
    raise WorkloadError(
        f"mask ratios {spec!r}: expected fixed:R, uniform:A,B, beta:MEAN,K or hist:FILE.json"
    )


def _histogram(spec: str, path: Path) -> MaskRatios:
    try:
        data = json.loads(path.read_text())
        edges = np.asarray(data["bin_edges"], dtype=np.float64)
        weights = np.asarray(data["weights"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WorkloadError(f"mask ratios {spec!r}: cannot read a histogram: {exc}") from None
    ok = (
        edges.ndim == 1
        and weights.shape == (len(edges) - 1,)
        and len(weights) >= 1
        and np.all(np.isfinite(edges))
        and np.all(np.diff(edges) > 0)
        and edges[0] >= 0
        and edges[-1] <= 1
        and np.all(weights >= 0)
        and weights.sum() > 0
    )
    if not ok:
        raise WorkloadError(
            f"mask ratios {spec!r}: need increasing bin_edges in [0, 1] and one weight >= 0 "
            "per bin, not all zero"
        )
    p = weights / weights.sum()
    mean = float(np.sum(p * (edges[:-1] + edges[1:]) / 2))

    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        b = rng.choice(len(p), size=n, p=p)
        return rng.uniform(edges[b], edges[b + 1])

    return MaskRatios(spec, mean, draw)


def poisson_offsets(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n arrival offsets (s) of a Poisson process at `rate` per second: exponential gaps."""
    return np.cumsum(rng.exponential(1.0 / rate, n))


def constant_offsets(rate: float, n: int) -> np.ndarray:
    """n evenly spaced offsets (s), the first at 1/rate."""
    return np.arange(1, n + 1) / rate


def make_arrivals(
    offsets: np.ndarray,
    ratios: MaskRatios,
    num_templates: int,
    rng: np.random.Generator,
    first_seed: int = 0,
) -> list[Arrival]:
    """One Arrival per offset: ratio from `ratios`, template uniformly among num_templates."""
    r = ratios.sample(rng, len(offsets))
    t = rng.integers(num_templates, size=len(offsets))
    return [
        Arrival(float(offsets[i]), float(r[i]), int(t[i]), first_seed + i)
        for i in range(len(offsets))
    ]


def read_trace(
    path: Path, ratios: MaskRatios, num_templates: int, rng: np.random.Generator
) -> list[Arrival]:
    """Arrivals from a CSV trace; missing ratios come from `ratios`, missing templates are
    drawn uniformly, template indices wrap around num_templates."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(f"trace {path}: {exc}") from None
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows or "at_s" not in rows[0]:
        raise WorkloadError(f"trace {path}: need a header with at_s and at least one row")
    drawn = ratios.sample(rng, len(rows))
    out, last = [], 0.0
    for i, row in enumerate(rows):
        line = i + 2  # the header is line 1
        try:
            at = float(row["at_s"])
            ratio = float(row["mask_ratio"]) if row.get("mask_ratio") else float(drawn[i])
            tpl = int(row["template"]) if row.get("template") else int(rng.integers(num_templates))
        except (TypeError, ValueError):
            raise WorkloadError(f"trace {path} line {line}: not a number: {row}") from None
        if not (math.isfinite(at) and at >= last):
            raise WorkloadError(f"trace {path} line {line}: at_s must be >= {last:g}, got {at}")
        if not 0 < ratio <= 1:
            raise WorkloadError(f"trace {path} line {line}: mask_ratio must be in (0, 1]")
        if tpl < 0:
            raise WorkloadError(f"trace {path} line {line}: template must be >= 0")
        out.append(Arrival(at, ratio, tpl % num_templates, i))
        last = at
    return out


def check_size(size: int) -> None:
    if size < GRID_PX or size % GRID_PX:
        raise WorkloadError(f"--size {size}: must be a positive multiple of {GRID_PX} pixels")


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def rect_mask(
    width: int, height: int, ratio: float, rng: np.random.Generator
) -> tuple[bytes, float]:
    """(PNG, achieved ratio): a white (= edit) rectangle of whole GRID_PX cells covering about
    `ratio` of the cells (at least one), aspect 0.6-1.6 where it fits, at a random place.
    The ratio is of the whole GRID_PX cells; an image side that is not a multiple of GRID_PX
    leaves a strip that is never masked."""
    gw, gh = width // GRID_PX, height // GRID_PX
    if gw < 1 or gh < 1:
        raise WorkloadError(f"a {width}x{height} image is smaller than one {GRID_PX} px cell")
    cells = max(1, round(ratio * gw * gh))
    w = int(np.clip(round(math.sqrt(cells) * rng.uniform(0.6, 1.6)), 1, gw))
    h = int(np.clip(round(cells / w), 1, gh))
    w = int(np.clip(round(cells / h), 1, gw))  # a short side clipped by gh gives width back
    x0, y0 = int(rng.integers(0, gw - w + 1)), int(rng.integers(0, gh - h + 1))
    m = Image.new("L", (width, height), 0)
    box = [x0 * GRID_PX, y0 * GRID_PX, (x0 + w) * GRID_PX - 1, (y0 + h) * GRID_PX - 1]
    ImageDraw.Draw(m).rectangle(box, fill=255)
    return _png(m), w * h / (gw * gh)


def template_image(size: int, seed: int, height: int | None = None) -> bytes:
    """A structured, seed-specific RGB PNG (gradients, a sine pattern, noise), `size` wide and
    `height` (default `size`) high: a stand-in template; distinct seeds give distinct bytes,
    so distinct template ids."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0 : height or size, 0:size] / size
    arr = np.stack([x, y, 0.5 + 0.5 * np.sin((6 + seed) * (x + y))], -1) * 200
    arr += rng.normal(0, 10, arr.shape)
    return _png(Image.fromarray(arr.clip(0, 255).astype("uint8"), "RGB"))
