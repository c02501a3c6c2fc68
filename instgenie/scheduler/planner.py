"""Per-step load planner: which blocks read their cached activations (InstGenIE §4.2).

Each denoising step runs the backbone's N transformer blocks in order. Per block the engine either

- **uses the cache**: computes only the masked tokens, after the block's cached activations (the
  unmasked rows) have been copied host -> GPU on a separate copy stream; or
- **computes all**: computes every token; nothing is loaded.

Pipeline model (what `simulate` implements; every duration and clock is in milliseconds)
----------------------------------------------------------------------------------------
Inputs: per-block costs ``compute_cached[i]``, ``compute_full[i]``, ``load[i]`` (finite, >= 0),
``load_start`` >= 0 (when the copy stream becomes free, e.g. the tail of the previous step's
loads; 0 = free when this step's compute starts) and a plan ``use_cache[i]`` (one bool per block).
Two clocks, both measured from the start of the step's compute::

    load_end = load_start        # copy stream: when the last issued load has finished
    comp_end = 0                 # compute stream: when the last block has finished
    for i in 0..N-1:
        if use_cache[i]:
            load_end = load_end + load[i]                       # one FIFO stream, block order
            comp_end = max(comp_end, load_end) + compute_cached[i]
        else:
            comp_end = comp_end + compute_full[i]               # no load
    latency = comp_end

Loads are issued as early as possible, in block order; a cached block starts once its own load
and the previous block's compute have both finished. A block that computes all neither waits for
nor occupies the copy stream.

Optimisers
----------
`greedy_plan` is the paper's Algorithm 1 with per-block constants: block by block, use the cache
iff that does not finish the block later than computing all (ties -> cache). With costs that
differ by block it is not optimal: a load that wins a little now delays the copy stream for a
later block that would have gained more (tests/scheduler/test_planner.py builds such a case),
and on copy-bound SDXL steps it is often 10-30 % slower than the optimum.

`optimal_plan` is a DP over blocks whose state is the pair of clocks (comp_end, load_end). Both
transitions are monotone non-decreasing in both clocks (in floating point too), so a state that
is <= another in both clocks finishes no later under every continuation: the DP keeps the Pareto
front of undominated states (sorted by comp_end ascending, load_end strictly descending), each
with its decisions as a bit mask. Exact reductions on top:

- *settled* states: once ``load_end + (sum of all remaining loads) <= comp_end`` no later load can
  stall the compute stream whatever the plan; the load clock is replaced by -inf
  (``-inf + x = -inf``, ``max(c, -inf) = c``) and the state dominates every state with a larger
  comp_end;
- *stalls*: parents whose cached child waits for its load form a prefix of the front, and only
  the last of those children can be undominated, so only it is generated;
- *bound*: a state whose ``comp_end + sum(min(compute_cached, compute_full))`` over the remaining
  blocks exceeds an achievable latency (the best of Algorithm 1 and the two fixed plans) is
  dropped.

The float tests carry relative margins of 1e-9 that cover the rounding of the sums, so the DP's
clock is bit-equal to `simulate` of its plan and, with no cap, equal to the minimum of `simulate`
over all 2^N plans (tests: brute force).

Front size, cap, and why
------------------------
The problem contains a knapsack (which blocks to load: each saves ``compute_full - compute_cached``
of compute and costs ``load`` of copy time), so the exact front can grow large. With costs equal
for blocks of the same class (what per-class latency fits give), the exact DP is fast: on
realistic SDXL (N = 70) and Flux (N = 57) steps the front peaked at ~25 states and the DP took
0.2-0.4 ms median, < 1.5 ms at worst (one laptop-class core). With per-block costs jittered by
1-5 % (e.g. per-block fits), copy-bound SDXL steps reach fronts of 2000+ states and 100+ ms.
`optimal_plan(costs, front_cap=K)` bounds the work: when the front after a block holds more than
K states it is (1) thinned, dropping each state whose load clock is within eps of the previous
kept state's (that one has a smaller comp_end and is at most eps worse: a state's best latency
grows by exactly t when both its clocks do), eps = `THIN_FRACTION` * mean(compute_full); then
(2) truncated to the K states with the smallest comp_end (of the rules tried, smallest lower
bound and even spacing included, the one with the least regret). The result is then compared
with the greedy plan and the two fixed plans, so it is never worse than Algorithm 1.
`Plan.exact` is True when the cap never dropped a state (the plan is then optimal). `plan_step`
uses K = `PLAN_STEP_FRONT_CAP`: ~0.2 ms median on a realistic mix of steps, up to ~1 ms on
copy-bound SDXL steps with jittered costs; optimal on every class-structured instance tried; on
jittered ones 0.02-0.14 % worse than the optimum on average, 1.1 % at worst.

Where the costs come from is not this module's concern: `pricing.step_costs` gives them for a
batch (``compute_cached[i]`` the batch's masked compute, ``load[i]`` the copies of its cached rows
host -> GPU, ``compute_full[i]`` its compute without cache; each from a fitted `fits.LinearFit`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PLAN_STEP_FRONT_CAP",
    "THIN_FRACTION",
    "BlockCosts",
    "Plan",
    "greedy_plan",
    "optimal_plan",
    "plan_step",
    "simulate",
]

#: front cap used by `plan_step` (see the module docstring: "Front size, cap, and why")
PLAN_STEP_FRONT_CAP = 16
#: thinning distance of the cap, as a fraction of the mean `compute_full` of a block
THIN_FRACTION = 0.01

_NEG_INF = -math.inf
#: relative margin of the "settled" test: covers the rounding of up to ~1e6 float sums
_SETTLE_MARGIN = 1.0 + 1e-9
#: the same for the lower bound of the pruning (a bound is lowered by it before comparing)
_BOUND_MARGIN = 1.0 - 1e-9


def _cost_tuple(name: str, values: Sequence[float]) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)):
        raise ValueError(f"BlockCosts.{name}: expected a sequence of floats, got {type(values)}")
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"BlockCosts.{name}: expected a sequence of floats ({e})") from None
    for i, v in enumerate(out):
        if not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"BlockCosts.{name}[{i}] = {v!r}: must be finite and >= 0 (ms)")
    if not math.isfinite(sum(out)):
        raise ValueError(f"BlockCosts.{name}: the sum overflows (values too large)")
    return out


@dataclass(frozen=True)
class BlockCosts:
    """Per-block costs of one step (already aggregated over the batch), in milliseconds.

    Invariants (checked): the three tuples have the same length N >= 0; every entry and
    `load_start` are finite and >= 0; the sums are finite.
    """

    #: latency of block i computing only the masked tokens (cache used)
    compute_cached: tuple[float, ...]
    #: latency of block i computing every token (no cache)
    compute_full: tuple[float, ...]
    #: latency of copying block i's cached rows host -> GPU (copy stream)
    load: tuple[float, ...]
    #: when the copy stream becomes free, relative to the start of the step's compute
    load_start: float = 0.0

    def __post_init__(self) -> None:
        cached = _cost_tuple("compute_cached", self.compute_cached)
        full = _cost_tuple("compute_full", self.compute_full)
        load = _cost_tuple("load", self.load)
        if not (len(cached) == len(full) == len(load)):
            raise ValueError(
                f"BlockCosts: lengths differ: compute_cached has {len(cached)} blocks, "
                f"compute_full {len(full)}, load {len(load)}"
            )
        try:
            start = float(self.load_start)
        except (TypeError, ValueError):
            raise ValueError(
                f"BlockCosts.load_start = {self.load_start!r}: expected a float (ms)"
            ) from None
        if not (math.isfinite(start) and start >= 0.0):
            raise ValueError(f"BlockCosts.load_start = {start!r}: must be finite and >= 0 (ms)")
        object.__setattr__(self, "compute_cached", cached)
        object.__setattr__(self, "compute_full", full)
        object.__setattr__(self, "load", load)
        object.__setattr__(self, "load_start", start)

    @classmethod
    def from_kinds(
        cls, kinds: Sequence[tuple[float, float, float]], seq: Sequence[int]
    ) -> BlockCosts:
        """Costs of blocks that share a few kinds: block i costs kinds[seq[i]] = (compute_cached,
        compute_full, load), load_start 0. The same invariants, checked once per kind (not per
        block: the router prices many batches per decision)."""
        checked = [_cost_tuple(f"kinds[{k}]", c) for k, c in enumerate(kinds)]
        if any(len(c) != 3 for c in checked):
            raise ValueError("BlockCosts.from_kinds: each kind has 3 costs (cached, full, load)")
        out = object.__new__(cls)
        for j, name in enumerate(("compute_cached", "compute_full", "load")):
            col = tuple(checked[k][j] for k in seq)
            if not math.isfinite(sum(col)):
                raise ValueError(f"BlockCosts.{name}: the sum overflows (values too large)")
            object.__setattr__(out, name, col)
        object.__setattr__(out, "load_start", 0.0)
        return out

    @property
    def num_blocks(self) -> int:
        return len(self.load)


@dataclass(frozen=True)
class Plan:
    """A step's plan and, for observability, the latencies of the two fixed plans (ms)."""

    #: per block: True = compute masked tokens from the cache (load first), False = compute all
    use_cache: tuple[bool, ...]
    #: `simulate(use_cache, costs)`
    latency_ms: float
    #: latency of the all-cache plan (the paper's "strawman": load every block)
    all_cache_ms: float
    #: latency of the all-full plan (no cache at all)
    all_full_ms: float
    #: True: proven optimal under the pipeline model (`optimal_plan` without a cap dropping a
    #: state); False: no such proof (greedy, or the cap dropped states)
    exact: bool = False
    #: largest front `optimal_plan` held after its exact reductions, before any cap (0: greedy)
    max_front: int = 0

    @property
    def compute_all(self) -> frozenset[int]:
        """Block indices that compute every token (the executor's `compute_all`)."""
        return frozenset(i for i, u in enumerate(self.use_cache) if not u)

    @property
    def num_cached(self) -> int:
        return sum(self.use_cache)


