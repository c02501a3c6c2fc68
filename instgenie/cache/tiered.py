"""Tiered template store: host DRAM (shared memory) in front of the local disk.

A capture writes straight into a new DRAM segment (`host_template.TemplateWriter`); commit makes
it readable by every process of the host. Disk copies are made when capacity pressure demotes an
entry (or by `persist`), never on the request path. A template that DRAM cannot hold whole
(larger than the tier, or the tier full of entries in use) is captured straight to disk instead
(`disk_stream.DiskTemplateWriter`): no template ever has to fit DRAM. `acquire` hands out
zero-copy CPU views (`host_template.HostTemplate`) and holds a reference, so an entry in use is
never evicted; an entry that is only on disk is loaded into DRAM first, checksums verified, or,
with `stream=True` when DRAM cannot take it, read one step at a time through a small ring of
pinned staging buffers (`disk_stream.StreamedTemplate`; it holds a reference on the disk entry).
A missing or corrupt disk entry is a CacheMiss: the caller recomputes (counted, quarantined).

Status per key: "dram" (ready in DRAM), "disk" (only on disk), "building" (a capture, a load or a
demotion is in flight) or "absent".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from instgenie.cache import capture_stage
from instgenie.cache.budgets import human_bytes
from instgenie.cache.disk import DEFAULT_CHUNK_BYTES, CacheMiss, DiskBusy, DiskTier, check_key
from instgenie.cache.disk_stream import DEFAULT_RING, DiskTemplateWriter, StreamedTemplate
from instgenie.cache.dram import DramTier
from instgenie.cache.host_template import HostTemplate, TemplateWriter
from instgenie.cache.index import READY, CacheFull, TooLarge
from instgenie.cache.layout import TemplateLayout
from instgenie.cache.shm_segment import Segment
from instgenie.cache.staging import StagingPool

log = logging.getLogger(__name__)

#: polling period while another thread/process finishes a load or demotion (seconds)
_POLL_S = 0.005


class _NoDramRoom(CacheMiss):
    """A disk entry DRAM cannot take now (too large, or full of entries in use)."""


@dataclass
class TierCounters:
    hits_dram: int = 0
    hits_disk: int = 0
    misses: int = 0
    prefetches: int = 0
    #: disk hits read step by step (the entry did not fit DRAM); counted in hits_disk too
    streams: int = 0
    #: captures committed straight to disk (the template did not fit DRAM)
    disk_captures: int = 0


class TieredStore:
    def __init__(
        self,
        root: str | Path,
        namespace: str,
        dram_capacity_bytes: int,
        disk_capacity_bytes: int,
        disk_enabled: bool = True,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        clock: Callable[[], float] = time.time,
        wait_timeout_s: float = 300.0,
        recover_interval_s: float = 30.0,
        stream_ring: int = DEFAULT_RING,
        staging: StagingPool | None = None,
    ) -> None:
        """Capacities are template bytes (layout.nbytes) per tier. Every process of the host that
        uses the same root and namespace shares the DRAM entries and the disk directory.
        recover_interval_s: after ENOSPC switched the disk tier off, how often (seconds) a new
        capture or load checks whether the filesystem has room again. stream_ring: step buffers
        per streamed read; staging: where they (and disk captures' step buffers) come from."""
        self.root = Path(root)
        self.wait_timeout_s = wait_timeout_s
        self.recover_interval_s = recover_interval_s
        self._next_recover = 0.0  # time.monotonic() of the next recovery check
        self.disk = DiskTier(self.root / "disk", None, chunk_bytes=chunk_bytes,
                             choose_victims=self._disk_victims)  # fmt: skip
        self.dram = DramTier(
            self.root / "host",
            namespace,
            dram_capacity_bytes,
            disk_capacity_bytes=disk_capacity_bytes if disk_enabled else 0,
            demote=self._demote,
            drop_disk=self.disk.evict,
            clock=clock,
        )
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._loads: dict[str, Future[None]] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="igc-prefetch")
        #: step reads of streamed entries, step writes of disk captures (short tasks)
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="igc-io")
        self.stream_ring = stream_ring
        self.staging = staging if staging is not None else StagingPool()
        # a start (or restart) retries a disk tier that ENOSPC switched off: the flag is host
        # state and outlives the process, the full filesystem may not have
        if not self.recover_disk():
            self._reconcile_disk()

    # ---- queries ---------------------------------------------------------------------------------
    def _states(self, key: str) -> tuple[str, str]:
        with self.dram.txn() as t:
            return t.idx.state(key, "dram"), t.idx.state(key, "disk")

    def status(self, key: str) -> str:
        dram, disk = self._states(check_key(key))
        if dram == READY:
            return "dram"
        if "building" in (dram, disk):
            return "building"
        return "disk" if disk == READY else "absent"

    def residency(self, keys: Iterable[str]) -> dict[str, dict[str, int]]:
        """key -> {tier: bytes} for each of `keys` ready in DRAM and/or on disk now (both when
        both hold it; building and absent keys are left out), in one index transaction."""
        out: dict[str, dict[str, int]] = {}
        with self.dram.txn() as t:
            for key in keys:
                held = [(tier, t.idx.get(key, tier)) for tier in ("dram", "disk")]
                tiers = {tier: e.nbytes for tier, e in held if e is not None and e.state == READY}
                if tiers:
                    out[key] = tiers
        return out

    def stats(self) -> dict[str, Any]:
        """This process's hit/miss/eviction counters plus the host's bytes/entries per tier and
        each tier's capacity as the host index holds it (budget_<tier>_bytes)."""
        out: dict[str, Any] = {}
        with self.dram.txn() as t:
            for tier in ("dram", "disk"):
                out[f"bytes_{tier}"] = t.idx.used(tier)
                out[f"entries_{tier}"] = len(t.idx.entries(tier))
                out[f"budget_{tier}_bytes"] = t.idx.capacities[tier]
            out["disk_enabled"] = t.idx.is_enabled("disk") and self.disk.enabled
        with self._lock:
            out.update(asdict(self.counters))
        d, dr = self.disk.counters(), self.dram.stats
        out.update(evictions=dr.evictions + d["evictions"], evictions_dram=dr.evictions)
        out.update(evictions_disk=d["evictions"], demotions=dr.demotions)
        out.update(corrupt=d["corrupt"], quarantined=d["quarantined"], enospc=d["enospc"])
        out.update(disk_misses=d["misses"], bytes_read_disk=d["bytes_read"])
        out.update(bytes_written_disk=d["bytes_written"], dead_owners=dr.dead_owners)
        out.update(stale_format=d["stale_format"], staging_bytes=self.staging.live_bytes)
        return out

    # ---- write -----------------------------------------------------------------------------------
    def writer(
        self, key: str, layout: TemplateLayout, staged: bool = False
    ) -> TemplateWriter | DiskTemplateWriter:
        """A writer into a new DRAM segment, or, when DRAM cannot hold the template whole (larger
        than the tier, the tier off, or full of entries in use), straight into a disk entry.
        ValueError if the key exists in any tier; CacheFull if neither tier can take it now,
        TooLarge if neither ever can (larger than each tier's whole capacity).
        staged: a DRAM writer copies through this process's capture stager (capture_stage.py),
        the segment's data pages backed by its threads, not here."""
        self._maybe_recover_disk(self.disk.file_nbytes(layout))  # demotions may need it
        try:
            seg = self.dram.create(check_key(key), layout, fresh=True, back_data=not staged)
            return TemplateWriter(self, seg, capture_stage.shared() if staged else None)
        except CacheFull as dram_full:
            try:
                return DiskTemplateWriter(self, key, layout)
            except CacheFull as disk_full:
                never = self.too_large(layout)
                if never:
                    raise TooLarge(never) from disk_full
                raise CacheFull(f"{dram_full}; {disk_full}") from disk_full

    def too_large(self, layout: TemplateLayout) -> str:
        """Why a template of `layout` can never be held on this host (larger than the DRAM
        tier's whole capacity and than the disk tier's; a tier configured off holds 0 bytes),
        or "" when some tier could hold it once entries leave it."""
        with self.dram.txn() as t:
            caps = dict(t.idx.capacities)
        if any(layout.nbytes <= caps[tier] for tier in ("dram", "disk")):  # (what reserve asks)
            return ""
        tiers = " and ".join(
            f"{t} tier ({human_bytes(caps[t]) if caps[t] else 'off'})" for t in ("dram", "disk")
        )
        size = human_bytes(layout.nbytes)
        return (
            f"the template's cache ({size}) is larger than this host's {tiers}: "
            "it can never be cached here (raise --cache-dram-bytes or --cache-disk-bytes; its "
            "edits run the full path)"
        )

    def persist(self, key: str) -> bool:
        """Copy a ready DRAM entry to disk now (blocking). False when not stored."""
        seg = self.dram.attach(check_key(key))
        if seg is None:
            return False
        try:
            with self.dram.txn() as t:
                if t.idx.get(key, "disk") is not None:
                    return t.idx.state(key, "disk") == READY
                try:
                    self.dram.apply(
                        t, t.idx.reserve(key, "disk", seg.layout.nbytes, self.dram.owner)
                    )
                except CacheFull:
                    return False
            assert seg.data is not None
            ok = self._write_disk(key, seg.layout, seg.data)
            self._disk_written(key, ok)
            return ok
        finally:
            self.dram.release(seg)

    def _write_disk(self, key: str, layout: TemplateLayout, data: torch.Tensor) -> bool:
        """Write one disk entry; a write that switched this process's disk tier off (ENOSPC
        after eviction) switches it off host-wide. A write refused because the tier was off
        here already does not: another process may have switched it on for the host (its
        configuration wins, DramTier._configure), and turning it off there would make the
        two processes flip it every recover_interval_s."""
        was_enabled = self.disk.enabled
        ok = self.disk.write(key, layout, data)
        if not ok and was_enabled and not self.disk.enabled:
            self._disable_disk()
        return ok

    def _demote(self, key: str, layout: TemplateLayout, data: torch.Tensor) -> bool:
        """DramTier callback, outside the host lock: the index already reserved the disk entry."""
        return self._write_disk(key, layout, data)

    def _disk_written(self, key: str, ok: bool) -> None:
        with self.dram.txn() as t:
            if ok and not t.idx.commit(key, "disk"):
                self.disk.delete(key)  # the tier was switched off meanwhile
            elif not ok:
                t.idx.abort(key, "disk")

    def _disable_disk(self) -> None:
        """Run without the disk tier (ENOSPC persisted after eviction); files stay on disk and are
        indexed again by recover_disk()."""
        with self.dram.txn() as t:
            t.idx.disable_tier("disk")

    def recover_disk(self, min_free_bytes: int = 0) -> bool:
        """Switch the disk tier back on when the filesystem has min_free_bytes free again."""
        if self.dram.capacities["disk"] == 0 or not self.disk.try_enable(min_free_bytes):
            return False
        with self.dram.txn() as t:
            t.idx.enable_tier("disk")
        self._reconcile_disk()
        return True

    def _maybe_recover_disk(self, min_free_bytes: int) -> None:
        """RELIABILITY #11, "recovers when space returns": while the disk tier is off after
        ENOSPC, check at most every recover_interval_s whether min_free_bytes fit again."""
        if self.dram.capacities["disk"] == 0:
            return  # off by configuration
        now = time.monotonic()
        with self._lock:
            if now < self._next_recover:
                return
            self._next_recover = now + self.recover_interval_s
        with self.dram.txn() as t:
            if t.idx.is_enabled("disk") and self.disk.enabled:
                return
        if self.recover_disk(min_free_bytes):
            log.info("disk cache tier switched back on: the filesystem has room again")

    def _disk_victims(self, nbytes: int, key: str) -> list[str]:
        """DiskTier's ENOSPC callback: the index picks LRU unused disk entries; they are deleted
        here, under the host lock (no process can re-create one of them meanwhile), so nothing
        is left for DiskTier to delete."""
        with self.dram.txn() as t:
            for ev in t.idx.evict_for("disk", nbytes, exclude=key):
                self.disk.evict(ev.key)
        return []

    def _reconcile_disk(self) -> None:
        """Make the index's disk tier match the files (another process or a restart may have
        changed them); unknown files are indexed by mtime, headers verified."""
        with self.dram.txn() as t:
            if not t.idx.is_enabled("disk"):  # off by configuration or after ENOSPC
                self.disk.enabled = False
                return
            # listed under the host lock: a file another process commits meanwhile is indexed
            files = self.disk.scan()  # LRU first, so capacity pressure evicts the oldest
            names = {k for k, _, _ in files}
            for e in t.idx.entries("disk"):
                if e.state == READY and e.key not in names:
                    t.idx.forget(e.key, "disk")
            for k, _, mtime in files:
                if t.idx.get(k, "disk") is not None:
                    continue
                try:
                    n = self.disk.read_layout(k).nbytes
                    self.dram.apply(t, t.idx.reserve(k, "disk", n, self.dram.owner))
                except CacheMiss:
                    continue
                except CacheFull:
                    self.disk.evict(k)
                    continue
                t.idx.commit(k, "disk")
                t.idx.touch(k, "disk", at=mtime)

    # ---- read ------------------------------------------------------------------------------------
    def acquire(self, key: str, stream: bool = False) -> HostTemplate | StreamedTemplate:
        """Zero-copy views of a ready template, held until the handle is closed. Loads from disk
        first when needed (blocking; waits for an in-flight prefetch). With `stream`, a disk
        entry that DRAM cannot take is returned as a StreamedTemplate (read step by step)
        instead of a miss. CacheMiss otherwise."""
        check_key(key)
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            fut = self._loads.get(key)
            if fut is not None:
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:
                    pass  # counted by the loader; the state below decides
            seg = self.dram.attach(key)
            if seg is not None:
                self._count(hits_dram=1)
                return HostTemplate(self.dram, seg)
            dram, disk = self._states(key)
            if dram == "absent" and disk == READY:
                try:
                    seg = self._load(key, acquire=True)
                except _NoDramRoom:
                    if not stream:
                        self._count(misses=1)
                        raise
                    return self._stream(key)
                except CacheMiss:
                    self._count(misses=1)
                    raise
                if seg is not None:
                    self._count(hits_disk=1)
                    return HostTemplate(self.dram, seg)
            elif not (
                (dram == "building" and disk == READY) or (dram, disk) == ("absent", "building")
            ):
                self._count(misses=1)  # absent, or a capture still in progress
                raise CacheMiss(f"{key[:12]}: not cached (dram {dram}, disk {disk})")
            if time.monotonic() > deadline:  # a load/demotion elsewhere takes too long
                self._count(misses=1)
                raise CacheMiss(f"{key[:12]}: timed out waiting for a load")
            time.sleep(_POLL_S)

    def _stream(self, key: str) -> StreamedTemplate:
        """Open a disk-only entry for step-by-step reads, holding a reference on it."""
        with self.dram.txn() as t:
            try:
                t.idx.acquire(key, "disk", self.dram.owner)
            except KeyError:
                self._count(misses=1)
                raise CacheMiss(f"{key[:12]}: no longer on disk") from None
        try:
            h = StreamedTemplate(self, key, self.stream_ring)
        except BaseException as e:
            self._release_stream(key)
            if isinstance(e, CacheMiss):
                self._count(misses=1)
                if not isinstance(e, DiskBusy):
                    self._forget_disk(key)
            raise
        self._count(hits_disk=1, streams=1)
        return h

    def _release_stream(self, key: str) -> None:
        with self.dram.txn() as t:
            try:
                t.idx.release(key, "disk", self.dram.owner)
            except ValueError:
                pass  # the entry was forgotten meanwhile (corrupt, tier switched off)

    def _fits_dram(self, key: str) -> bool:
        """Whether a disk-only entry could be loaded into DRAM at all (its size, the tier)."""
        with self.dram.txn() as t:
            e = t.idx.get(key, "disk")
            cap = t.idx.capacities["dram"] if t.idx.is_enabled("dram") else 0
            return e is None or e.nbytes <= cap

    def _warm(self, key: str) -> None:
        """Prefetch of a streamed entry: the kernel reads its first steps ahead."""
        with self.disk.reader(key) as r:
            r.advise(0)
            r.advise(1)

    def prefetch(self, key: str) -> Future[None] | None:
        """Start loading a disk-only entry into DRAM in the background; returns at once (None when
        there is nothing to load). At most one load per key is in flight. An entry too large for
        DRAM (it will be streamed) has its first steps read ahead into the page cache."""
        check_key(key)
        with self._lock:
            fut = self._loads.get(key)
            if fut is not None:
                return fut
            if self._states(key) != ("absent", READY):
                return None
            load = self._load if self._fits_dram(key) else lambda k, _: self._warm(k)
            fut = self._pool.submit(load, key, False)
            self._loads[key] = fut
            self.counters.prefetches += 1
        fut.add_done_callback(lambda f: self._forget_load(key, f))
        return fut  # type: ignore[return-value]

    def _forget_load(self, key: str, fut: Future[Any]) -> None:
        with self._lock:
            if self._loads.get(key) is fut:
                del self._loads[key]

    def _load(self, key: str, acquire: bool) -> Segment | None:
        """Disk -> new DRAM segment, verified. None when another loader got there first."""
        try:
            layout = self.disk.read_layout(key)
            seg = self.dram.create(key, layout, fresh=False)
        except ValueError:
            return None  # already building/ready in DRAM
        except DiskBusy:
            raise  # the file is fine: keep its entry
        except CacheMiss:
            self._forget_disk(key)
            raise
        except CacheFull as e:
            raise _NoDramRoom(f"{key[:12]}: no DRAM room to load it ({e})") from e
        try:
            assert seg.data is not None
            self.disk.read_into(key, layout, seg.data)
        except BaseException as e:
            self.dram.abort(seg)
            if isinstance(e, CacheMiss) and not isinstance(e, DiskBusy):
                self._forget_disk(key)
            raise
        self.dram.commit(seg, acquire=acquire)
        if not acquire:
            seg.close()
            return None
        return seg

    def _forget_disk(self, key: str) -> None:
        with self.dram.txn() as t:
            if t.idx.state(key, "disk") == READY:
                t.idx.forget(key, "disk")

    # ---- delete / close --------------------------------------------------------------------------
    def delete(self, key: str) -> None:
        """Remove from every tier (EntryInUse while referenced or being built)."""
        check_key(key)
        fut = self._loads.get(key)
        if fut is not None:
            fut.exception()  # let an in-flight load finish first
        with self.dram.txn() as t:
            for ev in t.idx.remove(key):
                if ev.tier == "dram":
                    self.dram.unlink(key)
            # under the lock: no other process is writing this key's file now (that would be a
            # building entry, refused above), and none can start before the file is gone
            self.disk.delete(key)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self.staging.clear()
        self.dram.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.counters, k, getattr(self.counters, k) + v)
