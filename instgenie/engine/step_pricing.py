"""Per-step cost estimates for the load planner, from a fitted profile (profiles/*.json).

For the batch of one step and every hooked block b (execution order): the predicted latency of
computing the batch's masked tokens ("cached" fit of b's class at the batch's FLOPs), of
computing every token ("full" fit), and of loading the cache-reading requests' rows of b (the
tier's load fit at their bytes, one copy per request; zero for device-resident caches and for
host caches read through a device step window). The
planner (planner.plan_step) turns these into the set of blocks that compute all tokens.
"""

from __future__ import annotations

from instgenie.scheduler.pricing import BlockDims, batch_flops, block_dims, cached_bytes
from instgenie.scheduler.planner import BlockCosts, Plan, plan_step
from instgenie.engine.profiling import Profile
from instgenie.engine.masked.context import StepContext, composition_key
from instgenie.engine.request import RequestState


class StepCostModel:
    def __init__(self, profile: Profile, dims: dict[int, BlockDims], compute_device) -> None:
        self.profile = profile
        self.dims = dims
        self.device = compute_device
        #: the last step's plan (observability: the step log records it)
        self.last_plan: Plan | None = None
        self._last_key: tuple | None = None

    @classmethod
    def for_family(cls, profile: Profile, family) -> StepCostModel:
        ex = family.masked
        dims = {
            b.block_id: block_dims(family.backbone.get_submodule(b.name), b.block_id, b.kind)
            for b in ex.blocks
        }
        return cls(profile, dims, family.device)

    def costs(self, batch: list[RequestState]) -> BlockCosts:
        meta = next(s.cache_meta for s in batch if s.cache_meta is not None)
        text_len = int(batch[0].cond["prompt_embeds"].shape[1])
        cached_ms, full_ms, load_ms = [], [], []
        for b in sorted(self.dims):
            L, C = meta.block_shapes[b]
            masked_rows, full_rows, loads = [], [], 0.0
            for s in batch:
                reads = s.cache_handle is not None
                n = s.token_index[L].numel() if reads else L
                masked_rows += [n] * s.num_rows
                full_rows += [L] * s.num_rows
                # a host cache with a device step window is copied a step ahead, off the
                # critical path (cache/window.py): priced as device-resident
                host = reads and s.cache_handle.device != self.device
                if host and getattr(s.cache_handle, "window", None) is None:
                    nbytes = cached_bytes(L, C, s.num_rows, s.cache_meta.cache_dtype)
                    loads += self.profile.load_ms("dram", nbytes)
            d = self.dims[b]
            cached_ms.append(
                self.profile.compute_ms(b, "cached", batch_flops(d, L, masked_rows, text_len))
            )
            full_ms.append(
                self.profile.compute_ms(b, "full", batch_flops(d, L, full_rows, text_len))
            )
            load_ms.append(loads)
        return BlockCosts(cached_ms, full_ms, load_ms)

    def plan(self, batch: list[RequestState], ctx: StepContext) -> frozenset[int]:
        """The executor's planner hook: block ids that compute all tokens this step. Costs do
        not depend on the step index, so a batch of the same requests reuses the last plan."""
        key = composition_key(batch)
        if key != self._last_key or self.last_plan is None:
            self.last_plan = plan_step(self.costs(batch))
            self._last_key = key
        return frozenset(self.last_plan.compute_all)
