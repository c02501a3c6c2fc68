"""Step-latency estimates for the mask-aware router (paper §4.4, Algorithm 2).

A worker's `CostSpec` (sent by its denoise loop at start) lists every transformer block's
dimensions and token stride and, when the worker runs with a fitted profile, the same latency
models its per-step load planner uses. From them `Estimator.step_ms` predicts one denoising step
of a batch of requests as the worker's planner prices it (cache.costmodel): per block, the
batch's masked compute ("cached" fit at the batch's FLOPs), its full compute ("full" fit) and the
loads of cached rows not resident on the GPU, and the load planner's optimal plan (cache.planner,
the paper's Algorithm 1) over them; plus the rest of the step (ResNets, norms, the scheduler: the
profile's "other" fit at the batch's rows * pixels), which a masked request pays in full.
`stage_ms` prices the loop's work per request outside its steps (prompt and VAE encode on
receipt, VAE decode when it leaves; the profile's "stages" fits, sent only where that work runs in
the loop's process), which the router's simulation adds between steps. Without a profile the
fits are replaced by FLOPs at a nominal `NOMINAL_FLOPS_PER_MS` (relative prices), nothing is
loaded, and neither the rest of the step nor the stages are priced. Not priced: the CPU work of
pre/post-processing (image decode, paste-back, image encode). It runs beside the loop in the
pre/post processes, except under the naive-continuous policy, which runs it inline (there the
loop's per-request work is underpriced). Nor the slowdown that stages run by the pre/post
processes on the loop's own GPU cause (model_stages="process" without a stage_device; decision
0009). Pure Python (no torch): it runs in the API process.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from instgenie.scheduler.pricing import BlockDims, cached_bytes, row_macs
from instgenie.scheduler.planner import BlockCosts, plan_step
from instgenie.messages import CostFit, CostSpec

#: FLOPs per millisecond of the nominal device that prices batches without a profile
#: (100 TFLOP/s); only ratios of such prices are used
NOMINAL_FLOPS_PER_MS = 1e11
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


class Estimator:
    def __init__(self, spec: CostSpec) -> None:
        self.spec = spec
        self.blocks = [
            (BlockDims(b.block_id, b.kind, b.channels, b.ff_macs, b.context_dim, b.mlp), b.stride)
            for b in sorted(spec.blocks, key=lambda b: b.block_id)
        ]
        self.strides = sorted({s for _, s in self.blocks})
        self.fitted = bool(spec.compute)
        # blocks of one class at one stride cost the same: price each such kind once
        # (SDXL: 70 blocks, 2 kinds; Flux: 57 blocks, 2 kinds)
        kinds: dict[tuple, int] = {}
        self._seq = tuple(
            kinds.setdefault((dataclasses.replace(d, block_id=0), s), len(kinds))
            for d, s in self.blocks
        )
        self._kinds = list(kinds)
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
        return Work(pixels, rows, max(1, n), cover, loads)

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
        """cache.costmodel.StepCostModel.costs for these requests, then the planner's plan."""
        per_kind = self._kind_costs(pixels, works)
        reads = any(w.ratios is not None for w in works)
        rows = sum(w.rows for w in works)
        return self._blocks_ms(per_kind, reads) + self.other_ms(rows * pixels)

    def block_costs(self, pixels: int, works: list[Work]) -> BlockCosts:
        """Per block (execution order) the costs the worker's planner gets for this batch of
        one size (cache.costmodel.StepCostModel.costs)."""
        per_kind = self._kind_costs(pixels, works)
        cols = zip(*(per_kind[k] for k in self._seq), strict=True)
        cached, full, load = (tuple(c) for c in cols)
        return BlockCosts(cached, full, load)

    def _kind_costs(self, pixels: int, works: list[Work]) -> list[tuple[float, float, float]]:
        """(cached ms, full ms, load ms) per block kind."""
        spec, t = self.spec, self.spec.text_len
        reads = any(w.ratios is not None for w in works)
        rows = sum(w.rows for w in works)
        per_kind = []
        for d, stride in self._kinds:
            L = max(1, pixels // (stride * stride))
            counts: Counter[int] = Counter()  # masked tokens per row -> rows
            load = 0.0
            for w in works:
                r = None if w.ratios is None else dict(w.ratios)[stride]
                n = L if r is None else min(L, max(0, round(r * L)))
                counts[n] += w.rows
                if w.loads:  # one copy per request, each priced by the fit (as the worker does)
                    nbytes = cached_bytes(L, d.channels, w.rows, spec.cache_dtype)
                    load += fit_ms(spec.load.get("dram"), nbytes)
            # = batch_flops(d, L, rows' masked tokens, t): a sum of per-row terms
            full = self._compute_ms(d, "full", 2 * rows * row_macs(d, L, L, t))
            cached = full
            if reads:
                flops = 2 * sum(k * row_macs(d, L, n, t) for n, k in counts.items())
                cached = self._compute_ms(d, "cached", flops)
            per_kind.append((cached, full, load))
        return per_kind

    def _blocks_ms(self, per_kind: list[tuple[float, float, float]], reads: bool) -> float:
        if not reads:
            return sum(per_kind[k][1] for k in self._seq)
        costs = [per_kind[k] for k in self._seq]
        if not any(c[2] for c in costs):  # nothing to load: the plan takes each block's cheaper
            return sum(min(c[0], c[1]) for c in costs)
        cached, full, load = (tuple(col) for col in zip(*costs, strict=True))
        return plan_step(BlockCosts(cached, full, load)).latency_ms

    def other_ms(self, rows_pixels: int) -> float:
        """The step outside its transformer blocks for `rows_pixels` = batch rows * pixels."""
        return fit_ms(self.spec.other, rows_pixels) if self.spec.other is not None else 0.0

    def stage_ms(self, stage: str, pixels: int) -> float:
        """The loop's `stage` ("encode" | "decode") of one request of `pixels`, ms; 0 when the
        worker's spec has no fit for it, or prices steps in nominal FLOPs (other units)."""
        if not self.fitted:
            return 0.0
        return fit_ms(self.spec.stages.get(stage), pixels)

    def _compute_ms(self, d: BlockDims, mode: str, flops: float) -> float:
        if not self.fitted:
            return flops / NOMINAL_FLOPS_PER_MS
        return fit_ms(self.spec.compute.get(f"{d.kind}:{d.channels}/{mode}"), flops)


def fit_ms(fit: CostFit | None, x: float) -> float:
    """A fitted latency at `x` (FLOPs, bytes or pixels), ms; 0 for no fit (a class or tier the
    profile lacks: check_profile refuses such profiles)."""
    if fit is None:
        return 0.0
    return max(0.0, fit.slope * x + fit.intercept)


def token_ratios(mask: np.ndarray, strides: Sequence[int]) -> dict[int, float]:
    """Fraction of each token grid a binary pixel mask (H, W) covers, computed as the worker
    does (engine.masked.tokens: a token is computed when any pixel under it is edited), on a
    grid padded up to whole tokens."""
    m = np.asarray(mask, dtype=bool)
    out = {}
    for s in strides:
        h, w = -(-m.shape[0] // s), -(-m.shape[1] // s)
        padded = np.zeros((h * s, w * s), dtype=bool)
        padded[: m.shape[0], : m.shape[1]] = m
        out[s] = float(padded.reshape(h, s, w, s).any(axis=(1, 3)).mean())
    return out
