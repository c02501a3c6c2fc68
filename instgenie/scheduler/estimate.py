"""Step-latency estimates for the mask-aware router (paper §4.4, Algorithm 2).

A worker's `CostSpec` (sent by its denoise loop at start) lists every transformer block's
dimensions and token stride and, when the worker runs with a fitted profile, the same latency
models its per-step load planner uses. From them `Estimator.step_ms` predicts one denoising step
of a batch of requests with the worker's own pricing (pricing.step_costs, the one function its
planner calls too): per block, the batch's masked compute ("cached" fit at the batch's FLOPs),
its full compute ("full" fit) and the loads of cached rows not resident on the GPU (at the load
fit of the tier they are read from: "disk" where the profile has it, else "dram"), and the load
planner's optimal plan (planner.plan_step, the paper's Algorithm 1) over them; plus the rest of
the step (ResNets, norms, the scheduler: the profile's "other" fit at the batch's rows * pixels),
which a masked request pays in full. `stage_ms` prices the loop's work per request outside its
steps (prompt and VAE encode on receipt, VAE decode when it leaves; the profile's "stages" fits,
sent only where that work runs in the loop's process), which the router's simulation adds
between steps. Without a profile the fits are replaced by FLOPs at a nominal
`pricing.NOMINAL_FLOPS_PER_MS` (relative prices), nothing is loaded, and neither the rest of the
step nor the stages are priced. Not priced: the CPU work of pre/post-processing (image decode,
paste-back, image encode). It runs beside the loop in the pre/post processes, except under the
naive-continuous policy, which runs it inline (there the loop's per-request work is
underpriced). Nor the slowdown that stages run by the pre/post processes on the loop's own GPU
cause (model_stages="process" without a stage_device; decision 0009). Pure Python (no torch): it
runs in the API process.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from instgenie.scheduler.fits import fit_ms
from instgenie.scheduler.planner import BlockCosts, plan_step
from instgenie.scheduler.pricing import RequestWork, layout, step_costs
from instgenie.scheduler.spec import CostSpec

#: tiers whose cached rows are copied host -> GPU for every step that reads them (the others,
#: "gpu" and "cpu" = the loop's own device store, are read in place)
HOST_TIERS = frozenset({"dram", "disk"})
#: step prices remembered per estimator (compositions), entries
PRICE_CACHE = 4096


@dataclass(frozen=True)
class Work:
    """One request as the router prices it on one worker."""

    pixels: int  # working size, width * height, pixels
    rows: int  # batch rows: 2 with classifier-free guidance, else 1
    steps: int  # denoising steps
    #: (token stride in pixels, fraction of that grid's tokens it computes), sorted by stride;
    #: None: the full path (no ready cache on that worker: every token)
    ratios: tuple[tuple[int, float], ...] | None
    loads: bool = False  # its cached rows are copied host -> GPU every step
    load_tier: str = "dram"  # the host tier they are copied from ("dram" | "disk")

    def request_work(self) -> RequestWork:
        """What pricing needs: the masked tokens of each grid, round(ratio * tokens) clamped to
        the grid's max(1, pixels // stride²) tokens."""
        if self.ratios is None:
            return RequestWork(self.rows, None, self.loads, self.load_tier)
        tokens = []
        for s, r in self.ratios:
            L = max(1, self.pixels // (s * s))
            tokens.append((s, min(L, max(0, round(r * L)))))
        return RequestWork(self.rows, tuple(tokens), self.loads, self.load_tier)


class Estimator:
    def __init__(self, spec: CostSpec) -> None:
        self.spec = spec
        self.strides = list(layout(spec).strides)
        self.fitted = bool(spec.compute)
        self._prices: dict[frozenset, float] = {}

    # ---- one request -----------------------------------------------------------------------
    def work(
        self,
        pixels: int,
        steps: int | None,
        guidance: float | None,
        ratios: dict[int, float] | None,
        tier: str | None,
        strength: float | None = None,
    ) -> Work:
        """A request of `pixels` whose mask covers `ratios` of each token grid (None: unknown,
        priced as all tokens) on a worker where its template's cache sits in `tier` (None: no
        ready cache there: the full path). With `strength` < 1 it runs int(steps * strength)
        of its steps (diffusers' img2img timesteps), at least one."""
        spec = self.spec
        g = guidance if guidance is not None else spec.default_guidance
        rows = 2 if spec.cfg and g > 1.0 else 1
        if tier is None:
            cover = None
        elif ratios is None:
            cover = tuple((s, 1.0) for s in self.strides)
        else:
            cover = tuple(sorted(ratios.items()))
        loads = tier in HOST_TIERS and bool(spec.load)
        n = steps or spec.default_steps
        if strength is not None and strength < 1.0:
            n = int(n * strength)
        load_tier = "disk" if loads and tier == "disk" else "dram"
        return Work(pixels, rows, max(1, n), cover, loads, load_tier)

    # ---- one step of a batch -----------------------------------------------------------------
    def step_ms(self, batch: Iterable[Work]) -> float:
        """Predicted latency of one denoising step of `batch`, ms. Requests of different sizes
        never share a step (the worker batches by size): their steps take turns, so they add.
        Prices are remembered per composition (the same batches recur from one routing
        decision to the next)."""
        key = frozenset(Counter(batch).items())
        price = self._prices.get(key)
        if price is None:
            groups: dict[int, list[Work]] = defaultdict(list)
            for w, k in key:
                groups[w.pixels] += [w] * k
            price = sum(self._group_ms(pixels, works) for pixels, works in groups.items())
            if len(self._prices) >= PRICE_CACHE:
                self._prices.clear()
            self._prices[key] = price
        return price

    def _group_ms(self, pixels: int, works: list[Work]) -> float:
        """The worker's pricing of these requests (one size), then the planner's plan."""
        costs = self.block_costs(pixels, works)
        reads = any(w.ratios is not None for w in works)
        rows = sum(w.rows for w in works)
        return blocks_ms(costs, reads, self.spec.kv_cache) + self.other_ms(rows * pixels)

    def block_costs(self, pixels: int, works: Sequence[Work]) -> BlockCosts:
        """Per block (execution order) the costs the worker's planner gets for this batch of
        one size: pricing.step_costs."""
        return step_costs(self.spec, pixels, [w.request_work() for w in works])

    def other_ms(self, rows_pixels: int) -> float:
        """The step outside its transformer blocks for `rows_pixels` = batch rows * pixels."""
        return fit_ms(self.spec.other, rows_pixels) if self.spec.other is not None else 0.0

    def capture_step_ms(self, pixels: int) -> float:
        """What a template's capture run of `pixels` costs each step it runs in beyond the
        step's price, ms: the profile's capture fit (ms against pixels x steps, from a served
        step log: a capture's bytes, and so its copies, scale with both) per step; 0 without
        one."""
        if not self.fitted or self.spec.capture is None:
            return 0.0
        return fit_ms(self.spec.capture, pixels)

    def stage_ms(self, stage: str, pixels: int) -> float:
        """The loop's `stage` ("encode" | "decode") of one request of `pixels`, ms; 0 when the
        worker's spec has no fit for it, or prices steps in nominal FLOPs (other units)."""
        if not self.fitted:
            return 0.0
        return fit_ms(self.spec.stages.get(stage), pixels)


def blocks_ms(costs: BlockCosts, reads: bool, cache_only: bool = False) -> float:
    """The transformer blocks of a step priced `costs`: the planner's plan; without a cache read,
    every block computes all tokens; with nothing to load, each block takes its cheaper way;
    `cache_only` (a K/V cache): every block reads the cache."""
    if not reads:
        return sum(costs.compute_full)
    if cache_only:
        return plan_step(costs, cache_only=True).latency_ms
    if not any(costs.load):
        return sum(min(c, f) for c, f in zip(costs.compute_cached, costs.compute_full, strict=True))
    return plan_step(costs).latency_ms


def dilate(mask: np.ndarray, margin: int) -> np.ndarray:
    """A bool (H, W) mask, True wherever a pixel within `margin` pixels (a (2 margin + 1)²
    square) is True: the worker's compute margin (engine.masked.tokens.dilate), separable, as
    two running sums."""
    m = np.asarray(mask, dtype=bool)
    if margin <= 0:
        return m
    for axis in (0, 1):
        n = m.shape[axis]
        c = np.cumsum(m, axis=axis, dtype=np.int64)
        c = np.concatenate([np.zeros_like(c.take([0], axis=axis)), c], axis=axis)
        hi = np.minimum(np.arange(n) + margin + 1, n)
        lo = np.maximum(np.arange(n) - margin, 0)
        m = (c.take(hi, axis=axis) - c.take(lo, axis=axis)) > 0
    return m


def token_ratios(mask: np.ndarray, strides: Sequence[int], margin: int = 0) -> dict[int, float]:
    """Fraction of each token grid a binary pixel mask (H, W) covers, computed as the worker
    does (engine.masked.tokens: a token is computed when any pixel under it is edited, after
    dilating the mask by the worker's compute `margin`, pixels), on a grid padded up to whole
    tokens."""
    m = dilate(mask, margin)
    out = {}
    for s in strides:
        h, w = -(-m.shape[0] // s), -(-m.shape[1] // s)
        padded = np.zeros((h * s, w * s), dtype=bool)
        padded[: m.shape[0], : m.shape[1]] = m
        out[s] = float(padded.reshape(h, s, w, s).any(axis=(1, 3)).mean())
    return out
