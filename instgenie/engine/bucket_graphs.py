"""Bucketed step graphs: masked steps replay graphs captured at start (ExecConfig.graph_capture
"buckets", decision 0051; design in docs/proposals/graph-buckets.md).

Under continuous batching every join or leave is a new composition, and a per-composition graph
(engine/graphs.py) pays a capture of 150-270 ms — more than an eager step — before it can
replay. Here a graph belongs to a bucket (scheduler/buckets.py: R rows exactly, a packed-token
capacity per grid) instead, and is captured only while the worker warms up. What a composition
changes is data, not the graph:

- token sets: padded to the bucket's capacity (StepContext.pad_to) and copied into the entry's
  static TokenSets when the composition changes (max_q is the grid length L for every
  composition; joint sets and row offsets are device ops on them, rebuilt inside each replay);
- cached rows: read through device address tables (engine/masked/bound_rows.py) by one copy
  kernel per block, the step index of each row written before each replay;
- inputs: copied into static buffers, as for any graph.

A step takes the lowest captured rung at or above its own; one with no captured bucket (another
size, another row count, a larger ratio) runs eagerly; a step never captures while serving
(`StepGraphs.warming` is False). Only one entry is bound at a time: binding another, an eager
step, a step without a context, or a member finishing releases the previous one's sources.

Equality: a replay runs the kernels of the padded graph form, whose real rows equal the plain
path's at the same padded shape bit for bit and the unpadded plain path's within the GEMMs'
shape-dependent rounding (tests/engine/test_bucket_graphs.py; replay on CUDA:
tests/engine/test_gpu_bucket_graphs.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from instgenie.engine.kernels import optional_kernel
from instgenie.engine.masked import context as _context
from instgenie.engine.masked.bound_rows import BoundRows
from instgenie.engine.masked.context import StepContext, TokenSet, use_context
from instgenie.scheduler.buckets import Bucket

if TYPE_CHECKING:
    from instgenie.engine.graphs import StepGraphs


def end_failed_capture(device: torch.device) -> None:
    from instgenie.engine.graphs import end_failed_capture as end

    end(device)


log = logging.getLogger(__name__)

#: stands for a tensor among a call's pytree leaves (None is a real argument: attention_mask=None)
_TENSOR = object()


@dataclass
class _BucketEntry:
    static_inputs: list[torch.Tensor]
    spec: Any
    leaves: list[Any]
    #: {L: padded TokenSet} the graph reads; refilled in place on a composition change
    tokens: dict[int, TokenSet]
    bound: BoundRows
    graph: Any = None
    output: Any = None
    masked_blocks: list[int] = field(default_factory=list)
    #: its capture failed (CUDA): serving does not use it
    failed: bool = False


class BucketGraphs:
    def __init__(self, parent: StepGraphs) -> None:
        self.parent = parent
        self.entries: dict[tuple, _BucketEntry] = {}
        self._bound: _BucketEntry | None = None

    def __len__(self) -> int:
        return sum(1 for e in self.entries.values() if e.graph is not None)

    def run(
        self,
        bucket: Bucket,
        members: tuple,
        ctx: StepContext,
        block_ids: list[int],
        fn: Any,
        args: tuple,
        kwargs: dict[str, Any],
    ) -> Any:
        """fn(*args, **kwargs) under `ctx` through `bucket`'s graph: the output, or None when
        the bucket has no entry and the parent is not warming up (the caller runs eagerly).
        `members`: the composition's key (executor.composition_key)."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in flat]
        shapes = (spec, tuple(leaves), tuple((t.shape, t.dtype, t.device) for t in tensors))
        parent = self.parent
        if parent.warming:
            key = (bucket, *shapes)
            entry = self.entries.get(key)
            if entry is None and self._copy_kernel() is None:
                return None  # a CUDA graph needs the indirect copy kernel
        else:
            # serving never captures: the lowest rung at or above the step's that has a graph
            # (or, without CUDA, a graph-form entry); a failed capture's entry is not used
            entry = None
            for rung in range(bucket.rung, len(bucket.rungs)):
                b = Bucket(bucket.rows, rung, bucket.rungs)
                found = self.entries.get((b, *shapes))
                if found is not None and not found.failed:
                    bucket, key, entry = b, (b, *shapes), found
                    break
            if entry is None:
                return None
        lengths = sorted({L for r in ctx.requests if r.handle is not None for L in r.token_index})
        ctx.pad_to = {L: bucket.capacity(L) for L in lengths}
        ctx._tokens, ctx._joint = {}, {}  # padded sets, built for this bucket only
        masked = ctx.read_slots(block_ids)  # the slots its address tables name
        if entry is None:
            entry = self._new_entry(bucket, ctx, tensors, spec, leaves, masked)
            self.entries[key] = entry
        if self._bound is not entry or entry.bound.key != members:
            if not self._bind(entry, ctx, masked, members):
                return None  # a source the copy kernel cannot read: the plain path, eagerly
        for dst, src in zip(entry.static_inputs, tensors, strict=True):
            dst.copy_(src)
        entry.bound.write_steps(ctx)
        shape = ("bucket", bucket.rows, bucket.rung, tuple(tensors[0].shape))
        if entry.graph is not None:
            out = parent._timed("replay", shape, lambda: parent._replay(entry))
            ctx.masked_blocks = list(entry.masked_blocks)
            return parent._done("replay", out)
        # the graph form, eagerly: the static token sets and address tables, joint sets rebuilt
        self._use(entry, ctx)
        with use_context(ctx):
            out = parent._timed("eager", shape, lambda: parent._call(fn, entry))
        if parent.device.type != "cuda" or not parent.warming:
            # CPU: every call is the graph form's; CUDA: a bucket whose capture failed
            return parent._done("warmup", out)
        try:
            out = self._capture(entry, ctx, fn, shape)
        except Exception as exc:  # this bucket stays eager; the step's output is the eager one
            end_failed_capture(parent.device)
            entry.graph = entry.output = None
            entry.failed = True  # serving runs its steps on the plain path
            log.warning("bucket graph capture failed (%s: %s); its steps run eagerly",
                        type(exc).__name__, exc, exc_info=True)  # fmt: skip
            return parent._done("warmup", out)
        return parent._done("capture", out)

    def release(self) -> None:
        """Unbind the bound entry (its tables zeroed, its sources freed)."""
        if self._bound is not None:
            self._bound.bound.release()
            self._bound = None

    def release_dead(self) -> None:
        """Release the binding when one of its composition's request states is gone."""
        from instgenie.engine.graphs import _has_dead_ref

        if self._bound is not None and _has_dead_ref(self._bound.bound.key):
            self.release()

    # ---- internals ------------------------------------------------------------------------
    def _new_entry(self, bucket, ctx, tensors, spec, leaves, masked) -> _BucketEntry:
        ctx.prepare_tokens()
        tokens = {L: _clone_tokens(ts) for L, ts in ctx._tokens.items()}
        num_blocks = max(masked, default=0) + 1
        bound = BoundRows(num_blocks, bucket.rows, self.parent.device, self._copy_kernel())
        return _BucketEntry([t.clone() for t in tensors], spec, leaves, tokens, bound)

    def _bind(self, entry: _BucketEntry, ctx: StepContext, masked: list[int], members) -> bool:
        """Bind `ctx`'s composition to `entry`; False (nothing bound) when a source cannot be
        read by the copy kernel."""
        self.release()
        for L, static in entry.tokens.items():
            _copy_tokens(static, ctx.tokens(L))
        if not entry.bound.bind(ctx, masked, members):
            return False
        self._bound = entry
        return True

    def _copy_kernel(self) -> bool | None:
        """How a bucket copies cached rows: True, the Triton kernel (always on CUDA: a graph
        must not bake one composition's sources in); False, the torch reference (CPU, unless
        the step-copy kernel is forced on: tests under TRITON_INTERPRET=1); None: no way (CUDA
        without the kernel: no buckets)."""
        device = self.parent.device
        kernel = _context.kernel_enabled(_context.STEP_COPY, device)
        if kernel and optional_kernel("step_copy", "copy_rows_indirect") is None:
            kernel = False
        if device.type == "cuda" and not kernel:
            return None
        return kernel

    @staticmethod
    def _use(entry: _BucketEntry, ctx: StepContext) -> None:
        """Point `ctx` at the entry's static sets and tables; what the step built from its own
        sets (joint sets, the template's decoded statistics) is rebuilt from them, so a capture
        that follows an eager run of the same context records the build, not its result."""
        ctx.forget_built()
        ctx._tokens = dict(entry.tokens)
        ctx.bound, ctx.step_index = entry.bound, None
        ctx.masked_blocks = []

    def _capture(self, entry: _BucketEntry, ctx: StepContext, fn, shape) -> Any:
        parent = self.parent
        if parent._pool is None or len(parent) + len(self) == 0:
            parent._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(parent.device)
        self._use(entry, ctx)
        with use_context(ctx), torch.cuda.graph(graph, pool=parent._pool,
                                                capture_error_mode="thread_local"):  # fmt: skip
            out = parent._call(fn, entry)
        entry.graph, entry.output = graph, out
        entry.masked_blocks = list(ctx.masked_blocks)
        return parent._timed("capture", shape, lambda: parent._replay(entry))


