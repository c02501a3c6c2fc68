"""The engine's ActivationStore over the host-level TieredStore (shared DRAM + local disk).

- Writers stream a capture into a DRAM segment. The segment's layout needs every block's shape,
  which the capture reveals during its first step; step 0's outputs are held until then.
- `open` returns a handle whose tensors are zero-copy views of the shared segment (fp8 entries
  come back as QuantizedRows). On CUDA the segment is registered as pinned, device-mapped memory
  once per mapping (this process keeps a ready segment mapped across its handles, DramTier.attach)
  and unregistered when the mapping closes: a request pays no registration. The pipelined
  loader's copies are then DMA at full bandwidth, and `block_steps` offers a device view of the
  pinned pages that CUDA-graph steps read in place (engine/graphs.py, decision 0029).
  A disk-only entry that DRAM cannot take (a template larger than the tier: it was captured
  straight to disk) is opened as a `disk_stream.StreamedHandle` instead: one step at a time from
  the file through a small ring of staging buffers pinned once by the store's pool; its tier is
  "disk". A step failing verification mid-edit raises StreamCorrupt (the entry is quarantined).
- `meta` (the step schedule an edit must match) is kept next to the cache root as JSON, written
  atomically just before commit, so every process of the host can select the masked path; a
  ready entry without one is removed (and captured again).
A disk entry that is corrupt or missing on open raises CacheMiss: the caller runs the full path.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import torch

from instgenie.cache.disk import CacheMiss, check_key
from instgenie.cache.disk_stream import StreamedHandle, StreamedTemplate
from instgenie.cache.host_template import HostTemplate
from instgenie.cache.hostmem import device_view, pin, unpin
from instgenie.cache.index import CacheFull, EntryInUse, TooLarge
from instgenie.cache.layout import TemplateLayout
from instgenie.cache.quant import FP8, quantize_rows
from instgenie.cache.store import TemplateMeta
from instgenie.cache.tiered import TieredStore
from instgenie.cache.window import WindowedHandle

__all__ = ["CacheMiss", "HostActivationStore"]

log = logging.getLogger(__name__)

READY = ("dram", "disk")


class HostActivationStore:
    def __init__(self, tiered: TieredStore, root: str | Path, dtype: torch.dtype | None = None):
        self.tiered = tiered
        self.dtype = dtype
        self.meta_dir = Path(root) / "meta"
        self.meta_dir.mkdir(parents=True, exist_ok=True)
        self._metas: dict[str, TemplateMeta] = {}
        self._lock = threading.Lock()
        #: serialises page registration (seconds for tens of GB), outside the host index lock
        self._pin_lock = threading.Lock()
        #: register DRAM mappings as pinned memory (CUDA machines); benchmarks turn it off
        self.pin_memory = torch.cuda.is_available()
        #: how a capture's blocks reach its DRAM segment: "staged" (async DMA into pinned slots,
        #: pages backed and written by host threads, registered at commit; capture_stage.py,
        #: decision 0046), "pinned" (the segment registered first, DMA into it: decision 0036),
        #: "direct" (synchronous copies), "auto" = staged for a capture on a CUDA device on a
        #: machine that pins (pin_memory), else direct
        self.capture_copies = "auto"
        tiered.dram.on_unmap = _unpin_segment

    # ---- status / meta ---------------------------------------------------------------------
    def status(self, key: str) -> str:
        """ "ready" (in DRAM or on disk), "building" or "absent"."""
        s = self.tiered.status(key)
        if s not in READY:
            return s
        if not self._has_meta(key):
            # ready but unusable: no edit can match it (a meta file removed by hand, or a
            # capture killed between its commit and its meta file before the meta came first).
            # Removed, so that the template is captured again.
            log.warning("template cache %s has no meta file: removed", key[:12])
            try:
                self.tiered.delete(key)
            except EntryInUse:
                return "building"  # someone still reads it; not usable here meanwhile
            return "absent"
        return "ready"

    def _meta_path(self, key: str) -> Path:
        return self.meta_dir / f"{check_key(key)}.json"

    def _has_meta(self, key: str) -> bool:
        with self._lock:
            if key in self._metas:
                return True
        return self._meta_path(key).is_file()

    def tier(self, key: str) -> str:
        return self.tiered.status(key)

    def residency(self, keys: Iterable[str]) -> dict[str, dict[str, int]]:
        """key -> {"dram" | "disk": bytes} for each of `keys` ready in a host tier now
        (TieredStore.residency: one index transaction, no meta file read)."""
        return self.tiered.residency(keys)

    def meta(self, key: str) -> TemplateMeta:
        with self._lock:
            meta = self._metas.get(key)
        if meta is None:
            try:
                d = json.loads(self._meta_path(key).read_text())
            except (OSError, ValueError) as e:  # removed meanwhile, or unreadable
                raise CacheMiss(f"{key[:12]}: no usable meta file ({e})") from None
            d["timesteps"] = tuple(d["timesteps"])
            d["latent_shape"] = tuple(d["latent_shape"])
            d["block_shapes"] = {int(b): tuple(s) for b, s in d["block_shapes"].items()}
            meta = TemplateMeta(**d)
            with self._lock:
                self._metas[key] = meta
        return meta

    def _save_meta(self, key: str, meta: TemplateMeta) -> None:
        path = self._meta_path(key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(meta)))
        os.replace(tmp, path)
        with self._lock:
            self._metas[key] = meta

    def _drop_meta(self, key: str) -> None:
        self._meta_path(key).unlink(missing_ok=True)
        with self._lock:
            self._metas.pop(key, None)

    # ---- write -----------------------------------------------------------------------------
    def writer(self, key: str, meta: TemplateMeta) -> _StreamingWriter:
        if self.status(key) != "absent":
            raise KeyError(f"template cache {key[:12]} is already {self.status(key)}")
        return _StreamingWriter(self, check_key(key), meta)

    # ---- read ------------------------------------------------------------------------------
    def open(self, key: str) -> _HostHandle | StreamedHandle:
        """Acquire the entry (loading it from disk into DRAM if needed, else streaming it from
        disk step by step; CacheMiss if that fails)."""
        host = self.tiered.acquire(key, stream=True)
        if isinstance(host, StreamedTemplate):
            return StreamedHandle(host)
        try:
            self._pin(host)
        except BaseException:
            host.close()  # e.g. cudaHostRegister failed: the reference must not leak
            raise
        return _HostHandle(host)

    def _pin(self, host: HostTemplate) -> None:
        """Register the entry's mapping as pinned once (it stays so until it is unmapped)."""
        seg = host.segment
        if seg.pinned is not None or not self.pin_memory:
            return
        with self._pin_lock:
            if seg.pinned is None and pin(host.data):
                seg.pinned = {}  # device -> device view of the pinned pages (device_views)

    def prefetch(self, key: str):
        """Disk -> DRAM in the background (a Future), or None if already in DRAM / absent."""
        return self.tiered.prefetch(key)

    def delete(self, key: str) -> None:
        self.tiered.delete(key)
        self._drop_meta(key)

    @property
    def nbytes(self) -> int:
        st = self.tiered.stats()
        return int(st["bytes_dram"])