def _check_plan(plan: Sequence[bool], costs: BlockCosts) -> tuple[bool, ...]:
    if isinstance(plan, (str, bytes)):
        raise ValueError(f"plan: expected a sequence of bools, got {type(plan)}")
    if len(plan) != costs.num_blocks:
        raise ValueError(f"plan has {len(plan)} entries but costs have {costs.num_blocks} blocks")
    out = []
    for i, u in enumerate(plan):
        try:
            ok = not isinstance(u, (str, bytes)) and u in (0, 1)  # bool, 0/1, numpy bool
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"plan[{i}] = {u!r}: must be a bool")
        out.append(bool(u))
    return tuple(out)


def simulate(plan: Sequence[bool], costs: BlockCosts) -> float:
    """Latency (ms) of `plan` (one bool per block, True = use the cache) under the pipeline model
    of the module docstring."""
    return _latency(_check_plan(plan, costs), costs)


def _latency(use: tuple[bool, ...], costs: BlockCosts) -> float:
    """`simulate` for a checked plan."""
    load_end = costs.load_start  # copy stream clock
    comp_end = 0.0  # compute stream clock
    for u, c_cached, c_full, ld in zip(
        use, costs.compute_cached, costs.compute_full, costs.load, strict=True
    ):
        if u:
            load_end = load_end + ld
            comp_end = max(comp_end, load_end) + c_cached
        else:
            comp_end = comp_end + c_full
    return comp_end


