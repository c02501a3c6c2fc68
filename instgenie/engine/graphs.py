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
Invariant: a replay runs the same kernels in the same order as the eager graph form, which in turn
computes exactly what the plain masked path computes (tests/engine/test_graphs.py on CPU checks the
graph form; tests marked gpu check replay). A failed capture turns graphs off for the executor and
the step runs eagerly (logged once).

Whether and when a composition is captured (ExecConfig.graph_capture, decision 0020):
- "buckets" (default; decision 0051, engine/bucket_graphs.py): only while the worker warms up
  (`warming`): a masked step pads to its bucket and replays that bucket's graph, a full-path
  step replays the graph of its shape; serving never captures, and the rest runs eagerly.
- "always": every eligible composition on its second call (the behaviour above).
- "auto": only when it is expected to pay before the composition changes. The serving
  loop passes each step's `horizon`: the steps until the batch's first member finishes (an upper
  bound; arrivals are not predicted). Each kind of call is timed per batch shape (`CallCosts`),
  and a capture needs capture + (horizon - 1) replays < horizon eager calls. A capture runs the
  step's Python under capture and instantiates the graph while the GPU idles, so it costs more
  than an eager call (in the serving benchmark, docs/benchmarks/serving-h200.md: replays 25-107
  ms, warm-ups 92-178 ms, captures 104-268 ms for SDXL 1024²). A composition not captured is
  asked again at each later call. An unknown horizon (benchmarks, scripts) or a cost measured
  fewer than COST_MIN_SAMPLES times at that shape: capture (it measures it) — except for a
  horizon of one call, which a capture never pays (e.g. a step of an edit running without its
  loading LoRA at the bound's last step, worker/batcher.py).
- "auto" also skips the warm-up once a composition of the same batch shape has been captured in
  the process: a new composition is captured on its first call, its token sets built beforehand
  (`StepContext.prepare_tokens`). Under continuous batching every join or leave of a batch
  that reads or records a cache is a new composition; a batch of full-path edits alone has no
  step context, and any batch of the same shapes replays its graph (executor.run_backbone).
  If such a first-call capture fails, the process warms up first from then on.

Modes (ExecConfig.cuda_graphs): "all" (default) graphs every eligible batch, "masked" only
batches that read a template cache, "off" none. Ineligible: CPU, capture runs (block outputs are
handed to a writer), timers, caches without per-block stacks readable on the device (fp8),
an active dispatch mode (FLOP counting).

Host-tier caches (decision 0029): a DRAM entry pinned as mapped memory offers `block_steps` as a
device view of its pages. Its rows are not read inline (PCIe would then sit on the compute
stream's critical path): each such composition owns a `PipelinedLoader` whose side-stream copies
are captured with the step — fork at step start, one copy kernel per block reading the step the
device index names, an event per block that the block's use waits on, ring reuse ordered after
the previous occupant's consumer — so replays overlap PCIe reads with compute as eager pipelined
loading does, and cost no host work per block.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _get_current_dispatch_mode

from instgenie.engine.bucket_graphs import _TENSOR, BucketGraphs
from instgenie.engine.masked.context import StepContext, use_context

log = logging.getLogger(__name__)

MODES = ("all", "masked", "off")
#: what one backbone call did, costliest first: a capture runs the step's Python under capture
#: and then replays it; a warm-up and an eager call run it eagerly; a replay only launches
CALL_KINDS = ("capture", "warmup", "eager", "replay")
CAPTURE_POLICIES = ("buckets", "auto", "always")
#: calls of one kind and batch shape whose median prices it (the newest are kept), count
COST_SAMPLES = 8
#: fewer samples than this and the cost counts as unknown (one slow first capture, e.g. a fresh
#: memory pool's allocations, must not stop a shape from ever being captured again), count
COST_MIN_SAMPLES = 3
#: timed calls whose CUDA events are not read yet; older ones are dropped unread, count
PENDING_TIMINGS = 64


class CallCosts:
    """Measured wall cost of a backbone call, ms, per kind and batch shape: "eager" (eager and
    warm-up calls), "replay", "capture" (capture, instantiation and the first replay). The
    median of the newest COST_SAMPLES calls (the first call of a process also compiles)."""

    def __init__(self) -> None:
        self._ms: dict[tuple[str, Hashable], deque[float]] = {}

    def add(self, kind: str, shape: Hashable, ms: float) -> None:
        self._ms.setdefault((kind, shape), deque(maxlen=COST_SAMPLES)).append(ms)

    def ms(self, kind: str, shape: Hashable) -> float | None:
        """The median, or None with fewer than COST_MIN_SAMPLES samples."""
        samples = self._ms.get((kind, shape))
        if samples is None or len(samples) < COST_MIN_SAMPLES:
            return None
        return statistics.median(samples)


def capture_pays(costs: CallCosts, shape: Hashable, horizon: int | None) -> bool:
    """Whether capturing now costs less than eager calls until the composition changes:
    capture + (horizon - 1) replays < horizon eager calls, `horizon` counting this call. True
    when the horizon is unknown (None) or a cost of `shape` is not measured yet; never for a
    horizon of one call (a capture runs the call's Python too, then instantiates and replays)."""
    if horizon is None:
        return True
    if horizon <= 1:
        return False
    eager, replay, capture = (costs.ms(k, shape) for k in ("eager", "replay", "capture"))
    if eager is None or replay is None or capture is None:
        return True
    return capture + (horizon - 1) * replay < horizon * eager


@dataclass
class _Entry:
    """One composition's static buffers and, after its second call, its graph."""

    static_inputs: list[torch.Tensor]
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list[Any]  # non-tensor leaves; _TENSOR marks those taken from static_inputs
    #: first batch row of each cache-reading request -> (1,) int64 step index on the device
    step_index: dict[int, torch.Tensor] | None
    calls: int = 0
    graph: Any = None
    #: the captured call's output: a tensor or a pytree of them (text encoders' ModelOutput)
    output: Any = None
    #: what the captured StepContext recorded (replays do not run the Python blocks)
    masked_blocks: list[int] = field(default_factory=list)
    #: token sets the graph reads (kept alive with it)
    tokens: tuple = ()
    #: streamed compositions: the loader whose staging ring the graph copies host rows into
    loader: Any = None


class StepGraphs:
    def __init__(
        self, device: torch.device, mode: str = "all", max_graphs: int = 4, capture: str = "auto"
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown CUDA graph mode {mode!r}; choose one of {MODES}")
        if capture not in CAPTURE_POLICIES:
            raise ValueError(f"unknown graph capture policy {capture!r}; "
                             f"choose one of {CAPTURE_POLICIES}")  # fmt: skip
        self.device = device
        self.mode = mode
        self.capture = capture
        self.costs = CallCosts()
        #: batch shapes captured at least once in this process (their lazy loads are done)
        self._captured: set[Hashable] = set()
        #: "auto" captures a new composition of a captured shape on its first call; turned off
        #: for the process when such a capture fails
        self.capture_first = True
        #: (start event, end event, kind, shape, host ms to add) of calls not read yet
        self._pending: deque[tuple] = deque(maxlen=PENDING_TIMINGS)
        #: compositions kept (least recently used dropped first); each holds a graph
        self.max_graphs = max_graphs
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._pool = None
        self.counters = dict.fromkeys(CALL_KINDS, 0)
        #: the graph form without CUDA (tests: the static path is checked on CPU)
        self.force_static = False
        #: "buckets": masked steps replay graphs captured per bucket at start
        #: (engine/bucket_graphs.py); graphs are captured only while `warming` (the worker's
        #: warm-up sets it), never while serving
        self.buckets = BucketGraphs(self)
        self.warming = False

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
            if not hasattr(h, "block_steps"):
                return False
            for b in (b for b in block_ids if ctx.is_masked(b)):
                # readable in place on the device: device memory, or pinned mapped DRAM
                stack = h.block_steps(b, self.device)
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
        make_loader: Callable[[torch.dtype], Any] | None = None,
        horizon: int | None = None,
    ) -> torch.Tensor:
        """fn(*args, **kwargs) under `ctx`, through the composition's graph. `key` must identify
        the composition (executor.composition_key plus the plan); the graph is reused only
        while tensor shapes, dtypes and every non-tensor argument are unchanged. `make_loader`
        (dtype -> PipelinedLoader), for cached rows in host memory: they are copied into the
        composition's own staging ring on a side stream, inside the graph. `horizon`: calls the
        composition is expected to make, this one included (the step plan's); None: unknown
        (capture on call 2)."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in flat]
        full_key = (
            key,
            spec,
            tuple(leaves),
            tuple((t.shape, t.dtype, t.device) for t in tensors),
        )
        self._drop_dead()
        self._read_timings()
        shape = (ctx is not None and ctx.reads_cache, tuple(tensors[0].shape) if tensors else ())
        entry = self._entries.get(full_key)
        if entry is None and self.capture == "buckets" and not self.warming:
            # nothing captured for this shape at start: eager (serving never captures)
            with use_context(ctx):
                out = self._timed("eager", shape, lambda: fn(*args, **kwargs))
            return self._done("eager", out)
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
            if make_loader is not None:
                if entry.loader is None:
                    entry.loader = make_loader(tensors[0].dtype)
                # replays reuse the captured copies; the loader keeps its last step's counts
                ctx.start_loads(entry.loader)
        entry.calls += 1
        if entry.graph is not None:
            out = self._timed("replay", shape, lambda: self._replay(entry))
            if ctx is not None:
                ctx.masked_blocks = list(entry.masked_blocks)
            return self._done("replay", out)
        first = entry.calls == 1
        if first and ctx is not None:
            # one capture-safe TokenSet per grid length, built outside any capture (a capture
            # cannot hold their host -> device copies) and kept with the entry
            ctx.prepare_tokens()
        if not self._should_capture(first, shape, horizon):
            with use_context(ctx):
                out = self._timed("eager", shape, lambda: self._call(fn, entry))
            # without CUDA (force_static) every call is the graph form's eager warm-up
            warmup = first or self.device.type != "cuda"
            return self._done("warmup" if warmup else "eager", out)
        try:
            out = self._capture(ctx, fn, entry, shape)
        except Exception as exc:
            end_failed_capture(self.device)
            entry.graph = entry.output = None  # a failure after instantiation: no half graph
            if ctx is not None:
                ctx.masked_blocks = []
                ctx.forget_built()  # built inside the failed capture
            if first:  # something in a new composition needs a warm-up: always warm up now
                log.warning("CUDA graph capture on a composition's first call failed (%s: %s);"
                            " warming up first from now on", type(exc).__name__, exc,
                            exc_info=True)  # fmt: skip
                self.capture_first = False
                self._entries = OrderedDict(
                    (k, e) for k, e in self._entries.items() if e is entry or e.graph is None
                )
            else:  # an op that cannot be captured: stay eager from now on
                log.warning("CUDA graph capture failed (%s: %s); running eagerly",
                            type(exc).__name__, exc, exc_info=True)  # fmt: skip
                self.mode = "off"
                self._entries.clear()
            with use_context(ctx):
                out = self._call(fn, entry)
            return self._done("warmup" if first else "eager", out)
        self._captured.add(shape)
        return self._done("capture", out)

    def _should_capture(self, first: bool, shape: Hashable, horizon: int | None) -> bool:
        """Whether this call of a composition without a graph captures one. "always": on call
        2. "auto": when capture_pays; on call 1 only once a composition of this batch shape
        was captured (its kernels, cuBLAS and cuDNN plans are loaded: a capture cannot load
        some of them), else after the warm-up call."""
        if self.device.type != "cuda":
            return False
        if self.capture == "buckets":  # at start only, on a shape's second call
            return self.warming and not first
        if self.capture == "always":
            return not first
        if first and not (self.capture_first and shape in self._captured):
            return False
        return capture_pays(self.costs, shape, horizon)

    @staticmethod
    def _write_steps(entry: _Entry, ctx: StepContext) -> None:
        """Each cache-reading request's step index into the scalar its graph reads."""
        for req in ctx.requests:
            if req.handle is not None:
                slot = getattr(req.handle, "slot", None)  # host windows: step % slots
                entry.step_index[req.start].fill_(req.step if slot is None else slot(req.step))

    def eager(self) -> None:
        """Record that a step ran without graphs."""
        self._done("eager", None)

    def _done(self, what: str, out: Any) -> Any:
        self.counters[what] += 1
        return out

    @staticmethod
    def _call(fn: Callable[..., torch.Tensor], entry: _Entry) -> torch.Tensor:
        it = iter(entry.static_inputs)
        flat = [next(it) if leaf is _TENSOR else leaf for leaf in entry.leaves]
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

    # ---- timing ---------------------------------------------------------------------------
    def _timed(self, kind: str, shape: Hashable, call: Callable[[], Any], host_ms: float = 0.0):
        """call(), its wall cost recorded under (kind, shape): CUDA events on the current stream
        (read later, never waited for; they include the GPU's idle gaps when the host is the
        bottleneck), host time elsewhere. `host_ms` is added (a capture's host-only work)."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            out = call()
            self.costs.add(kind, shape, host_ms + 1e3 * (time.perf_counter() - t0))
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = call()
        end.record()
        self._pending.append((start, end, kind, shape, host_ms))
        return out

    def _read_timings(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end, kind, shape, host_ms = self._pending.popleft()
            self.costs.add(kind, shape, host_ms + start.elapsed_time(end))

    @staticmethod
    def _replay(entry: _Entry) -> torch.Tensor:
        entry.graph.replay()
        # out of the graph's pool: the next replay overwrites it
        return pytree.tree_map_only(torch.Tensor, torch.clone, entry.output)

    def _capture(self, ctx: StepContext | None, fn, entry: _Entry, shape: Hashable) -> torch.Tensor:
        if self._pool is None or len(self) + len(self.buckets) == 0:
            # graphs share one memory pool (they never run concurrently and each one's output
            # is copied out before the next replay); once every graph of a pool is gone the
            # allocator retires it, and capturing into a retired pool id is an error
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()  # the GPU idles from here until the replay below
        # thread-local capture: threads of the host cache (disk stream readers waiting on a
        # staging buffer's copies, device-tier promotions) may synchronise with CUDA meanwhile
        # (global mode fails them: "operation not permitted when stream is capturing")
        with use_context(ctx), torch.cuda.graph(graph, pool=self._pool,
                                                capture_error_mode="thread_local"):  # fmt: skip
            out = self._call(fn, entry)
        entry.graph, entry.output = graph, out
        if ctx is not None:
            entry.masked_blocks = list(ctx.masked_blocks)
        host_ms = 1e3 * (time.perf_counter() - t0)
        # capture records work without running it
        return self._timed("capture", shape, lambda: self._replay(entry), host_ms)

    def _drop_dead(self) -> None:
        """Forget compositions whose request states are gone (keys hold weak references)."""
        dead = [k for k in self._entries if _has_dead_ref(k)]
        for k in dead:
            del self._entries[k]

    def start_graphs(self) -> int:
        """Entries that serve any composition: buckets, and full-path graphs (by shape)."""
        return len(self.buckets.entries) + sum(1 for k in self._entries if k[0][0] == ())

    def clear(self, keep_start: bool = False) -> None:
        """Drop the compositions' graphs. `keep_start` (the "buckets" policy after warm-up):
        keep the bucket graphs (their sources released) and the full-path graphs (keyed by
        shape: they read no cache)."""
        self.buckets.release()
        if not keep_start:
            self.buckets.entries.clear()
            self._entries.clear()
            return
        self._entries = OrderedDict((k, e) for k, e in self._entries.items() if k[0][0] == ())

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.graph is not None)


def end_failed_capture(device: torch.device) -> None:
    """Leave the device usable after a capture that raised. Such a capture never runs the CUDA
    generators' capture epilogue: the default generator stays marked as capturing and every later
    random op on the device fails ("Offset increment outside graph capture encountered
    unexpectedly"), e.g. the next model build or `torch.randn`. A capture that ends normally clears
    the mark, so one trivial graph is captured and dropped (tests/engine/test_encoder_graphs.py,
    marked gpu, checks `torch.randn` after a failed capture)."""
    torch.cuda.synchronize(device)
    try:
        with torch.cuda.device(device):
            scratch = torch.zeros(1, device=device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                scratch.add_(1)
            del graph
            torch.cuda.synchronize(device)
    except Exception as exc:  # the step still runs eagerly; random ops may fail from here on
        log.warning("could not reset CUDA graph capture state after a failed capture (%s: %s)",
                    type(exc).__name__, exc)  # fmt: skip


def costliest_mode(after: dict[str, int], before: dict[str, int]) -> str:
    """The costliest CALL_KINDS entry whose counter grew from `before` to `after` (one step's
    backbone calls), or "eager" when none did."""
    return next((k for k in CALL_KINDS if after.get(k, 0) > before.get(k, 0)), "eager")


def _has_dead_ref(key: Any) -> bool:
    if isinstance(key, tuple):
        return any(_has_dead_ref(k) for k in key)
    return hasattr(key, "__callback__") and key() is None
