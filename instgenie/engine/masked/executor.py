"""Binds masked execution to a family's backbone: builds each step's context from the batch's
request states, drives pipelined loading of host-tier caches, and keeps cache-reading requests on
their template's latent trajectory.

Latents: a masked request computes only its masked tokens, and the unmasked rows of every block
come from the template's run, which followed the template's own latents. After each step the
request's latents outside its edit region are set to the template's latents after that step, so
the unmasked inputs of the next step match the cached activations. With the template's own
inputs (same seed, prompt, mask) this is the identity, so exact replay is preserved.

Loading modes (per step): a cache already on the compute device is read in place (the ideal
case); a host-tier cache is copied in by the `PipelinedLoader` on a side stream when
`pipelined` is on, else synchronously on the compute stream before each block ("naive").
Graph form (a step replayed from a CUDA graph): a host-tier cache in pinned, device-mapped DRAM
is read by a copy kernel on the loader's side stream, the step index on the device, so the
loads are part of the captured graph and overlap its compute (decision 0029).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from instgenie.cache.loader import BlockLoad, CopyEngine, PipelinedLoader, copy_engine_for
from instgenie.cache.misses import CacheMiss
from instgenie.cache.store import same_device
from instgenie.cache.window import SLOTS, StepWindow
from instgenie.config import EXEC_DEFAULTS, ExecConfig
from instgenie.engine.attention import resolve_backend
from instgenie.engine.graphs import StepGraphs
from instgenie.engine.masked import hooks
from instgenie.engine.masked.context import (
    RequestRows,
    StepContext,
    composition_key,
    use_context,
)
from instgenie.engine.masked.conv_layout import ConvLayout
from instgenie.engine.masked.kv_layout import kv_layout
from instgenie.engine.masked.sparse_convs import resnet_stats_width
from instgenie.engine.masked.timer import BlockTimer
from instgenie.engine.request import RequestState
from instgenie.errors import ModelLoadError
from instgenie.lora.apply import Group, LoraBatch, use_lora
from instgenie.scheduler import buckets
from instgenie.scheduler.step import StepPlan


def _fp8(state: RequestState) -> bool:
    meta = state.cache_meta
    return meta is not None and meta.cache_dtype.startswith("float8")


def token_counts(ctx: StepContext) -> dict[int, int]:
    """{L: packed tokens of all rows} on every grid the cache-reading requests' masks cover (a
    row without a cache computes all L)."""
    lengths = {L for r in ctx.requests if r.handle is not None for L in r.token_index}
    return {
        L: sum(
            r.num_rows * (L if r.handle is None else r.token_index[L].numel()) for r in ctx.requests
        )  # fmt: skip
        for L in lengths
    }


def conv_layout(backbone: torch.nn.Module, blocks: list[hooks.BlockInfo]) -> ConvLayout | None:
    """The ConvLayout of the conv blocks among `blocks` (None: there are none)."""
    convs = {b.block_id: (b.kind, b.level) for b in blocks if b.kind in ("resnet", "down", "up")}
    if not convs:
        return None
    stats, off = {}, 0
    for b in blocks:
        if b.kind == "resnet":
            width = resnet_stats_width(backbone.get_submodule(b.name))
            stats[b.block_id] = (off, width)
            off += width
    return ConvLayout(convs, stats, off, stats_block=len(blocks))


class CacheReadFailed(RuntimeError):
    """A request's template cache cannot be read for this step (a disk stream's step failed
    verification: the entry was quarantined). Raised before the step computes anything, so the
    batch's other requests are untouched: only `uid` fails (worker/batcher.py)."""

    def __init__(self, uid: str, cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.uid, self.cause = uid, cause


class MaskedExecutor:
    def __init__(
        self, backbone: torch.nn.Module, device: torch.device, execution: ExecConfig = EXEC_DEFAULTS
    ) -> None:
        self.blocks = hooks.install(backbone, sparse_convs=execution.sparse_convs != "off")
        self.block_order = [b.block_id for b in self.blocks]
        #: the sparse conv blocks and their statistics' place in the cache (None: none hooked)
        self.convs = conv_layout(backbone, self.blocks)
        #: the K/V blocks and their value slots (None: every cached block holds its output)
        self.kv = None
        self.device = device
        #: ExecConfig.attention_backend (None = "auto"; tests and benchmarks switch it)
        self.attention_backend: str | None = execution.attention_backend
        try:  # a bad setting fails the model load, not the first step that reads a cache
            resolve_backend(execution.attention_backend, device)
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"attention_backend: {e}") from None
        #: "auto": host-tier caches are copied by the pipelined loader on CUDA, device-resident
        #: ones are read in place; "pipelined": always through the loader (tests, benchmarks);
        #: "naive": copy each block's rows on the compute stream right before its use
        self.loading = "auto"
        self.copy_engine: CopyEngine | None = None
        #: fewest staging buffers in the loader's ring (each holds one block's (R, L, C) output),
        #: and the device memory the ring may grow to (then every load is enqueued at once)
        self.staging_buffers = 3
        self.max_staging_bytes = 2 << 30
        #: the same per CUDA graph that reads host memory (each owns its ring: graphs.max_graphs
        #: of them may be alive), bytes
        self.graph_staging_bytes = 512 << 20
        #: device step windows for host-tier caches (cache/window.py): "auto" = on CUDA, "on"
        #: (tests: CPU too), "off"; and the device memory all live windows may take, bytes (an
        #: SDXL 1024² request's window is 0.84 GB, a Flux one's 2.9 GB)
        self.windows = "auto"
        self.window_budget_bytes = 16 << 30
        self._windows: list[StepWindow] = []
        #: bytes the last step's windows copied (this step's first rows, the next step's)
        self.last_window_bytes = 0
        self.loader: PipelinedLoader | None = None
        #: the context of the last step (tests and the step log read it)
        self.last_context: StepContext | None = None
        self._token_cache: tuple | None = None
        self._lora_cache: tuple | None = None
        #: CUDA-graph replay of steps whose composition repeats (engine/graphs.py); a graph
        #: whose step reads host memory owns a loader (its ring is part of the graph)
        self.graphs = StepGraphs(device, execution.cuda_graphs, capture=execution.graph_capture)
        self.set_kv_cache(execution.kv_cache == "on")
        #: the lowest bucket rung a step may take (the warm-up raises it to capture every rung)
        self.bucket_min_rung = 0

    def run_backbone(
        self,
        batch: list[RequestState],
        plan: StepPlan,
        fn: Callable[..., torch.Tensor],
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """fn(*args, **kwargs) — the backbone call of one step — under the context `plan`
        describes, replayed from a CUDA graph when the batch's composition repeats and the plan
        allows graphs. Call `prepare_reads(batch)` first (before the plan is made)."""
        plan.check_batch(batch)
        dtype = batch[0].latents.dtype
        windows = [(s.cache_handle.window, s.step_index) for s in batch
                   if getattr(s.cache_handle, "window", None) is not None]  # fmt: skip
        copied = sum(w.bytes_copied for w, _ in windows)
        ctx = self.context(batch, plan)
        loras = self.lora_batch(batch)
        try:
            if self.graphs.capture == "buckets" and ctx is None:
                self.graphs.buckets.release()  # no cache read: the last binding's sources go
            if self.graphs.capture == "buckets" and ctx is not None:
                out = self._run_bucketed(batch, plan, ctx, dtype, loras, fn, args, kwargs)
                if out is not None:
                    return out
                self.last_context = ctx  # (_run_bucketed may have made a conv-maps one)
                self.graphs.buckets.release()  # the last binding's sources may go
            elif plan.may_graph and self.graphs.eligible(ctx, dtype, self.block_order):
                # the LoraBatch itself: a graph reads its tensors, so it lives as long as the graph.
                # Without a context (no member reads or records a cache) a graph reads nothing but
                # its input tensors, copied in at every call: any batch of the same shapes (the
                # run's key) replays it, so a join or leave of full-path edits captures nothing
                members = () if ctx is None else composition_key(batch)
                key = (members, None if ctx is None else ctx.compute_all, loras)
                with use_lora(loras):
                    streamed = (
                        ctx is not None and ctx.reads_cache and self._use_loader(ctx.requests)
                    )
                    loader = self._graph_loader if streamed else None
                    return self.graphs.run(key, ctx, fn, args, kwargs, make_loader=loader,
                                           horizon=plan.horizon)  # fmt: skip
            self.graphs.eager()
            if ctx is not None and ctx.reads_cache and self._use_loader(ctx.requests):
                ctx.start_loads(self._loader(batch), self._loads(ctx, batch))
            with use_context(ctx), use_lora(loras):
                out = fn(*args, **kwargs)
            if ctx is not None:
                ctx.flush_stats(dtype)
            return out
        finally:
            for window, step in windows:
                try:
                    window.done(step)
                except CacheMiss:
                    pass  # the next step's copy failed: its prepare() raises it for that request
            self.last_window_bytes = sum(w.bytes_copied for w, _ in windows) - copied

    def _run_bucketed(self, batch, plan, ctx, dtype, loras, fn, args, kwargs) -> Any:
        """The step through its bucket's graph (engine/bucket_graphs.py), or None: not
        bucketed (ineligible, or no graph of its bucket; the caller runs it eagerly)."""
        graphs = self.graphs
        graphs.buckets.release_dead()
        if (not plan.may_graph or not ctx.reads_cache or loras is not None
                or self._use_loader(ctx.requests)):  # fmt: skip
            return None  # v1: LoRA, streamed rows
        dense = frozenset()
        if self.convs is not None:
            # sparse convs: a bucket's graph computes each conv block on whole maps with the
            # template's statistics and keeps the masked tokens (conv_blocks._map_forward):
            # the tiles' values in shapes a graph can replay (decision 0054). Larger batches,
            # where the tiles pay, run them eagerly. A float8 cache's conv blocks compute all
            # (no statistics) in either form
            dense = frozenset(self.convs.blocks)
            if ctx.compute_all & dense and not any(_fp8(s) for s in batch):
                ctx = self.context(batch, plan, conv_maps=True)
        if ctx.compute_all - dense or not graphs.eligible(ctx, dtype, self.block_order):
            return None  # v1: the planner's compute-all sets
        if any(r.handle is not None and not same_device(r.handle.device, self.device)
               and getattr(r.handle, "window", None) is None for r in ctx.requests):  # fmt: skip
            return None  # host rows read in place ("naive" loading): their pins end with the
            # handle, which a binding outlives
        bucket = buckets.pick(ctx.num_rows, token_counts(ctx), self.bucket_min_rung)
        if bucket is None:
            return None
        return graphs.buckets.run(bucket, composition_key(batch), ctx, self.block_order, fn,
                                  args, kwargs)  # fmt: skip

    def lora_batch(self, batch: list[RequestState]) -> LoraBatch | None:
        """The step's LoRA rows (None: no member applies an adapter this step); one object per
        composition, so a graph captured with it replays with the same tensors."""
        groups, start = [], 0
        for s in batch:
            if s.lora is not None and s.lora.adapters:
                groups.append(Group(start, start + s.num_rows, s.lora.adapters))
            start += s.num_rows
        if not groups:
            return None
        key = (start, tuple((g.row_lo, g.row_hi, tuple((id(a), x) for a, x in g.adapters))
                            for g in groups))  # fmt: skip
        if self._lora_cache is None or self._lora_cache[0] != key:
            dtype = batch[0].latents.dtype
            self._lora_cache = (key, LoraBatch(groups, start, self.device, dtype))
        return self._lora_cache[1]

    def prepare_reads(self, batch: list[RequestState]) -> None:
        """Before the step is planned or computes anything, make every cache-reading
        request's rows of this step readable, so one that cannot be read fails alone
        (CacheReadFailed): host-tier handles get a device step window (within
        window_budget_bytes; cache/window.py) whose slot is made ready — their steps then read
        device memory, DMA'd one step ahead, like a GPU-resident cache — or, without one, read
        (and verify) the step now. The load planner then prices a windowed cache as
        device-resident; run_backbone finishes each window's step (done())."""
        use = self.windows == "on" or (self.windows == "auto" and self.device.type == "cuda")
        dtype = batch[0].latents.dtype
        for state in batch:
            h = state.cache_handle
            if h is None or not hasattr(h, "host_block"):
                continue  # device-resident: nothing to prepare
            try:
                if use and not h.window_decided:
                    h.attach_window(self._new_window(h, dtype))
                if h.window is None:
                    h.host_block(state.step_index, 0)  # a disk stream reads the step here
                    continue
                h.window.prepare(state.step_index)
            except CacheMiss as e:
                raise CacheReadFailed(state.uid, e) from e

    def _new_window(self, h: Any, dtype: torch.dtype) -> StepWindow | None:
        """A device step window for host handle `h`, or None (fp8 rows, over the budget, or
        the device short of memory): then it reads host memory for its whole edit."""
        spec = h.window_spec()
        if spec is None or spec[2] != dtype:
            return None  # fp8 rows: dequantised by the pipelined loader
        shapes, num_steps, _ = spec
        need = SLOTS * sum(math.prod(shape) for shape in shapes.values()) * dtype.itemsize
        self._windows = [w for w in self._windows if w.stacks]  # drop closed ones
        if sum(w.nbytes for w in self._windows) + need > self.window_budget_bytes:
            return None  # over budget: this request reads host memory (loader / device view)
        if self.device.type == "cuda" and need > torch.cuda.mem_get_info(self.device)[0] // 2:
            return None  # the device is short of memory: never trade an OOM for the window
        if self.copy_engine is None:
            self.copy_engine = copy_engine_for(self.device)
        window = StepWindow(h.host_block, shapes, num_steps, dtype, self.device, self.copy_engine)
        self._windows.append(window)
        return window

    def _graph_loader(self, dtype: torch.dtype) -> PipelinedLoader:
        if self.copy_engine is None:
            self.copy_engine = copy_engine_for(self.device)
        return PipelinedLoader(
            self.copy_engine, self.device, dtype, num_buffers=self.staging_buffers,
            max_staging_bytes=self.graph_staging_bytes,
        )  # fmt: skip

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_cached_blocks(self) -> int:
        """Slots a template's cache holds per step: the hooked blocks' own, the statistics
        pseudo-block of sparse convs, the value slots of K/V blocks."""
        kv = 0 if self.kv is None else self.kv.num_slots
        return len(self.blocks) + (self.convs is not None) + kv

    def set_kv_cache(self, on: bool) -> None:
        """Switch ExecConfig.kv_cache on a live executor (benchmarks comparing the layouts in one
        process). Template keys name the layout, so each cache keeps being read as what it
        holds; every step graph goes (captured with the other forwards), as do the token sets.
        A pipeline's cost model (StepPricer) prices with the spec it was built with."""
        first_free = len(self.blocks) + (self.convs is not None)
        self.kv = kv_layout(self.blocks, first_free) if on else None
        self.graphs.clear()
        self._token_cache = None

    @property
    def cache_layout(self) -> str:
        """What a template's cache holds beyond its transformer blocks' outputs (the template
        key's `layout`): "convs" (sparse convs), "kv" (keys and values instead of outputs),
        "" (nothing: the key of a plain cache is what it always was)."""
        return "+".join(n for n, on in (("convs", self.convs), ("kv", self.kv)) if on is not None)

    def context(
        self, batch: list[RequestState], plan: StepPlan, conv_maps: bool = False
    ) -> StepContext | None:
        """The step's context (None: no request reads or records a cache and nothing is timed:
        the blocks run their stock forward); `conv_maps`: sparse conv blocks read the cache
        whatever the plan says (a bucketed step's form, _run_bucketed: its conv blocks compute
        whole maps either way, at the same price, pricing.step_costs)."""
        if not plan.timed and not any(
            s.cache_handle is not None or s.writer is not None for s in batch
        ):
            self.last_context = None
            return None
        rows, start = [], 0
        for s in batch:
            rows.append(
                RequestRows(
                    start=start,
                    num_rows=s.num_rows,
                    step=s.step_index,
                    handle=s.cache_handle,
                    token_index=s.token_index if s.cache_handle is not None else None,
                    writer=s.writer,
                )
            )
            start += s.num_rows
        compute_all = plan.compute_all
        if self.convs is not None and any(_fp8(s) for s in batch):
            # a float8 cache cannot hold GroupNorm statistics (ConvLayout): convs compute all
            compute_all = compute_all | frozenset(self.convs.blocks)
        elif self.convs is not None and conv_maps:
            compute_all = compute_all - frozenset(self.convs.blocks)
        if self.kv is not None:  # a K/V block's unmasked inputs are not cached (kv_layout.py)
            compute_all = frozenset(b for b in compute_all if b not in self.kv)
        ctx = StepContext(rows, self.device, compute_all, self.attention_backend,
                          tuple(self.block_order), self.convs,
                          tuple(batch[0].latents.shape[-2:]), kv=self.kv)  # fmt: skip
        # token sets depend only on the batch's composition: reuse them across its steps
        key = composition_key(batch)
        if self._token_cache is not None and self._token_cache[0] == key:
            ctx._tokens, ctx._joint = self._token_cache[1], self._token_cache[2]
        else:
            self._token_cache = (key, ctx._tokens, ctx._joint)
        if plan.timed:
            ctx.timer = BlockTimer(self.device)
        self.last_context = ctx
        return ctx

    def _use_loader(self, rows: list[RequestRows]) -> bool:
        if self.loading == "naive":
            return False
        if self.loading == "pipelined":
            return True
        host = any(
            r.handle is not None
            and not same_device(r.handle.device, self.device)
            and getattr(r.handle, "window", None) is None  # a window is device memory
            for r in rows
        )
        return host and self.device.type == "cuda"

    def _loader(self, batch: list[RequestState]) -> PipelinedLoader:
        if self.copy_engine is None:
            self.copy_engine = copy_engine_for(self.device)
        dtype = batch[0].latents.dtype
        loader = self.loader
        if loader is None or loader.dtype != dtype or loader.num_buffers != self.staging_buffers:
            self.loader = PipelinedLoader(
                self.copy_engine, self.device, dtype, num_buffers=self.staging_buffers,
                max_staging_bytes=self.max_staging_bytes,
            )  # fmt: skip
        return self.loader

    def _loads(self, ctx: StepContext, batch: list[RequestState]) -> list[BlockLoad]:
        shapes = self._block_shapes(batch)
        return [
            BlockLoad(b, (ctx.num_rows, *shapes[b]), ctx.cached_rows(b))
            for b in self.block_order
            if ctx.is_masked(b) and not ctx.is_map_block(b) and not ctx.is_kv(b)
        ]

    @staticmethod
    def _block_shapes(batch: list[RequestState]) -> dict[int, tuple[int, int]]:
        for s in batch:
            if s.cache_meta is not None:
                return s.cache_meta.block_shapes
        raise RuntimeError("no cache-reading request in the batch")

    def after_step(self, batch: list[RequestState]) -> None:
        """Called once the batch's latents and step indices have advanced."""
        if any(s.is_done for s in batch):
            # a finished member's handle closes next (its window or device copy is freed and no
            # longer counted): the bucket binding naming its stacks goes first
            self.graphs.buckets.release()
        for s in batch:
            step = s.step_index - 1
            if s.writer is not None:
                s.writer.put_latents(step, s.latents)
            if s.cache_handle is not None:
                template = s.cache_handle.latents(step).to(s.latents.device, s.latents.dtype)
                s.latents = torch.where(s.edit_mask, s.latents, template)
