"""CUDA-graph replay of a denoising step's backbone call.

Small batches are host-bound: a batch-1 SDXL step issues thousands of kernels from eager Python,
and the GPU idles ~60 % of a masked step (docs/benchmarks/masked-step-h200.md). In a serving
loop the batch's composition (the same request states, the same block plan) repeats for many
consecutive steps, so each composition is captured once and replayed:

- call 1 of a composition runs eagerly on the static input buffers and in the graph form of the
  step context (warms Triton's JIT, cuBLAS handles and the composition's token sets);
- call 2 captures that same code, then replays it;
- later calls copy the new inputs into the static buffers, write every cache-reading request's
  step index into a device scalar, and replay.

Cached rows are read inside the graph from the store's per-block stack (`handle.block_steps`) at
a step index held in a device tensor (triton_kernels/step_copy.py on CUDA, `index_select`
elsewhere), so one graph serves every step of its composition.
Invariant: a replay runs the same kernels in the same order as the eager graph form, which in
turn computes exactly what the plain masked path computes (tests/test_graphs.py on CPU checks the
graph form; tests marked gpu check replay). A failed capture turns graphs off for the executor
and the step runs eagerly (logged once).

Modes (INSTGENIE_CUDA_GRAPHS): "all" (default) graphs every eligible batch, "masked" only
batches that read a template cache, "off" none. Ineligible: CPU, capture runs (block outputs are
handed to a writer), timers and pipelined host loads (they synchronise with other streams),
caches without per-block stacks (fp8, host tiers), an active dispatch mode (FLOP counting).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _get_current_dispatch_mode

from instgenie.engine.masked.context import StepContext, use_context

log = logging.getLogger(__name__)

MODES = ("all", "masked", "off")


@dataclass
class _Entry:
    """One composition's static buffers and, after its second call, its graph."""

    static_inputs: list[torch.Tensor]
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list[Any]  # non-tensor leaves; tensors are taken from static_inputs
    #: first batch row of each cache-reading request -> (1,) int64 step index on the device
    step_index: dict[int, torch.Tensor] | None
    calls: int = 0
    graph: Any = None
    output: torch.Tensor | None = None
    #: what the captured StepContext recorded (replays do not run the Python blocks)
    masked_blocks: list[int] = field(default_factory=list)
    #: token sets the graph reads (kept alive with it)
    tokens: tuple = ()


