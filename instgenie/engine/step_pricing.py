"""The worker's per-step planner: which blocks of this step compute all tokens.

A torch-side adapter over the scheduler: it summarises a batch of RequestState into what
scheduler.pricing needs (the working size; per request its rows, its masked tokens on each token
grid = `token_index[L].numel()`, and whether its cached rows are copied host -> device for the
step: a host cache without a device step window; one read through a window is copied a step
ahead, off the critical path, cache/window.py), prices it with `pricing.step_costs` and the
worker's own CostSpec (the one it sends to the router, engine/costspec.py), and plans it with
`planner.plan_step`. The router prices the same batch with the same function (scheduler.estimate).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from instgenie.cache.store import same_device
from instgenie.engine.masked.context import composition_key
from instgenie.engine.request import RequestState
from instgenie.scheduler.planner import BlockCosts, Plan, plan_step
from instgenie.scheduler.pricing import RequestWork, step_costs
from instgenie.scheduler.spec import CostSpec

log = logging.getLogger("instgenie.engine")


class StepPricer:
    def __init__(self, spec: CostSpec, compute_device) -> None:  # noqa: ANN001 - torch.device
        self.spec = spec
        self.device = compute_device
        #: token stride of each block id
        self._strides = {b.block_id: b.stride for b in spec.blocks}
        #: the last step's plan (observability: the step log records it)
        self.last_plan: Plan | None = None
        self._last_key: tuple | None = None

    def works(self, batch: Sequence[RequestState]) -> tuple[int, list[RequestWork]]:
        """(working pixels, one RequestWork per request) of a batch of one size with at least
        one cache-reading request. ValueError if a cache's token grids are not the ones its
        working size gives (pricing derives them from it)."""
        meta = next(s.cache_meta for s in batch if s.cache_meta is not None)
        pixels = batch[0].image.width * batch[0].image.height
        grids: dict[int, int] = {}  # stride -> tokens of that grid
        for b, stride in self._strides.items():
            L = meta.block_shapes[b][0]
            if grids.setdefault(stride, L) != L or max(1, pixels // (stride * stride)) != L:
                raise ValueError(f"block {b}: {L} tokens at stride {stride}, not {pixels} px's")
        works = []
        for s in batch:
            reads = s.cache_handle is not None
            tokens = None
            if reads:
                tokens = tuple(sorted((st, s.token_index[L].numel()) for st, L in grids.items()))
            host = reads and not same_device(s.cache_handle.device, self.device)
            loads = host and getattr(s.cache_handle, "window", None) is None
            works.append(RequestWork(s.num_rows, tokens, loads))
        return pixels, works

    def costs(self, batch: Sequence[RequestState]) -> BlockCosts:
        """Per block (execution order) the costs of one step of `batch` (pricing.step_costs)."""
        return step_costs(self.spec, *self.works(batch))

    def compute_all(self, batch: list[RequestState]) -> frozenset[int]:
        """Block ids that compute all tokens this step. Costs do not depend on the step index,
        so a batch of the same requests (composition_key) reuses the last plan."""
        key = composition_key(batch)
        if key != self._last_key or self.last_plan is None:
            try:
                costs = self.costs(batch)
            except ValueError as e:  # grids the spec cannot price: plan nothing, never fail
                log.warning("load planner: %s; every block reads the cache this step", e)
                return frozenset()
            self.last_plan = plan_step(costs, cache_only=self.spec.kv_cache)
            self._last_key = key
        return frozenset(self.last_plan.compute_all)
