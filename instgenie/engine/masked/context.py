"""The per-step context that masked blocks read: which rows compute which tokens, where cached
rows come from, which blocks compute all tokens, and where captured outputs go.

One `StepContext` exists per denoising step of a batch; blocks find it through a context
variable, so the diffusers model code in between is untouched. Without a context, hooked blocks
run their stock forward (bit-identical to unhooked diffusers).

Row layout: the batch's R rows are the requests' CFG rows, each request's rows adjacent
(uncond first), in batch order. Packed tokens: for token count L, the masked tokens of row 0,
then of row 1, ...; a row not reading the cache contributes all L tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from instgenie.cache.loader import PipelinedLoader
from instgenie.cache.quant import copy_rows
from instgenie.cache.store import CacheWriter, TemplateHandle
from instgenie.engine.kernels import kernel_enabled, optional_kernel
from instgenie.engine.masked.bound_rows import BoundRows
from instgenie.engine.masked.conv_layout import ConvLayout, decode_stats, encode_stats
from instgenie.engine.masked.kv_layout import KVLayout
from instgenie.engine.masked.tiles import TileSet, build_tiles
from instgenie.engine.masked.timer import BlockTimer
from instgenie.engine.masked.token_sets import JointSet, TokenSet, _pad

_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "instgenie_step_context", default=None
)


#: the device-indexed step copy (triton_kernels/step_copy.py) of the graph form: "auto" = on CUDA
#: where Triton imports; "on" = also elsewhere (CPU tests under TRITON_INTERPRET=1); "off" =
#: torch.index_select
STEP_COPY = "auto"


def _step_copy_kernel():
    return optional_kernel("step_copy", "copy_step")


def copy_cached_step(src: torch.Tensor, step: torch.Tensor, out: torch.Tensor) -> None:
    """out = src[step[0]] (the step index stays on the device)."""
    kernel = None
    if kernel_enabled(STEP_COPY, out.device):
        if out.is_contiguous() and src[0].is_contiguous():
            kernel = _step_copy_kernel()
    if kernel is not None:
        kernel(src, step, out)
    else:
        torch.index_select(src, 0, step, out=out.unsqueeze(0))


class StepSlice:
    """A graph-safe copy source: step `step[0]` of a (num_steps, rows, L, C) stack that kernels on
    the compute device read in place (device memory, or pinned host memory over PCIe), the step
    index staying on the device, so a captured copy serves every step (PipelinedLoader source)."""

    def __init__(self, stack: torch.Tensor, step: torch.Tensor) -> None:
        self.stack, self.step = stack, step

    @property
    def shape(self) -> torch.Size:
        return self.stack.shape[1:]

    @property
    def nbytes(self) -> int:
        return self.stack[0].numel() * self.stack.element_size()

    def copy_into(self, dst: torch.Tensor) -> None:
        copy_cached_step(self.stack, self.step, dst)


def current_context() -> StepContext | None:
    return _CURRENT.get()


@contextlib.contextmanager
def use_context(ctx: StepContext | None) -> Iterator[None]:
    token = _CURRENT.set(ctx)
    try:
        yield
    finally:
        _CURRENT.reset(token)


@dataclass
class RequestRows:
    """One request's slice of the batch for this step."""

    #: first row in the batch and number of rows (CFG rows)
    start: int
    num_rows: int
    #: the step index the request is at
    step: int
    #: the template cache it reads (masked mode), else None (computes all tokens)
    handle: TemplateHandle | None = None
    #: {L: token indices (n_L,) int64, CPU} of its masked tokens; required with a handle
    token_index: dict[int, torch.Tensor] | None = None
    #: where its block outputs go (capture), else None
    writer: CacheWriter | None = None


