"""The pinned host staging buffers of disk captures and streamed reads (cache/disk_stream.py):
step-sized buffers handed from handle to handle, and typed views of one step's slabs in them.

- `StagingPool` owns the staging buffers: page-aligned anonymous mappings, pinned with
  hostmem.pin once when allocated (CUDA machines; the loader's H2D copies are then DMA), reused by
  handle after handle, unpinned only when dropped beyond `keep_bytes` of free buffers. On CUDA a
  buffer handed back (or a slot reused) carries an event recorded on the consumer's current
  stream; it is not overwritten before that event completes (asynchronous copies out of it).
- `StepViews`: the slabs of one step (same offsets as layout.py) in a buffer holding only it.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from instgenie.cache.hostmem import pin, unpin
from instgenie.cache.layout import TemplateLayout, align_up, view_slab

PAGE = 4096
#: free staging bytes a pool keeps (pinned) for the next handle; beyond, buffers are freed
DEFAULT_KEEP_BYTES = 8 << 30


def cuda_event() -> Any:
    """An event on this thread's current CUDA stream (None without CUDA in use): work enqueued
    so far, e.g. the copies out of a staging buffer, is done when it completes."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


# ---- staging buffers -----------------------------------------------------------------------------
@dataclass(eq=False)
class StagingBuffer:
    #: page-aligned uint8 CPU tensor of `nbytes` (a multiple of PAGE)
    data: torch.Tensor
    nbytes: int
    pinned: bool
    #: CUDA event the last user recorded; the buffer is not written before it completes
    event: Any = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class StagingPool:
    """Page-aligned host buffers, pinned once when allocated, reused across handles."""

    def __init__(self, keep_bytes: int = DEFAULT_KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[StagingBuffer] = []
        self._lock = threading.Lock()
        #: buffers alive (in use or free) and their bytes; allocations (= pin calls) so far
        self.live, self.live_bytes, self.allocations = 0, 0, 0

    def take(self, nbytes: int, count: int) -> list[StagingBuffer]:
        """`count` buffers of at least nbytes each (free ones reused, smallest fit first). The
        taker waits for a buffer's event (StagingBuffer.wait) before writing into it."""
        size = align_up(max(nbytes, 1), PAGE)
        out: list[StagingBuffer] = []
        with self._lock:
            for b in sorted(self._free, key=lambda b: b.nbytes):
                if len(out) < count and b.nbytes >= size:
                    out.append(b)
            for b in out:
                self._free.remove(b)
        try:
            while len(out) < count:
                out.append(self._allocate(size))
        except BaseException:
            self.give(out)
            raise
        return out

    def _allocate(self, size: int) -> StagingBuffer:
        # an anonymous mapping: page-aligned (aligned I/O, whole pages to pin); numpy holds the
        # mapping's buffer export, so it is unmapped only when the last view is gone
        t = torch.from_numpy(np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8))
        buf = StagingBuffer(t, size, pinned=pin(t))
        with self._lock:
            self.live += 1
            self.live_bytes += size
            self.allocations += 1
        return buf

    def give(self, bufs: list[StagingBuffer]) -> None:
        """Hand buffers back (their events set by the caller); beyond keep_bytes of free
        buffers the largest are dropped (unpinned once their copies are done)."""
        drop: list[StagingBuffer] = []
        with self._lock:
            self._free.extend(bufs)
            self._free.sort(key=lambda b: b.nbytes)
            while self._free and sum(b.nbytes for b in self._free) > self.keep_bytes:
                drop.append(self._free.pop())
            self.live -= len(drop)
            self.live_bytes -= sum(b.nbytes for b in drop)
        for b in drop:
            b.wait()
            if b.pinned:
                unpin(b.data)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def clear(self) -> None:
        """Drop every free buffer (buffers in use are dropped when handed back)."""
        keep, self.keep_bytes = self.keep_bytes, 0
        try:
            self.give([])
        finally:
            self.keep_bytes = keep


def _step_view(layout: TemplateLayout, buf: torch.Tensor, off: int, step: int,
               shape: tuple[int, ...], dtype: str) -> torch.Tensor:  # fmt: skip
    """A slab of step `step` (its byte offset in the whole template: off) in a buffer holding
    only that step."""
    return view_slab(buf, off - step * layout.step_nbytes, shape, dtype)


class StepViews:
    """Typed views of one step's slabs in a step-sized buffer (same offsets as layout.py)."""

    def __init__(self, layout: TemplateLayout) -> None:
        self.layout = layout

    def block(self, buf: torch.Tensor, step: int, block: int) -> torch.Tensor:
        off, shape = self.layout.slab(step, block)
        return _step_view(self.layout, buf, off, step, shape, self.layout.dtype)

    def scales(self, buf: torch.Tensor, step: int, block: int) -> torch.Tensor:
        off, shape = self.layout.scale_slab(step, block)
        return _step_view(self.layout, buf, off, step, shape, "float32")

    def latents(self, buf: torch.Tensor, step: int) -> torch.Tensor:
        off, shape = self.layout.latents_slab(step)
        return _step_view(self.layout, buf, off, step, shape, self.layout.latent_dtype)