def _unpin_segment(seg) -> None:
    """DramTier.on_unmap: undo _pin before the mapping closes (no view may outlive it)."""
    seg.pinned = None
    unpin(seg.data)


class _HostHandle(WindowedHandle):
    device = torch.device("cpu")

    def __init__(self, host: HostTemplate) -> None:
        super().__init__(host)  # rows are zero-copy views of the shared segment
        self._host = host
        self._fp8 = host.layout.fp8_scales

    def block_steps(self, block_id: int, device: torch.device) -> torch.Tensor | None:
        """(num_steps, rows, L, C) of the block, readable by kernels on `device` in place (index
        it with slot(step)): the step window's slots when attached; else a view of the pinned
        pages on CUDA, the shared segment itself on CPU. None when there is none (fp8 entries,
        or unpinned memory on CUDA)."""
        if self._fp8 or self._host is None or self._host.closed:
            return None
        if self.window is not None:
            return self.window_steps(block_id, device)
        seg, layout = self._host.segment, self._host.layout
        if device.type == "cpu":
            return layout.block_steps_view(self._host.data, block_id)
        if device.type != "cuda" or seg.pinned is None:
            return None
        view = seg.pinned.get(device)
        if view is None:
            view = seg.pinned[device] = device_view(self._host.data, device)
        return layout.block_steps_view(view, block_id)

    def close(self) -> None:
        self.close_window()
        if self._host is not None:
            self._host.close()
            self._host = None


