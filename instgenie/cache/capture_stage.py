"""Capture copies off the serving loop: device -> pinned staging slot (async DMA) -> DRAM segment
(a host thread backs the segment's pages and copies), so a capture never waits for page
allocation or page registration (decision 0046).

Why: a capture's new /dev/shm segment must be backed, its pages faulted into this process and
registered as pinned memory before a block can be DMA'd straight into it; cudaHostRegister of a
fresh segment faults every page in while it holds the CUDA driver's lock, so every CUDA call of
the loop waits (8 GiB: 2.74 s alone; one loop step of 2.31 s beside a 4.7 ms loop, and a 6.1 s
first capture step of SDXL 1024², 15.0 s of Flux: docs/benchmarks/pin-stall-h200.md). Faulting
pages in without CUDA (madvise, memcpy) runs beside the loop without slowing it. Here the loop
only enqueues a DMA into a slot of a small pool pinned once per process; `threads` host threads
wait for each slot's copy, back the destination's pages (`back`: Segment.back, madvise
MADV_POPULATE_WRITE, which the threads run in parallel and which reports a full /dev/shm as an
error, not a SIGBUS) and memcpy the slot into the segment. Registering the finished segment for
readers (TemplateWriter.commit) then only locks pages already faulted in (0.34 s for 8 GiB).

Invariants: a slot is reused only after its bytes reached their destination; a ticket's
`drain` returns only after every copy of that ticket landed (or raises its first error); the
loop blocks only when every slot is in flight (back-pressure, never unbounded memory). Sources on
CPU are copied into the slot synchronously (tests exercise the whole path on CPU).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

#: bytes per staging slot; a larger tensor is copied as several slots' worth
SLOT_BYTES = 32 << 20
#: slots per process (SLOTS x SLOT_BYTES pinned host memory, allocated at first use)
SLOTS = 16
#: host threads backing and copying: page allocation runs at ≈ 3.4 GB/s per thread (H200 host),
#: a capture step produces ≈ 3 GB/s (SDXL 1024²) to ≈ 7 GB/s (Flux 1024²)
THREADS = 8


@dataclass
class StageTicket:
    """One writer's copies: how many are in flight, and the first error among them."""

    outstanding: int = 0
    error: BaseException | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)


@dataclass
class _Job:
    ticket: StageTicket
    slot: int
    nbytes: int
    dst: torch.Tensor  # uint8 host view, nbytes long
    event: torch.cuda.Event | None
    back: Callable[[], None] | None


class CaptureStager:
    """A process's staging pool and copy threads; `copy` is called from one loop thread."""

    def __init__(self, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS, threads: int = THREADS):
        if slot_bytes <= 0 or slots <= 0 or threads <= 0:
            raise ValueError("slot_bytes, slots and threads must be positive")
        self.slot_bytes, self.n_slots, self.n_threads = slot_bytes, slots, threads
        self._slots: list[torch.Tensor] = []
        self._free: queue.Queue[int] = queue.Queue()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        #: bytes copied and how long the loop waited for a free slot (seconds)
        self.bytes_copied = 0
        self.wait_s = 0.0

    # ---- setup -----------------------------------------------------------------------------
    def _start(self) -> None:
        with self._lock:
            if self._threads:
                return
            pin = torch.cuda.is_available()
            with torch.inference_mode(False):  # normal tensors: writable in and out of it
                self._slots = [
                    torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=pin)
                    for _ in range(self.n_slots)
                ]
            for i in range(self.n_slots):
                self._free.put(i)
            for i in range(self.n_threads):
                th = threading.Thread(target=self._run, name=f"capture-stage-{i}", daemon=True)
                th.start()
                self._threads.append(th)

    def warm(self) -> None:
        """Allocate (pin) the slots and start the threads now, e.g. at worker start."""
        self._start()

    # ---- the loop's side -------------------------------------------------------------------
    def copy(
        self,
        ticket: StageTicket,
        dst: torch.Tensor,
        src: torch.Tensor,
        back: Callable[[int, int], None] | None = None,
    ) -> None:
        """dst.copy_(src) through the staging slots, returning before the bytes land. `dst`: a
        contiguous host view (its dtype is the cast's); `back(ptr, nbytes)`: run by the copy
        thread before it writes dst's bytes [ptr, ptr + nbytes) (backs those pages). Raises the
        ticket's first error, if any copy of it already failed."""
        if ticket.error is not None:
            raise ticket.error
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"shape {tuple(src.shape)} != {tuple(dst.shape)}")
        if not dst.is_contiguous():
            raise ValueError("destination view must be contiguous")
        self._start()
        data = src.detach().to(dst.dtype).contiguous().reshape(-1).view(torch.uint8)
        out = dst.reshape(-1).view(torch.uint8)
        stream = torch.cuda.current_stream(src.device) if src.is_cuda else None
        for start in range(0, out.numel(), self.slot_bytes):
            n = min(self.slot_bytes, out.numel() - start)
            slot = self._take_slot()
            self._slots[slot][:n].copy_(data[start : start + n], non_blocking=src.is_cuda)
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
            part = out[start : start + n]
            job_back = None
            if back is not None:
                job_back = _bind(back, part.data_ptr(), n)
            with ticket.cond:
                ticket.outstanding += 1
            self._jobs.put(_Job(ticket, slot, n, part, event, job_back))

    def _take_slot(self) -> int:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        t0 = time.perf_counter()
        slot = self._free.get()
        self.wait_s += time.perf_counter() - t0
        return slot

    def drain(self, ticket: StageTicket) -> None:
        """Wait until every copy of `ticket` landed; raise its first error."""
        with ticket.cond:
            ticket.cond.wait_for(lambda: ticket.outstanding == 0)
        if ticket.error is not None:
            raise ticket.error

    # ---- the copy threads ------------------------------------------------------------------
    def _run(self) -> None:
        # inference mode is per thread: views created under the loop's (the segment's, the
        # slots') may only be written under it
        with torch.inference_mode():
            self._serve()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job.ticket.error is None:  # after a failure the ticket's copies are moot
                    if job.event is not None:
                        job.event.synchronize()
                    if job.back is not None:
                        job.back()
                    job.dst.copy_(self._slots[job.slot][: job.nbytes])
                    with self._lock:
                        self.bytes_copied += job.nbytes
            except BaseException as exc:  # reported to the writer at its next copy or drain
                log.warning("capture staging copy failed: %s: %s", type(exc).__name__, exc)
                if job.ticket.error is None:
                    job.ticket.error = exc
            finally:
                self._free.put(job.slot)
                with job.ticket.cond:
                    job.ticket.outstanding -= 1
                    job.ticket.cond.notify_all()
                job = None  # no view of the segment outlives its copy (it could not be unmapped)

    def close(self) -> None:
        """Stop the threads once the queued copies are done (tests; processes exit without)."""
        for _ in self._threads:
            self._jobs.put(None)
        for th in self._threads:
            th.join()
        self._threads = []


def _bind(back: Callable[[int, int], None], ptr: int, n: int) -> Callable[[], None]:
    return lambda: back(ptr, n)


_SHARED: CaptureStager | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> CaptureStager:
    """This process's stager (created at first use)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = CaptureStager()
        return _SHARED