class StepGraphs:
    def __init__(self, device: torch.device, mode: str = "all", max_graphs: int = 4) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown CUDA graph mode {mode!r}; choose one of {MODES}")
        self.device = device
        self.mode = mode
        #: compositions kept (least recently used dropped first); each holds a graph
        self.max_graphs = max_graphs
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._pool = None
        #: "eager" | "warmup" | "capture" | "replay": what the last call did (step log)
        self.last: str = "eager"
        self.counters = {"warmup": 0, "capture": 0, "replay": 0, "eager": 0}
        #: the graph form without CUDA (tests: the static path is checked on CPU)
        self.force_static = False

    # ---- eligibility ---------------------------------------------------------------------
    def eligible(self, ctx: StepContext | None, dtype: torch.dtype, block_ids: list[int]) -> bool:
        """Whether a step with this context can run as a graph; `dtype` is the activations'."""
        if self.mode == "off" or _get_current_dispatch_mode() is not None:
            return False
        if self.device.type != "cuda" and not self.force_static:
            return False
        if ctx is None:
            return self.mode == "all"
        if not ctx.reads_cache and self.mode == "masked":
            return False
        if ctx.capturing or ctx.timer is not None or ctx.loader is not None:
            return False
        for req in ctx.requests:
            h = req.handle
            if h is None:
                continue
            if h.device != self.device or not hasattr(h, "block_steps"):
                return False
            for b in (b for b in block_ids if ctx.is_masked(b)):
                stack = h.block_steps(b)
                if stack is None or stack.dtype != dtype:
                    return False
        return True

    # ---- running -------------------------------------------------------------------------
    def run(
        self,
        key: tuple,
        ctx: StepContext | None,
        fn: Callable[..., torch.Tensor],
        args: tuple,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """fn(*args, **kwargs) under `ctx`, through the composition's graph. `key` must identify
        the composition (executor.composition_key plus the plan); the graph is reused only
        while tensor shapes, dtypes and every non-tensor argument are unchanged."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        leaves = [None if isinstance(x, torch.Tensor) else x for x in flat]
        full_key = (
            key,
            spec,
            tuple(leaves),
            tuple((t.shape, t.dtype, t.device) for t in tensors),
        )
        self._drop_dead()
        entry = self._entries.get(full_key)
        if entry is None:
            entry = self._new_entry(ctx, tensors, spec, leaves)
            self._entries[full_key] = entry
            while len(self._entries) > self.max_graphs:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(full_key)
            for dst, src in zip(entry.static_inputs, tensors, strict=True):
                dst.copy_(src)
        if ctx is not None and entry.step_index is not None:
            self._write_steps(entry, ctx)
            ctx.step_index = entry.step_index
        entry.calls += 1
        if entry.graph is not None:
            entry.graph.replay()
            if ctx is not None:
                ctx.masked_blocks = list(entry.masked_blocks)
            return self._done("replay", entry.output.clone())
        if entry.calls == 1 or self.device.type != "cuda":
            with use_context(ctx):
                out = self._call(fn, entry)
            return self._done("warmup", out)
        try:
            out = self._capture(ctx, fn, entry)
        except Exception as exc:  # an op that cannot be captured: stay eager from now on
            log.warning("CUDA graph capture failed (%s: %s); running eagerly",
                        type(exc).__name__, exc)  # fmt: skip
            self.mode = "off"
            self._entries.clear()
            torch.cuda.synchronize(self.device)
            if ctx is not None:
                ctx.masked_blocks = []
            with use_context(ctx):
                out = self._call(fn, entry)
            return self._done("eager", out)
        return self._done("capture", out)

    @staticmethod
    def _write_steps(entry: _Entry, ctx: StepContext) -> None:
        """Each cache-reading request's step index into the scalar its graph reads."""
        for req in ctx.requests:
            if req.handle is not None:
                entry.step_index[req.start].fill_(req.step)

    def eager(self) -> None:
        """Record that a step ran without graphs."""
        self._done("eager", None)

    def _done(self, what: str, out: Any) -> Any:
        self.last = what
        self.counters[what] += 1
        return out

    @staticmethod
    def _call(fn: Callable[..., torch.Tensor], entry: _Entry) -> torch.Tensor:
        it = iter(entry.static_inputs)
        flat = [next(it) if leaf is None else leaf for leaf in entry.leaves]
        args, kwargs = pytree.tree_unflatten(flat, entry.spec)
        return fn(*args, **kwargs)

    def _new_entry(self, ctx, tensors, spec, leaves) -> _Entry:
        step_index = None
        if ctx is not None and ctx.reads_cache:
            step_index = {
                r.start: torch.zeros(1, dtype=torch.int64, device=self.device)
                for r in ctx.requests
                if r.handle is not None
            }
        tokens = () if ctx is None else (ctx._tokens, ctx._joint)
        return _Entry([t.clone() for t in tensors], spec, leaves, step_index, tokens=tokens)

    def _capture(self, ctx: StepContext | None, fn, entry: _Entry) -> torch.Tensor:
        if self._pool is None or len(self) == 0:
            # graphs share one memory pool (they never run concurrently and each one's output
            # is copied out before the next replay); once every graph of a pool is gone the
            # allocator retires it, and capturing into a retired pool id is an error
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with use_context(ctx), torch.cuda.graph(graph, pool=self._pool):
            out = self._call(fn, entry)
        entry.graph, entry.output = graph, out
        if ctx is not None:
            entry.masked_blocks = list(ctx.masked_blocks)
        graph.replay()  # capture records work without running it
        return out.clone()

    def _drop_dead(self) -> None:
        """Forget compositions whose request states are gone (keys hold weak references)."""
        dead = [k for k in self._entries if _has_dead_ref(k)]
        for k in dead:
            del self._entries[k]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.graph is not None)


def _has_dead_ref(key: Any) -> bool:
    if isinstance(key, tuple):
        return any(_has_dead_ref(k) for k in key)
    return hasattr(key, "__callback__") and key() is None