def _greedy(costs: BlockCosts) -> tuple[tuple[bool, ...], float]:
    load = costs.load_start
    comp = 0.0
    use: list[bool] = []
    for c_cached, c_full, ld in zip(
        costs.compute_cached, costs.compute_full, costs.load, strict=True
    ):
        cached_end = max(load + ld, comp) + c_cached
        if cached_end <= comp + c_full:
            load = load + ld
            comp = cached_end
            use.append(True)
        else:
            comp = comp + c_full
            use.append(False)
    return tuple(use), comp


def greedy_plan(costs: BlockCosts) -> Plan:
    """The paper's Algorithm 1 with per-block constants (not optimal in general): block i uses
    the cache iff ``max(load + L[i], comp) + C_w[i] <= comp + C_wo[i]``."""
    use, latency = _greedy(costs)
    n = costs.num_blocks
    return Plan(use, latency, _latency((True,) * n, costs), _latency((False,) * n, costs))


def optimal_plan(costs: BlockCosts, *, front_cap: int | None = None) -> Plan:
    """The plan of minimum `simulate` latency: exact with ``front_cap=None``; with a cap, the
    bounded search of the module docstring (``Plan.exact`` says whether it is proven optimal).

    Ties: among states with equal clocks the one whose latest differing decision uses the cache
    is kept; among final states of equal latency, the one with the smaller load clock; the DP's
    plan wins over the incumbents (greedy, all-cache, all-full) at equal latency.
    """
    if front_cap is not None and (
        isinstance(front_cap, bool) or not isinstance(front_cap, int) or front_cap < 1
    ):
        raise ValueError(f"front_cap = {front_cap!r}: must be an int >= 1 or None")
    cached, full, load = costs.compute_cached, costs.compute_full, costs.load
    n = costs.num_blocks
    # rest_load[i] = sum(load[i:]): the most the copy stream can still be asked to carry from
    # block i on (float suffix sums; the settle test's margin covers their rounding)
    rest_load = [0.0] * (n + 1)
    # rest_min[i] = sum(min(compute_cached[j], compute_full[j]) for j >= i): no completion from
    # block i on takes less compute (the lower bound of the pruning below)
    rest_min = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        rest_load[i] = rest_load[i + 1] + load[i]
        c_min = cached[i] if cached[i] < full[i] else full[i]
        rest_min[i] = rest_min[i + 1] + c_min
    # an achievable latency (incumbent): states whose lower bound exceeds it are dropped
    all_cache = _latency((True,) * n, costs)
    all_full = _latency((False,) * n, costs)
    g_use, g_latency = _greedy(costs)
    incumbent = min(all_cache, all_full, g_latency)
    eps = THIN_FRACTION * sum(full) / n if n else 0.0

    # state = (comp_end, load_end, -mask); bit i of mask = use_cache[i]. The negated mask makes
    # equal-clock ties prefer the cache at the latest differing block, and is unique per state,
    # so sorting never needs more than the tuple. Invariant of `front` after each block: sorted
    # by comp_end ascending, load_end strictly descending; a settled state (load_end = -inf)
    # can only be the last one.
    start = costs.load_start
    if (start + rest_load[0]) * _SETTLE_MARGIN <= 0.0:  # nothing to load at all
        start = _NEG_INF
    front: list[tuple[float, float, int]] = [(0.0, start, 0)]
    max_front = 1
    dropped = False
    bit = 1
    neg_inf, margin, lb_margin = _NEG_INF, _SETTLE_MARGIN, _BOUND_MARGIN
    for i in range(n):
        c_cached, c_full, ld = cached[i], full[i], load[i]
        after = rest_load[i + 1]
        kids: list[tuple[float, float, int]] = []
        add = kids.append
        stalled = None
        for c, l, neg_mask in front:
            # use the cache: the load queues behind the previous ones on the copy stream
            l2 = l + ld
            if c < l2:
                # the compute stream waits for the load: child (l2 + c_cached, l2). Parents that
                # stall form a prefix of the front (comp_end ascending, load_end descending) and
                # their children decrease in both clocks: only the last one can be undominated
                # (ties: keep the preferred, i.e. smaller, negated mask)
                if stalled is None or (l2, neg_mask - bit) < stalled[1:]:
                    stalled = (l2 + c_cached, l2, neg_mask - bit)
            else:
                c2 = c + c_cached
                add((c2, l2 if (l2 + after) * margin > c2 else neg_inf, neg_mask - bit))
            # compute all: the copy stream is untouched
            c3 = c + c_full
            add((c3, l if (l + after) * margin > c3 else neg_inf, neg_mask))
        if stalled is not None:
            c2, l2, m2 = stalled
            add((c2, l2 if (l2 + after) * margin > c2 else neg_inf, m2))
        bit <<= 1
        kids.sort()
        front = []
        keep = front.append
        best_load = math.inf
        bound = rest_min[i + 1]
        for s in kids:
            if s[1] < best_load:  # not dominated by an earlier state (whose comp_end is <=)
                if (s[0] + bound) * lb_margin > incumbent:
                    break  # every completion is slower than the incumbent (and so are the rest)
                keep(s)
                best_load = s[1]
        if len(front) > max_front:
            max_front = len(front)
        if front_cap is not None and len(front) > front_cap:
            dropped = True
            if eps > 0.0:  # thin: each dropped state is at most eps worse than the kept one
                thin = [front[0]]
                cut = front[0][1] - eps
                for s in front:
                    if s[1] < cut:
                        thin.append(s)
                        cut = s[1] - eps
                front = thin
            del front[front_cap:]  # keep the smallest comp_end

    candidates = [(g_latency, g_use), (all_cache, (True,) * n), (all_full, (False,) * n)]
    if front:  # front[0]: smallest comp_end, then smallest load_end
        mask = -front[0][2]
        use = tuple(bool(mask >> i & 1) for i in range(n))
        latency = _latency(use, costs)
        # the DP's clock equals `simulate` bit for bit (same float operations; settled states
        # stall in neither); a mismatch would be a bug here
        assert latency == front[0][0], (latency, front[0][0])
        candidates.insert(0, (latency, use))
    # Without a cap the DP's plan is optimal (the optimum's states are never pruned: their
    # bounds are <= the optimum <= the incumbent). With one, it may be beaten by a candidate, or
    # the front may empty; on ties the earlier candidate wins.
    latency, use = min(candidates, key=lambda t: t[0])
    return Plan(use, latency, all_cache, all_full, exact=not dropped, max_front=max_front)


def plan_step(
    costs: BlockCosts, *, front_cap: int = PLAN_STEP_FRONT_CAP, cache_only: bool = False
) -> Plan:
    """The plan the engine runs for one step: `optimal_plan` with a bounded front; with
    `cache_only` every block reads the cache (a K/V cache holds no block inputs to compute every
    token from: CostSpec.kv_cache)."""
    if cache_only:
        n = costs.num_blocks
        every = _latency((True,) * n, costs)
        return Plan((True,) * n, every, every, _latency((False,) * n, costs), exact=True)
    return optimal_plan(costs, front_cap=front_cap)
