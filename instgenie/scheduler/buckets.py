"""Bucketed step graphs: which captured graph a masked step replays (ExecConfig.graph_capture
"buckets", engine/bucket_graphs.py, decision 0051).

A masked step's graph depends on its batch rows R and, for every token grid L of the backbone,
the packed masked-token count T(L) of all rows together (attention, projections and MLPs run on
those rows). A bucket fixes R exactly and T(L) to a capacity: the graph is captured for the
capacity at start and a step with fewer tokens pads up to it (padded rows compute a copy of a
real token and are scattered to a trash row, engine/masked/context.py), so it replays a graph
captured ahead of time instead of capturing one of its own composition.

Capacities: rung k of a geometric ladder of token ratios, rho_k = BASE * STEP**k, holds
ceil(rho_k * R * L) tokens on every grid L. A step takes the lowest rung that holds its count on
every grid (ratios of coarse grids are larger: a mask max-pooled to fewer tokens covers more of
them). STEP = 1.25 pads a step by at most 25 % of its packed tokens, about 11 % on average. A
step whose ratio on some grid exceeds the top rung (MAX_RATIO) is not bucketed: it runs eagerly.

Pure Python: the batcher, the router and tests import it without torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

#: the lowest rung's token ratio, the ratio between rungs, and the highest ratio a rung must reach
BASE = 0.04
STEP = 1.25
MAX_RATIO = 0.5
#: requests per batch that get buckets at start (decision 0011: graphs gain 1.6x at batch 1 and
#: nothing measurable at 4-8, where a step is compute-bound); larger batches run eagerly
MAX_REQUESTS = 4


def ladder(
    base: float = BASE, step: float = STEP, max_ratio: float = MAX_RATIO
) -> tuple[float, ...]:
    """Token ratios of the rungs, ascending; the last is the first >= max_ratio (at most 1.0)."""
    if not (0 < base <= 1 and step > 1 and 0 < max_ratio <= 1):
        raise ValueError(f"bad ladder: base {base}, step {step}, max_ratio {max_ratio}")
    rungs = [base]
    while rungs[-1] < max_ratio:
        rungs.append(min(1.0, rungs[-1] * step))
    return tuple(rungs)


RUNGS = ladder()


@dataclass(frozen=True)
class Bucket:
    """R batch rows, rung `rung` of `rungs`: capacity(L) packed tokens on an L-token grid."""

    rows: int
    rung: int
    rungs: tuple[float, ...] = RUNGS

    def __post_init__(self) -> None:
        if self.rows < 1 or not 0 <= self.rung < len(self.rungs):
            raise ValueError(f"Bucket: rows {self.rows}, rung {self.rung} of {len(self.rungs)}")

    @property
    def ratio(self) -> float:
        return self.rungs[self.rung]

    def capacity(self, L: int) -> int:
        """Packed tokens on an L-token grid (1 <= capacity <= rows * L); tokens."""
        return max(1, min(self.rows * L, math.ceil(self.ratio * self.rows * L - 1e-9)))

    def holds(self, counts: Mapping[int, int]) -> bool:
        return all(n <= self.capacity(L) for L, n in counts.items())


def pick(
    rows: int, counts: Mapping[int, int], min_rung: int = 0, rungs: tuple[float, ...] = RUNGS
) -> Bucket | None:
    """The lowest bucket of `rows` rows at rung >= min_rung that holds `counts` ({L: packed
    tokens of all rows}); None when no rung does (the step runs eagerly). Counts must lie in
    [0, rows * L]."""
    for L, n in counts.items():
        if L < 1 or not 0 <= n <= rows * L:
            raise ValueError(f"{n} packed tokens on a {L}-token grid of {rows} rows")
    for k in range(max(0, min_rung), len(rungs)):
        b = Bucket(rows, k, rungs)
        if b.holds(counts):
            return b
    return None


def pads(counts: list[int], capacity: int, L: int) -> list[int]:
    """Pad tokens each row takes so that rows of `counts` tokens (of L each) hold `capacity` in
    all: rows in order, each up to L (so a row's queries stay within its own L keys and
    max_q = L bounds every composition of a bucket). The executor pads its token sets this way
    (engine/masked/token_sets.py) and pricing counts the same pads (scheduler/pricing.py)."""
    spare = capacity - sum(counts)
    if spare < 0 or capacity > len(counts) * L:
        raise ValueError(f"{sum(counts)} tokens of {len(counts)} rows of {L} do not pad to "
                         f"{capacity}")  # fmt: skip
    out = []
    for n in counts:
        out.append(min(spare, L - n))
        spare -= out[-1]
    return out