class StepContext:
    def __init__(
        self,
        requests: list[RequestRows],
        device: torch.device,
        compute_all: frozenset[int] = frozenset(),
        attention_backend: str | None = None,
        block_order: tuple[int, ...] = (),
        convs: ConvLayout | None = None,
        latent_hw: tuple[int, int] = (0, 0),
        pad_to: dict[int, int] | None = None,
        kv: KVLayout | None = None,
    ) -> None:
        self.requests = requests
        #: K/V blocks and their value slots (engine/masked/flux_kv.py); None: outputs cached
        self.kv = kv
        #: {L: packed tokens} a bucketed graph's capacity (engine/bucket_graphs.py): token sets
        #: of these grids are padded to it (pads gather a real token of their row and scatter
        #: to a trash row, so real outputs do not depend on them); None: no padding
        self.pad_to = pad_to
        #: a bucketed graph's cached-row sources (device address tables), else None
        self.bound: BoundRows | None = None
        #: sparse conv blocks (None: only transformer blocks are hooked), and the latent grid
        #: (h, w) whose 2**-level grids they compute
        self.convs = convs
        self.latent_hw = latent_hw
        #: capture: ResNet block id -> (R, width) statistics of every row (rows that capture)
        self._stats_out: dict[int, torch.Tensor] = {}
        #: edits: (R, width) template statistics of this step (cache-reading rows)
        self._stats_in: torch.Tensor | None = None
        self.device = device
        self.compute_all = compute_all
        self.attention_backend = attention_backend
        #: hooked block ids in execution order
        self.block_order = block_order
        #: when set, cached rows arrive through pipelined staging buffers (host-tier caches)
        self.loader: PipelinedLoader | None = None
        self._loading = False  # this step's loads were handed to the loader
        #: when set, every hooked block reports start/stop to it (the profiler)
        self.timer: BlockTimer | None = None
        self.num_rows = sum(r.num_rows for r in requests)
        self.reads_cache = any(r.handle is not None for r in requests)
        self.capturing = any(r.writer is not None for r in requests)
        self._tokens: dict[int, TokenSet] = {}
        self._joint: dict[tuple, JointSet | torch.Tensor] = {}
        #: block id -> bool "ran masked" (observability and tests)
        self.masked_blocks: list[int] = []
        #: graph form (engine/graphs.py): first row of each cache-reading request -> its step
        #: index as a (1,) int64 device tensor; cached rows are then read by index from the
        #: handle's per-block stack of all steps, so one captured graph serves every step
        self.step_index: dict[int, torch.Tensor] | None = None

    def forget_built(self) -> None:
        """Drop what the step built on the device (token sets of the composition, the template's
        statistics): after a failed CUDA-graph capture they hold memory no kernel wrote."""
        self._joint.clear()
        self._stats_in = None

    def is_masked(self, block_id: int) -> bool:
        """Whether this block computes masked tokens only (some row reads the cache and the
        plan does not say "compute all tokens" for it)."""
        return self.reads_cache and block_id not in self.compute_all

    def is_kv(self, block_id: int) -> bool:
        """Whether the block's cache holds its keys and values, not its output (kv_layout.py)."""
        return self.kv is not None and block_id in self.kv

    def read_slots(self, block_ids: list[int]) -> list[int]:
        """The cache slots a step of `block_ids` reads: each masked block's own (its output, or
        a K/V block's keys), a K/V block's value slot, and the statistics pseudo-block when a
        sparse ResNet is masked."""
        slots = []
        for b in block_ids:
            if self.is_masked(b):
                slots += [b, self.kv.values[b]] if self.is_kv(b) else [b]
        if self.convs is not None and any(self.is_masked(b) for b in self.convs.stats):
            slots.append(self.convs.stats_block)  # the template's GroupNorm statistics
        return slots

    def tokens(self, L: int) -> TokenSet:
        ts = self._tokens.get(L)
        if ts is None:
            ts = self._tokens[L] = self._build_tokens(L)
        return ts

    def _build_tokens(self, L: int) -> TokenSet:
        idx, rows, counts = [], [], []
        full = torch.arange(L)
        for req in self.requests:
            if req.handle is not None:
                try:
                    own = req.token_index[L]
                except KeyError:
                    raise RuntimeError(f"no token mask for L={L} tokens") from None
            else:
                own = full
            for j in range(req.num_rows):
                r = req.start + j
                idx.append(own + r * L)
                rows.append(torch.full((own.numel(),), r, dtype=torch.int64))
                counts.append(own.numel())
        capacity = None if self.pad_to is None else self.pad_to.get(L)
        scatter = None
        full = torch.tensor([n == L for n in counts], dtype=torch.bool)  # before any pads
        if capacity is not None:
            scatter = _pad(idx, rows, counts, capacity, L)
        cu = torch.zeros(self.num_rows + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
        cu_k = torch.arange(self.num_rows + 1, dtype=torch.int32) * L
        dev = self.device
        flat_idx = torch.cat(idx).to(dev, non_blocking=True)
        return TokenSet(
            L=L,
            flat_idx=flat_idx,
            row_of=torch.cat(rows).to(dev, non_blocking=True),
            cu_q=cu.to(dev, non_blocking=True),
            cu_k=cu_k.to(dev, non_blocking=True),
            # padded: a bound fixed by the bucket (no row has more than L queries)
            max_q=L if capacity is not None else (max(counts) if counts else 0),
            num_rows=self.num_rows,
            scatter_idx=None if scatter is None else torch.cat(scatter).to(dev, non_blocking=True),
            full_rows=full.to(dev, non_blocking=True),
        )

    def prepare_tokens(self) -> None:
        """Build the TokenSet of every grid length the cache-reading requests' masks cover
        (tokens() builds them lazily otherwise). Their host -> device copies cannot run inside
        a CUDA-graph capture; everything else the blocks build (joint sets, row offsets) is
        made by device ops."""
        for L in sorted({L for r in self.requests if r.handle is not None for L in r.token_index}):
            self.tokens(L)
        if self.convs is not None and self.reads_cache and self.pad_to is None:
            # (padded: conv blocks compute whole maps and scatter by the token sets above)
            for kind, level in set(self.convs.blocks.values()):
                hw = (self.latent_hw[0] >> level, self.latent_hw[1] >> level)
                self.dense_rows(hw[0] * hw[1])
                self.tiles(kind, hw)

    # ---- sparse conv blocks (conv_blocks.py) ------------------------------------------------
    def is_map_block(self, block_id: int) -> bool:
        """A conv block: its output is read after the next block (skip connections), so it is
        never loaded into the loader's staging ring (map_buffer)."""
        return self.convs is not None and block_id in self.convs.blocks

    def dense_rows(self, L: int) -> torch.Tensor | None:
        """(k,) int64 device indices of the rows that compute every token of a conv block with an
        L-token output grid by its stock forward (own GroupNorm statistics): rows without a
        cache, and rows whose mask covers the whole grid (so a mask of ratio 1.0 equals full
        computation whatever the cache holds); None if there are none."""
        key = ("dense_rows", L)
        if key not in self._joint:
            rows = [req.start + j for req in self.requests if self._dense(req, L)
                    for j in range(req.num_rows)]  # fmt: skip
            self._joint[key] = (
                torch.tensor(rows, dtype=torch.int64).to(self.device) if rows else None
            )
        return self._joint[key]

    @staticmethod
    def _dense(req: RequestRows, L: int) -> bool:
        if req.handle is None:
            return True
        if L not in req.token_index:
            raise RuntimeError(f"no token mask for L={L} tokens")
        return req.token_index[L].numel() == L

    def tiles(self, kind: str, out_hw: tuple[int, int]) -> TileSet:
        """The active tiles of every sparse row (cache-reading, mask not covering the grid) for a
        `kind` block with output grid out_hw."""
        key = ("tiles", kind, out_hw)
        ts = self._joint.get(key)
        if ts is None:
            L = out_hw[0] * out_hw[1]
            rows = [(req.start + j, req.token_index[L]) for req in self.requests
                    if not self._dense(req, L) for j in range(req.num_rows)]  # fmt: skip
            ts = self._joint[key] = build_tiles(kind, out_hw, rows).to(self.device)
        return ts

    def ones(self, n: int) -> torch.Tensor:
        """(n,) bool, all set, on the device (built once per step)."""
        if ("ones", n) not in self._joint:
            self._joint[("ones", n)] = torch.ones(n, dtype=torch.bool, device=self.device)
        return self._joint[("ones", n)]

    def map_buffer(
        self, block_id: int, shape: tuple[int, int, int], dtype: torch.dtype
    ) -> torch.Tensor:
        """A fresh (R, L, C) tensor whose cache-reading rows hold the block's cached output
        (other rows uninitialised)."""
        self.masked_blocks.append(block_id)
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self._fill_cached(block_id, out)
        return out

    def put_stats(self, block_id: int, stats: torch.Tensor) -> None:
        """Capture: a ResNet's (R, width) GroupNorm statistics (rows that capture are valid)."""
        self._stats_out[block_id] = stats

    def flush_stats(self, dtype: torch.dtype) -> None:
        """Capture, after the backbone's forward: hand each capturing request's statistics of
        every ResNet (one row vector) to its writer as the stats pseudo-block."""
        if self.convs is None or not self.capturing:
            return
        missing = set(self.convs.stats) - set(self._stats_out)
        if missing:
            raise RuntimeError(f"ResNets {sorted(missing)} ran without recording statistics")
        order = sorted(self.convs.stats, key=lambda b: self.convs.stats[b][0])
        vec = torch.cat([self._stats_out[b] for b in order], dim=1)
        for req in self.requests:
            if req.writer is not None:
                rows = vec[req.start : req.start + req.num_rows]
                req.writer.put_block(req.step, self.convs.stats_block, encode_stats(rows, dtype))
        self._stats_out.clear()

    def conv_stats(self, block_id: int, dtype: torch.dtype) -> torch.Tensor:
        """(R, width) the template's statistics of ResNet `block_id` at this step for every
        cache-reading row (other rows: zeros); `dtype`: the activations' (the cache's) dtype."""
        assert self.convs is not None
        if self._stats_in is None:
            enc = torch.zeros((self.num_rows, 1, 2 * self.convs.width), dtype=dtype,
                              device=self.device)  # fmt: skip
            self._fill_cached(self.convs.stats_block, enc)
            self._stats_in = decode_stats(enc)
        off, width = self.convs.stats[block_id]
        return self._stats_in[:, off : off + width]

    def row_offsets(self, length: int) -> torch.Tensor:
        """(R + 1,) int32 offsets r * length on the device (keys of equal length per row)."""
        key = ("rows", length)
        cu = self._joint.get(key)
        if cu is None:
            rows = torch.arange(self.num_rows + 1, dtype=torch.int32, device=self.device)
            cu = self._joint[key] = rows * length
        return cu

    def joint(self, L: int, text_len: int) -> JointSet:
        js = self._joint.get((L, text_len))
        if js is None:
            js = self._joint[(L, text_len)] = self._build_joint(self.tokens(L), text_len)
        return js

    def _build_joint(self, ts: TokenSet, tt: int) -> JointSet:
        R, L, dev = self.num_rows, ts.L, ts.flat_idx.device
        rows = torch.arange(R, device=dev)
        pos_img = ts.flat_idx - ts.row_of * L  # (T,) image position within its row
        img_pos = torch.arange(ts.total, device=dev) + (ts.row_of + 1) * tt
        q_start = ts.cu_q[:-1].to(torch.int64) + rows * tt  # first packed query of each row
        txt_pos = (q_start[:, None] + torch.arange(tt, device=dev)[None]).reshape(-1)
        Q = R * tt + ts.total
        pos_in_row = torch.empty(Q, dtype=torch.int64, device=dev)
        pos_in_row[txt_pos] = torch.arange(tt, device=dev).repeat(R)
        pos_in_row[img_pos] = tt + pos_img
        row_of = torch.empty(Q, dtype=torch.int64, device=dev)
        row_of[txt_pos] = rows.repeat_interleave(tt)
        row_of[img_pos] = ts.row_of
        cu_rows = torch.arange(R + 1, device=dev, dtype=torch.int32)
        return JointSet(
            sel=row_of * (tt + L) + pos_in_row,
            txt_pos=txt_pos,
            img_pos=img_pos,
            pos_in_row=pos_in_row,
            row_of=row_of,
            cu_q=ts.cu_q + cu_rows * tt,
            cu_k=cu_rows * (tt + L),
            max_q=ts.max_q + tt,
        )

    def cached_rows(self, block_id: int) -> list[tuple[int, torch.Tensor]]:
        """(first batch row, cached (rows, L, C) tensor) for every cache-reading request. A
        template captured with CFG serves a request without CFG its last (cond) row."""
        out = []
        for req in self.requests:
            if req.handle is not None:
                cached = req.handle.block(req.step, block_id)
                out.append((req.start, cached[cached.shape[0] - req.num_rows :]))
        return out

    def start_loads(self, loader: PipelinedLoader, loads: list | None = None) -> None:
        """Cached rows arrive through `loader` this step. With `loads`, they are enqueued now
        (eager steps: host -> device DMA); without, at the first block that reads them, as
        `step_loads()` (the graph form: the copies are part of the captured step)."""
        self.loader, self._loading = loader, loads is not None
        if loads is not None:
            loader.start_step(loads, list(self.block_order))

    def step_loads(self) -> list:
        """The graph form's loads: for each masked block in order, every cache-reading request's
        rows of the step its device index names (StepSlice), read in place by a copy kernel."""
        from instgenie.cache.loader import BlockLoad

        assert self.step_index is not None, "step_loads needs the graph form's step indices"
        loads = []
        for b in self.block_order:
            if not self.is_masked(b) or self.is_map_block(b) or self.is_kv(b):
                continue
            sources, shape = [], None
            for req in self.requests:
                if req.handle is None:
                    continue
                stack = req.handle.block_steps(b, self.device)  # (num_steps, rows, L, C)
                n = req.num_rows
                sources.append((req.start, StepSlice(stack[:, stack.shape[1] - n :],
                                                     self.step_index[req.start])))  # fmt: skip
                shape = (self.num_rows, stack.shape[2], stack.shape[3])
            loads.append(BlockLoad(b, shape, sources))
        return loads

    def output_buffer(self, block_id: int, like: torch.Tensor) -> torch.Tensor:
        """(R, L, C) buffer whose cache-reading rows hold the cached block output; other rows
        are uninitialised (their every token is computed and scattered in)."""
        self.masked_blocks.append(block_id)
        if self.loader is not None:
            if not self._loading:
                self._loading = True
                self.loader.start_step(self.step_loads(), list(self.block_order))
            return self.loader.take(block_id)
        out = torch.empty_like(like)
        self._fill_cached(block_id, out)
        return out

    def _fill_cached(self, block_id: int, out: torch.Tensor) -> None:
        """Copy every cache-reading request's rows of `block_id` at its step into `out` (R, L, C),
        each row contiguous (rows may be strided: a joint sequence's image part): by the device
        step index in the graph form, by the bound address tables in a bucketed graph, else
        from the handle's block."""
        if self.bound is not None:
            self.bound.copy(block_id, out)
            return
        if self.step_index is not None:
            for req in self.requests:
                if req.handle is not None:
                    stack = req.handle.block_steps(block_id, self.device)  # (S, rows, L, C)
                    first = stack.shape[1] - req.num_rows
                    for j in range(req.num_rows):  # row by row: out's rows may be strided
                        dst = out[req.start + j : req.start + j + 1]
                        src = stack[:, first + j : first + j + 1]
                        copy_cached_step(src, self.step_index[req.start], dst)
            return
        for first, cached in self.cached_rows(block_id):
            copy_rows(out[first : first + cached.shape[0]], cached, non_blocking=True)

    def compose(
        self, block_id: int, like: torch.Tensor, ts: TokenSet, fresh: torch.Tensor
    ) -> torch.Tensor:
        """The block's output (R, L, C): cached rows, with the freshly computed packed rows
        `fresh` (T, C) scattered to their tokens (a padded set's pads to a trash row past the
        output: duplicates race only there)."""
        R, L, C = like.shape
        if self.is_kv(block_id):  # nothing reads its unmasked rows (kv_layout.py): zeros
            flat = torch.zeros((R * L + 1, C), dtype=like.dtype, device=like.device)
            idx = ts.flat_idx if ts.scatter_idx is None else ts.scatter_idx
            flat.index_copy_(0, idx, fresh.to(flat.dtype))
            return flat[: R * L].view(R, L, C)
        if ts.scatter_idx is None:
            out = self.output_buffer(block_id, like)
            out.view(R * L, C).index_copy_(0, ts.flat_idx, fresh.to(out.dtype))
            return out
        if self.loader is not None:
            raise RuntimeError("padded token sets do not read through the pipelined loader")
        self.masked_blocks.append(block_id)
        flat = torch.empty((R * L + 1, C), dtype=like.dtype, device=self.device)
        out = flat[: R * L].view(R, L, C)
        self._fill_cached(block_id, out)
        flat.index_copy_(0, ts.scatter_idx, fresh.to(out.dtype))
        return out

    def block_done(self, block_id: int) -> None:
        """Every hooked block calls this after its forward (pipelined loading advances)."""
        if self.loader is not None:
            self.loader.block_done(block_id)

    def record(self, block_id: int, y: torch.Tensor) -> None:
        """Capture: hand each capturing request's rows of a block output to its writer."""
        for req in self.requests:
            if req.writer is not None:
                req.writer.put_block(req.step, block_id, y[req.start : req.start + req.num_rows])


def composition_key(batch: list) -> tuple:
    """What a step's token sets and load plan depend on: which request states (by identity —
    weak references, so a dead state never matches a new one at the same address, and a uid may
    be reused), and whether (and from where) each reads a cache. Equal keys = the same batch."""
    return tuple(
        (
            weakref.ref(s),
            s.cache_key,
            None if s.cache_handle is None else str(s.cache_handle.device),
        )
        for s in batch
    )
