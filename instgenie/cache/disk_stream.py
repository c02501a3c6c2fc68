"""Templates that do not fit the DRAM tier: captured straight to disk, read back one step at a
time (docs/decisions/0027-disk-tier-streaming.md).

- `DiskTemplateWriter` (chosen by `TieredStore.writer` when DRAM cannot hold the template whole:
  larger than the tier, or the tier full of entries in use) has TemplateWriter's interface. It
  fills one step in a staging buffer, then hashes, writes and fdatasyncs that step into the
  entry's temp file in the background while the next step fills (two step buffers in all: a
  disk slower than the capture slows the capture, memory stays bounded), and commits
  atomically: the same file format and index states as a demotion (disk: building -> ready; never
  in DRAM). The file's blocks are reserved up front (`posix_fallocate`): a full disk fails the
  capture before its first step, after one eviction round as for demotions (RELIABILITY #11).
- `StreamedTemplate` (`TieredStore.acquire(key, stream=True)` of a disk-only entry that cannot be
  loaded into DRAM) reads ONE STEP at a time into a ring of `ring` step-sized buffers (default 3):
  step s is read and verified (xxh3, every chunk) when it is first asked for, and step s + 1 is
  prefetched in a background thread while step s is used; a ring slot is reused only for a later
  step, never under the step in use. Steps are expected in increasing order (an edit); any other
  order works, only slower. The disk entry holds a reference in the host index while the handle
  is open (it is not evicted under the edit). Step 0 is read and verified at open, so an entry
  corrupt there is a plain CacheMiss (the edit runs in full); a later step that fails
  verification quarantines the entry and raises StreamCorrupt (a CorruptEntry): the edit reading
  it fails with that error (the serving loop fails the step's batch: worker/batcher.py).
- `StreamedHandle` is the engine's TemplateHandle over a StreamedTemplate (device cpu; fp8
  entries come back as QuantizedRows), chosen by `HostActivationStore.open`.

Both fill and read pinned step buffers of the store's `StagingPool` (cache/staging.py).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from instgenie.cache.disk_entry import EntryWriter
from instgenie.cache.index import CacheFull, TierDisabled
from instgenie.cache.layout import TemplateLayout
from instgenie.cache.misses import CacheMiss, StreamCorrupt, check_key
from instgenie.cache.staging import StagingBuffer, StepViews, cuda_event
from instgenie.cache.window import WindowedHandle

if TYPE_CHECKING:
    from instgenie.cache.tiered import TieredStore

log = logging.getLogger(__name__)

#: step buffers of a streamed read (the step in use, the next one prefetched, one spare so a
#: slot is not overwritten right after its step was used: asynchronous copies may still read it)
DEFAULT_RING = 3


# ---- capture straight to disk --------------------------------------------------------------------
class DiskTemplateWriter:
    """TemplateWriter's interface, into a new disk entry (see the module docstring). Blocks and
    latents of one step at a time: a step is complete with its latents (after every block);
    the next step may start then."""

    def __init__(self, store: TieredStore, key: str, layout: TemplateLayout) -> None:
        self.store, self.key, self.layout = store, check_key(key), layout
        self._views = StepViews(layout)
        disk, dram = store.disk, store.dram
        with dram.txn() as t:
            for tier in ("dram", "disk"):
                if t.idx.get(key, tier) is not None:  # a capture must not shadow any copy
                    raise ValueError(f"{key[:12]} is already {t.idx.state(key, tier)} in {tier}")
            if not disk.enabled:
                raise TierDisabled("disk: the tier is switched off")
            dram.apply(t, t.idx.reserve(key, "disk", layout.nbytes, dram.owner))
        self._entry: EntryWriter | None = None
        self._bufs: list[StagingBuffer] = []
        try:
            self._entry = disk.begin(key, layout)
            self._room(self._entry.preallocate)
            self._bufs = store.staging.take(layout.step_nbytes, 2)
            for b in self._bufs:
                b.wait()  # a streamed read's copies out of it may still be in flight
        except BaseException:
            self._release()
            raise
        self._fill = 0  # index in _bufs of the buffer being filled
        self._step: int | None = None  # the step being filled
        self._blocks: set[int] = set()
        self._written: set[int] = set()  # steps handed to the background write
        self._pending: Future[None] | None = None
        self._done = False

    # ---- filling -------------------------------------------------------------------------------
    def _open_step(self, step: int) -> torch.Tensor:
        if self._done:
            raise RuntimeError("writer already committed or aborted")
        self.layout._check(step)
        if self._step is None:
            if step in self._written:
                raise RuntimeError(f"disk capture: step {step} was already written")
            self._step, self._blocks = step, set()
        elif step != self._step:
            raise RuntimeError(
                f"disk capture: step {step} while step {self._step} is incomplete "
                "(a capture written to disk fills one step at a time)"
            )
        return self._bufs[self._fill].data

    def _copy(self, view: torch.Tensor, t: torch.Tensor, what: str) -> None:
        if tuple(t.shape) != tuple(view.shape):
            raise ValueError(f"{what}: shape {tuple(t.shape)} != layout's {tuple(view.shape)}")
        view.copy_(t.detach())  # casts to the cache dtype; from a device, waits for the copy

    def put_block(
        self, step: int, block_id: int, y: torch.Tensor, scale: torch.Tensor | None = None
    ) -> None:
        """As TemplateWriter.put_block."""
        if scale is None and hasattr(y, "q") and hasattr(y, "scale"):
            y, scale = y.q, y.scale
        self.layout._check(step, block_id)
        buf = self._open_step(step)
        self._copy(self._views.block(buf, step, block_id), y, "block")
        if self.layout.fp8_scales:
            if scale is None:
                raise ValueError("this layout stores fp8 scales: pass scale=")
            self._copy(self._views.scales(buf, step, block_id), scale, "scale")
        self._blocks.add(block_id)

    def put_latents(self, step: int, latents: torch.Tensor) -> None:
        """The step's latents, after its blocks: the step is complete and goes to disk."""
        buf = self._open_step(step)
        if len(self._blocks) != self.layout.num_blocks:
            raise RuntimeError(
                f"disk capture: latents of step {step} before its blocks "
                f"({len(self._blocks)}/{self.layout.num_blocks})"
            )
        self._copy(self._views.latents(buf, step), latents, "latents")
        self._wait_pending()  # the other buffer's write is done: it is free again
        fill = self._bufs[self._fill]
        self._pending = self.store._io.submit(self._write_step, step, fill)
        self._written.add(step)
        self._fill ^= 1
        self._step = None

    # ---- background write ----------------------------------------------------------------------
    def _write_step(self, step: int, buf: StagingBuffer) -> None:
        assert self._entry is not None
        mv = memoryview(buf.data.numpy())[: self.layout.step_nbytes]
        entry = self._entry

        def write() -> None:
            entry.write_step(step, mv)
            entry.flush()  # dirty pages bounded to a step; commit's fsync finds little left

        self._room(write)

    def _room(self, write: Callable[[], None]) -> None:
        """Run a write; on ENOSPC evict LRU disk entries and retry once; a second ENOSPC
        switches the disk tier off host-wide (RELIABILITY #11) and raises CacheFull."""
        disk = self.store.disk
        for attempt in range(2):
            try:
                write()
                return
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    disk._count(write_errors=1)
                    raise
                disk._count(enospc=1)
                if attempt == 0:
                    assert self._entry is not None
                    self.store._disk_victims(self._entry.nbytes, self.key)
        log.warning("disk cache full (ENOSPC after eviction): disk tier switched off")
        disk.enabled = False
        self.store._disable_disk()
        raise CacheFull(f"disk: no room for {self.key[:12]} ({self.layout.nbytes} bytes)")

    def _wait_pending(self) -> None:
        fut, self._pending = self._pending, None
        if fut is not None:
            fut.result()

    # ---- end -----------------------------------------------------------------------------------
    def commit(self) -> None:
        if self._done:
            raise RuntimeError("writer already committed or aborted")
        try:
            self._wait_pending()
            if len(self._written) != self.layout.num_steps or self._step is not None:
                raise RuntimeError(
                    f"incomplete capture: {len(self._written)}/{self.layout.num_steps} steps "
                    "written to disk"
                )
            assert self._entry is not None
            self._entry.commit()
        except BaseException:
            self.abort()
            raise
        self._done = True
        with self.store.dram.txn() as t:
            ok = t.idx.commit(self.key, "disk")
            if not ok:  # the tier was switched off (or the entry dropped) meanwhile
                self.store.disk.delete(self.key)
        self._give_buffers()
        if not ok:
            raise CacheMiss(f"{self.key[:12]}: the disk tier dropped the entry while writing")
        self.store._count(disk_captures=1)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._wait_pending()
        except Exception:
            pass  # the write's error is moot: the entry is dropped
        self._release()

    def _release(self) -> None:
        """Drop the temp file, the index reservation and the buffers (never raises twice)."""
        if self._entry is not None:
            self._entry.abort()
        with self.store.dram.txn() as t:
            t.idx.abort(self.key, "disk")
        self._give_buffers()

    def _give_buffers(self) -> None:
        bufs, self._bufs = self._bufs, []
        if bufs:
            self.store.staging.give(bufs)

    def __enter__(self) -> DiskTemplateWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()  # a no-op after commit