class _StreamingWriter:
    """Holds step 0 until the layout is known, then streams into a DRAM segment.

    Another process of the host (another worker, or a restarted loop) may start capturing the
    same key between this writer's creation and the end of its step 0, when the DRAM entry is
    reserved: then this writer has `lost` the race and records nothing (every call is a no-op);
    the capture run is not failed, and its loop waits for the other capture instead."""

    def __init__(self, store: HostActivationStore, key: str, meta: TemplateMeta) -> None:
        self.store, self.key, self.meta = store, key, meta
        self._pending: dict[int, torch.Tensor] = {}
        self._writer = None
        self.lost = False  # another process reserved the key first
        #: why the node's tiers had no room for it (every entry in use): it records nothing,
        #: is never committed ("" = it had room); its capture run ends (engine/pipeline.py)
        self.no_room = ""
        self.never = False  # no_room for good: larger than every tier (TooLarge), not "now"

    def _layout(self, latents: torch.Tensor) -> TemplateLayout:
        first = next(iter(self._pending.values()))
        dtype = self.store.dtype or first.dtype
        shapes = tuple(tuple(self._pending[b].shape[1:]) for b in sorted(self._pending))
        return TemplateLayout(
            num_steps=self.meta.num_steps,
            rows=int(first.shape[0]),
            dtype=str(dtype).removeprefix("torch."),
            block_shapes=shapes,
            latent_shape=tuple(latents.shape),
            latent_dtype=str(latents.dtype).removeprefix("torch."),
            fp8_scales=dtype == FP8,
        )

    def _put(self, step: int, block_id: int, y: torch.Tensor) -> None:
        if self.no_room:  # gave up on an earlier block
            return
        value = quantize_rows(y) if self.store.dtype == FP8 else y
        try:
            self._writer.put_block(step, block_id, value)
        except OSError as exc:  # a staged copy could not back its pages (/dev/shm full)
            self._give_up(exc)

    def _give_up(self, exc: BaseException) -> None:
        """The segment cannot be written: record nothing more; the capture run goes on and its
        template is reported as having found no room (retryable), like a CacheFull at start."""
        log.warning("capture %s: its DRAM segment cannot be written (%s); recording nothing",
                    self.key[:12], exc)  # fmt: skip
        self.no_room = f"DRAM segment: {exc}"
        self._writer.abort()

    def put_block(self, step: int, block_id: int, y: torch.Tensor) -> None:
        if self.lost or self.no_room:
            return
        if self._writer is None:
            if step != 0:
                raise RuntimeError("capture must start at step 0")
            self._pending[block_id] = y.detach().clone()
            self.meta.block_shapes[block_id] = (int(y.shape[1]), int(y.shape[2]))
            return
        self._put(step, block_id, y)

    def put_latents(self, step: int, latents: torch.Tensor) -> None:
        if self.lost or self.no_room:
            return
        if self._writer is None:
            layout = self._layout(latents)
            copies = self.store.capture_copies
            if copies == "auto":
                copies = "staged" if self.store.pin_memory and latents.is_cuda else "direct"
            try:
                self._writer = self.store.tiered.writer(self.key, layout, staged=copies == "staged")
            except ValueError:  # building or ready in some tier: another process was first
                self.lost = True
                self._pending.clear()
                return
            except CacheFull as exc:  # never the step's failure: the edits beside it go on
                self.no_room, self.never = str(exc), isinstance(exc, TooLarge)
                self._pending.clear()
                return
            pinned = copies == "pinned" and self.store.pin_memory and latents.is_cuda
            if pinned and hasattr(self._writer, "pin"):
                self._writer.pin()  # DRAM segment: async DMA for every block from here on
            for b in sorted(self._pending):
                self._put(0, b, self._pending[b])
            self._pending.clear()
            self.meta.cache_dtype = layout.dtype
            self.meta.nbytes = layout.nbytes
            if self.no_room:
                return
        try:
            self._writer.put_latents(step, latents)
        except OSError as exc:
            self._give_up(exc)

    def commit(self) -> None:
        if self.lost or self.no_room:
            return
        if self._writer is None:
            raise RuntimeError("incomplete capture: no step finished")
        # meta first: once the entry is ready (to every process of the host), its meta exists
        self.store._save_meta(self.key, self.meta)
        try:
            self._writer.commit()
        except (CacheFull, OSError) as exc:  # staged pages could not be backed: aborted
            self.store._drop_meta(self.key)
            self.no_room = f"DRAM segment: {exc}"
        except BaseException:
            self.store._drop_meta(self.key)
            raise

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        self._pending.clear()