def _clone_tokens(ts: TokenSet) -> TokenSet:
    """A TokenSet with its own tensors (the graph's static sets)."""
    return TokenSet(
        L=ts.L,
        flat_idx=ts.flat_idx.clone(),
        row_of=ts.row_of.clone(),
        cu_q=ts.cu_q.clone(),
        cu_k=ts.cu_k.clone(),
        max_q=ts.max_q,
        num_rows=ts.num_rows,
        scatter_idx=None if ts.scatter_idx is None else ts.scatter_idx.clone(),
        full_rows=None if ts.full_rows is None else ts.full_rows.clone(),
    )


def _copy_tokens(static: TokenSet, ts: TokenSet) -> None:
    """A composition's padded set into the graph's static one (same bucket: same shapes)."""
    if (static.total, static.max_q, static.num_rows) != (ts.total, ts.max_q, ts.num_rows):
        raise RuntimeError(f"token set {ts.total}/{ts.max_q} does not fit {static.total}")
    static.flat_idx.copy_(ts.flat_idx)
    static.row_of.copy_(ts.row_of)
    static.cu_q.copy_(ts.cu_q)
    static.cu_k.copy_(ts.cu_k)
    assert static.scatter_idx is not None and ts.scatter_idx is not None
    static.scatter_idx.copy_(ts.scatter_idx)
    assert static.full_rows is not None and ts.full_rows is not None
    static.full_rows.copy_(ts.full_rows)