# ---- streamed reads ------------------------------------------------------------------------------
@dataclass(eq=False)
class _Slot:
    buf: StagingBuffer
    step: int | None = None
    read: Future[None] | None = None
    #: views of `step` were handed out (asynchronous copies may read the buffer)
    used: bool = False


class StreamedTemplate:
    """A disk-only entry read one step at a time (see the module docstring). Views returned for
    step s stay valid until a step two or more later (ring 3) is asked for; the handle must be
    closed (buffers go back to the pool, the index reference is released)."""

    device = torch.device("cpu")

    def __init__(self, store: TieredStore, key: str, ring: int = DEFAULT_RING) -> None:
        """Opens the entry and reads step 0 (CacheMiss / CorruptEntry from either); the caller
        holds the disk entry's index reference and releases it when this raises."""
        if ring < 2:
            raise ValueError("a streamed read needs at least 2 step buffers")
        self._store, self.key = store, key
        self._reader = store.disk.reader(key)
        self.layout = self._reader.layout
        self._views = StepViews(self.layout)
        self._slots: list[_Slot] = []
        self._current: int | None = None
        self._error: CacheMiss | None = None
        self._closed = False
        try:
            bufs = store.staging.take(self.layout.step_nbytes, ring)
            self._slots = [_Slot(b) for b in bufs]
            self._buffer(0)  # step 0 now (a corrupt entry is a miss at open) and step 1 behind
        except BaseException:
            self._close()
            raise
        store.disk._count(hits=1, bytes_read=self._reader.data_offset)
        store.disk.touch(key)

    # ---- the ring ------------------------------------------------------------------------------
    @property
    def buffers(self) -> list[StagingBuffer]:
        """The staging buffers this handle holds (its whole host memory for the data)."""
        return [s.buf for s in self._slots]

    def _read(self, slot: _Slot, step: int) -> None:
        """Background: wait until the slot's previous contents are no longer read (CUDA copies),
        then read and verify `step` into it, and have the kernel read the step after ahead."""
        slot.buf.wait()
        self._reader.read_step(step, memoryview(slot.buf.data.numpy()))
        self._reader.advise(step + 1)

    def _start(self, slot: _Slot, step: int) -> None:
        """Start reading `step` into a slot whose read (if any) has finished."""
        if slot.used:  # views of its step were handed out: copies from it may be in flight
            slot.buf.event, slot.used = cuda_event(), False
        slot.step = step
        slot.read = self._store._io.submit(self._read, slot, step)

    def _victim(self, keep: int) -> _Slot:
        """A slot to reuse: empty, else the one holding the lowest step other than `keep` and
        the step in use (its read, if one is pending, finished first)."""
        for s in self._slots:
            if s.step is None:
                return s
        busy = (keep, self._current)
        slot = min((s for s in self._slots if s.step not in busy), key=lambda s: s.step)
        self._finish(slot)
        slot.step = None
        return slot

    def _finish(self, slot: _Slot) -> None:
        """Wait for the slot's pending read; a failed one breaks the handle."""
        fut, slot.read = slot.read, None
        if fut is None:
            return
        try:
            fut.result()
        except CacheMiss as e:
            slot.step = None
            self._fail(e)
        except BaseException:
            slot.step = None
            raise

    def _fail(self, e: CacheMiss) -> None:
        """Step 0 (at open): the plain miss, the edit runs in full. A later step: the edit
        cannot finish; every later call raises the same StreamCorrupt."""
        if self._error is None:
            self._store._forget_disk(self.key)  # the file was quarantined
            if self._current is None:
                raise e
            self._error = StreamCorrupt(
                f"template cache {self.key[:12]} failed verification while streamed from disk "
                f"({e}): the entry was quarantined; the edit cannot finish from it and the "
                "template is captured again"
            )
        raise self._error

    def _buffer(self, step: int) -> torch.Tensor:
        """The buffer holding `step`, read and verified; starts the next step's read."""
        if self._closed:
            raise RuntimeError("handle is closed")
        if self._error is not None:
            raise self._error
        self.layout._check(step)
        slot = next((s for s in self._slots if s.step == step), None)
        if slot is None:
            slot = self._victim(keep=step)
            self._start(slot, step)
        self._finish(slot)
        slot.used, self._current = True, step
        nxt = step + 1
        if nxt < self.layout.num_steps and all(s.step != nxt for s in self._slots):
            self._start(self._victim(keep=step), nxt)
        return slot.buf.data

    # ---- views ---------------------------------------------------------------------------------
    def block(self, step: int, block_id: int) -> torch.Tensor:
        return self._views.block(self._buffer(step), step, block_id)

    def scales(self, step: int, block_id: int) -> torch.Tensor:
        return self._views.scales(self._buffer(step), step, block_id)

    def latents(self, step: int) -> torch.Tensor:
        return self._views.latents(self._buffer(step), step)

    # ---- end -----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if not self._closed:
            self._close()
            self._store._release_stream(self.key)

    def _close(self) -> None:
        self._closed = True
        for s in self._slots:
            if s.read is not None and not s.read.cancel():
                try:
                    s.read.result()
                except BaseException:
                    pass  # moot: the handle is done
            s.read = None
        self._reader.close()
        ev = cuda_event()  # copies out of any slot are enqueued before this
        for s in self._slots:
            s.buf.event = ev
        bufs, self._slots = [s.buf for s in self._slots], []
        if bufs:
            self._store.staging.give(bufs)

    def __del__(self) -> None:
        # a handle dropped without close() would hold its disk reference until process exit
        if not getattr(self, "_closed", True) and not self._store.dram.in_txn:
            log.warning("StreamedTemplate %s garbage-collected while open: closed", self.key[:12])
            try:
                self.close()
            except Exception:  # interpreter shutdown
                pass

    def __enter__(self) -> StreamedTemplate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamedHandle(WindowedHandle):
    """The engine's TemplateHandle over a StreamedTemplate (host_store chooses it). With a device
    step window (cache/window.py) its steps are DMA'd from the pinned staging ring a step ahead
    and read on the device, so a streamed edit runs as CUDA graphs too."""

    device = torch.device("cpu")

    def __init__(self, streamed: StreamedTemplate) -> None:
        super().__init__(streamed)

    def block_steps(self, block_id: int, device: torch.device) -> torch.Tensor | None:
        """The window's slots (index them with slot(step)); None without a window."""
        return self.window_steps(block_id, device)

    def close(self) -> None:
        self.close_window()
        self.source.close()
