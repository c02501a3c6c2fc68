"""Block-wise pipelined loading of cached activations (paper §4.2, Fig. 9).

Per denoising step, the cached rows of every block that uses the cache are copied host -> GPU on a
dedicated copy stream, `depth` blocks ahead of the compute stream, into a small ring of staging
buffers. A block's staging buffer *is* its output buffer: the masked forward scatters its freshly
computed rows into it, so no second device copy is made.

Ordering (all on the device, no host waits):
- load of block b into buffer k waits (copy stream) for the event "the consumer of buffer k's
  previous occupant has finished" — the consumer of block a's output is the next hooked block
  a + 1, whose end the compute stream records;
- block b's use of its buffer waits (compute stream) for the event "load of b finished".
Loads are enqueued lazily from the compute thread (at step start and after each block), because a
stream cannot wait on an event that has not been recorded yet.

`CopyEngine` abstracts streams/events: `CudaCopyEngine` drives real CUDA streams; tests use a
simulated engine that checks the ordering invariants on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from instgenie.cache.quant import QuantizedRows, copy_rows


class IndexedSource(Protocol):
    """A source that copies itself with device ops only (graph-safe; e.g. a step of a stack
    chosen by a device-side index: engine.masked.context.StepSlice)."""

    shape: torch.Size
    nbytes: int

    def copy_into(self, dst: torch.Tensor) -> None: ...


#: what a load copies from: host rows (DMA), fp8 rows (dequantised on the way), or an
#: IndexedSource (a kernel reads it in place, inside a CUDA graph if one is being captured)
Source = torch.Tensor | QuantizedRows | IndexedSource


def _copy(dst: torch.Tensor, src: Source, non_blocking: bool) -> None:
    if isinstance(src, (torch.Tensor, QuantizedRows)):
        copy_rows(dst, src, non_blocking=non_blocking)
    else:
        src.copy_into(dst)


class CopyEngine(Protocol):
    def event(self) -> Any: ...
    def record_compute(self, event: Any) -> None: ...
    def record_copy(self, event: Any) -> None: ...
    def copy_waits(self, event: Any) -> None: ...
    def compute_waits(self, event: Any) -> None: ...
    def copy(self, dst: torch.Tensor, src: Source) -> None: ...
    def copies(self, pairs: list[tuple[torch.Tensor, Source]]) -> None: ...
    def session(self) -> contextlib.AbstractContextManager: ...
    def synchronize(self) -> None: ...


class CudaCopyEngine:
    """Real streams: copies run on a side stream; the compute stream is the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._active = False

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record_compute(self, event: torch.cuda.Event) -> None:
        event.record(torch.cuda.current_stream(self.device))

    def record_copy(self, event: torch.cuda.Event) -> None:
        event.record(self.stream)

    def copy_waits(self, event: torch.cuda.Event) -> None:
        self.stream.wait_event(event)

    def compute_waits(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def copy(self, dst: torch.Tensor, src: Source) -> None:
        self.copies([(dst, src)])

    def copies(self, pairs: list[tuple[torch.Tensor, Source]]) -> None:
        # fp8 rows are copied as bytes and dequantised on the copy stream, so the compute
        # stream only ever sees compute-dtype rows
        with self.session():
            for dst, src in pairs:
                _copy(dst, src, non_blocking=True)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Make the copy stream current once for many copies (a stream switch costs host time
        that a launch-bound step cannot spare)."""
        if self._active:
            yield
            return
        self._active = True
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self._active = False

    def synchronize(self) -> None:
        self.stream.synchronize()


class SyncCopyEngine:
    """Devices without streams (CPU): copies happen at once, in program order; events are inert."""

    def event(self) -> None:
        return None

    def record_compute(self, event: None) -> None:
        pass

    def record_copy(self, event: None) -> None:
        pass

    def copy_waits(self, event: None) -> None:
        pass

    def compute_waits(self, event: None) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: Source) -> None:
        _copy(dst, src, non_blocking=False)

    def copies(self, pairs: list[tuple[torch.Tensor, Source]]) -> None:
        for dst, src in pairs:
            _copy(dst, src, non_blocking=False)

    def session(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass


def copy_engine_for(device: torch.device) -> CopyEngine:
    return CudaCopyEngine(device) if device.type == "cuda" else SyncCopyEngine()


@dataclass
class BlockLoad:
    """One block's load for this step: where each source tensor goes in the (R, L, C) buffer."""

    block_id: int
    shape: tuple[int, int, int]
    #: (first row, source of (rows, L, C)) per cache-reading request
    sources: list[tuple[int, Source]]

    @property
    def nbytes(self) -> int:
        return sum(int(src.nbytes) for _, src in self.sources)


@dataclass
class _Slot:
    position: int  # index in this step's load list
    ready: Any = None  # event: load finished


@dataclass
class PipelinedLoader:
    engine: CopyEngine
    device: torch.device
    dtype: torch.dtype
    #: most staging buffers in the ring (>= 2: one being computed into, one being loaded)
    num_buffers: int = 3
    #: device memory the ring may use, bytes; the ring grows up to one buffer per loaded block
    #: within it, so small steps enqueue every load at once (no per-block host work)
    max_staging_bytes: int = 0
    _ring: list[torch.Tensor] = field(default_factory=list)
    _loads: list[BlockLoad] = field(default_factory=list)
    _slots: dict[int, _Slot] = field(default_factory=dict)
    _done: dict[int, Any] = field(default_factory=dict)  # block id -> end-of-block event
    _next: int = 0  # next load position to enqueue
    _order: list[int] = field(default_factory=list)  # hooked block ids in execution order
    #: bytes copied this step (observability)
    bytes_loaded: int = 0
    on_copy: Callable[[int, int], None] | None = None

    def start_step(self, loads: list[BlockLoad], block_order: list[int]) -> None:
        """Plan this step's loads (in block order) and enqueue the first ones."""
        if self.num_buffers < 2:
            raise ValueError("pipelined loading needs at least 2 staging buffers")
        self._loads, self._order = loads, block_order
        self._slots = {ld.block_id: _Slot(p) for p, ld in enumerate(loads)}
        self._done, self._next, self.bytes_loaded = {}, 0, 0
        need = max((ld.shape[0] * ld.shape[1] * ld.shape[2] for ld in loads), default=0)
        size = self.dtype.itemsize * need
        fit = self.max_staging_bytes // size if size else 0
        count = max(self.num_buffers, min(len(loads), fit))
        if need and (len(self._ring) < count or self._ring[0].numel() < need):
            # the old ring may still be read/written by queued work: drain before freeing it
            # (a first ring may be allocated inside a CUDA-graph capture: nothing to drain)
            if self._ring:
                self.engine.synchronize()
            self._ring = [torch.empty(need, dtype=self.dtype, device=self.device)
                          for _ in range(count)]  # fmt: skip
        # the previous step's work on the ring must finish before this step overwrites it
        step_start = self.engine.event()
        self.engine.record_compute(step_start)
        self.engine.copy_waits(step_start)
        self._pump()

    def _buffer(self, position: int) -> torch.Tensor:
        shape = self._loads[position].shape
        n = shape[0] * shape[1] * shape[2]
        return self._ring[position % len(self._ring)][:n].view(shape)

    def _consumer(self, block_id: int) -> int | None:
        """The hooked block that reads `block_id`'s output (the next one in order)."""
        i = self._order.index(block_id)
        return self._order[i + 1] if i + 1 < len(self._order) else None

    def _pump(self) -> None:
        """Enqueue every load whose staging buffer is free by now."""
        with self.engine.session():
            self._pump_loads()

    def _pump_loads(self) -> None:
        ring = len(self._ring)
        while self._next < len(self._loads):
            pos = self._next
            if pos >= ring:
                prev = self._loads[pos - ring].block_id
                consumer = self._consumer(prev)
                # the previous occupant's consumer must have been recorded as done
                if consumer is None or consumer not in self._done:
                    return
                self.engine.copy_waits(self._done[consumer])
            ld, buf = self._loads[pos], self._buffer(pos)
            self.engine.copies(
                [(buf[first : first + src.shape[0]], src) for first, src in ld.sources]
            )
            ready = self.engine.event()
            self.engine.record_copy(ready)
            self._slots[ld.block_id].ready = ready
            self.bytes_loaded += ld.nbytes
            if self.on_copy is not None:
                self.on_copy(ld.block_id, ld.nbytes)
            self._next += 1

    def take(self, block_id: int) -> torch.Tensor:
        """The staging buffer of `block_id`, its cached rows loaded (compute stream waits)."""
        slot = self._slots[block_id]
        if self._next <= slot.position:
            raise RuntimeError(f"block {block_id} was not loaded before its use")
        self.engine.compute_waits(slot.ready)
        return self._buffer(slot.position)

    def block_done(self, block_id: int) -> None:
        """Called after every hooked block's forward has been enqueued."""
        if self._next >= len(self._loads):
            return  # every load is already enqueued: nothing can wait for this block
        ev = self.engine.event()
        self.engine.record_compute(ev)
        self._done[block_id] = ev
        self._pump()
