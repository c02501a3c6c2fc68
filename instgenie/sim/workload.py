"""What the simulated clients send: arrival times, templates and mask token ratios.

Arrivals come from a Poisson process at a rate, a trace CSV (traces/bursty_arrivals.csv: its
`at_s`, and its `template` indices where given), or a burst (all at once: saturation). Mask ratios
follow the load tester's distributions (loadtest/workload.py: `hist:traces/mask_ratios_*.json`,
`beta:`, `uniform:`, `fixed:`), and a mask is, as the load tester sends it, a rectangle of whole
GRID_PX cells (its `rect_mask` shape arithmetic), so its token ratio on every grid of stride
dividing GRID_PX is its cell ratio (what the server's estimate.token_ratios measures). Templates
are drawn by the catalogue's popularity. One seeded Generator: a seed is one exact workload.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from instgenie.loadtest.workload import GRID_PX, parse_mask_ratios, read_trace
from instgenie.sim.catalogue import Catalogue


@dataclass(frozen=True, slots=True)
class Arrival:
    """One edit as it reaches the server."""

    at_ms: float  # time from the start, ms
    template: int | None  # index into the catalogue; None: an edit of no template (full path)
    mask_ratio: float  # fraction of the image's whole GRID_PX cells it edits
    #: (token stride, fraction of that grid it computes), as RouteRequest.token_ratios
    token_ratios: tuple[tuple[int, float], ...]


def cell_ratio(ratio: float, width: int, height: int, rng: np.random.Generator) -> float:
    """The ratio of the rectangle loadtest.workload.rect_mask draws for `ratio` (whole cells,
    aspect 0.6-1.6 where it fits)."""
    gw, gh = width // GRID_PX, height // GRID_PX
    cells = max(1, round(ratio * gw * gh))
    w = int(np.clip(round(math.sqrt(cells) * rng.uniform(0.6, 1.6)), 1, gw))
    h = int(np.clip(round(cells / w), 1, gh))
    w = int(np.clip(round(cells / h), 1, gw))
    return w * h / (gw * gh)


def offsets_ms(
    rng: np.random.Generator, rate: float | None = None, n: int = 0, trace: Path | None = None,
    burst: bool = False,
) -> tuple[np.ndarray, list[int] | None]:  # fmt: skip
    """(arrival times in ms, the trace's template indices or None): `n` Poisson arrivals at
    `rate` per second, `n` at time 0 (`burst`), or the trace's rows (n = 0: all of them)."""
    if trace is not None:
        rows = read_trace(trace, parse_mask_ratios("fixed:1"), 1 << 30, rng)
        rows = rows[:n] if n else rows
        with open(trace) as f:  # without a template column: drawn by popularity
            named = "template" in f.readline().strip().split(",")
        return np.array([1e3 * a.at_s for a in rows]), [a.template for a in rows] if named else None
    if burst:
        return np.zeros(n), None
    assert rate is not None and rate > 0
    return 1e3 * np.cumsum(rng.exponential(1.0 / rate, n)), None


def make_arrivals(
    catalogue: Catalogue,
    times_ms: Sequence[float],
    mask_ratios: str,
    width: int,
    height: int,
    strides: Sequence[int],
    rng: np.random.Generator,
    templates: Sequence[int] | None = None,
) -> list[Arrival]:
    """One Arrival per time: a template by popularity (or `templates`, wrapped around the
    catalogue), a mask ratio from `mask_ratios` rounded to whole cells."""
    n = len(times_ms)
    drawn = parse_mask_ratios(mask_ratios).sample(rng, n)
    tpl = catalogue.sample(rng, n) if templates is None else [t % len(catalogue.ids)
                                                              for t in templates]  # fmt: skip
    out = []
    for i in range(n):
        r = cell_ratio(float(drawn[i]), width, height, rng)
        ratios = tuple((s, r) for s in sorted(strides))
        out.append(Arrival(float(times_ms[i]), int(tpl[i]), r, ratios))
    return out
