"""Host-DRAM tier: one POSIX shared-memory segment per template (shm_segment.py: its format, its
mapping in one process), shared by the host's processes.

Host index: a CacheIndex (tiers "dram" and, for the tiered store, "disk") stored as JSON in
`<root>/index-<namespace>.json`, read-modified-written under `fcntl.flock` on
`<root>/index-<namespace>.lock` (plus a thread lock: flock does not exclude threads sharing one
open file). References are per owner `"pid:start_time"`; on every read of the index, owners whose
process is gone (or whose pid was reused: the start time differs) lose their references, and the
segments they were building are unlinked. Segments are created and unlinked only under the lock,
so any segment of the namespace that the index does not list is debris and is removed. The tier
capacities in the index are host state: a process writes its configured ones in its first
transaction (and after a reconfiguration), not in every one; the last process configured wins
(`DramTier._configure`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from instgenie.cache.hostmem import owner_alive, owner_id
from instgenie.cache.index import READY, TIERS, CacheFull, CacheIndex, Eviction
from instgenie.cache.layout import TemplateLayout
from instgenie.cache.misses import CacheMiss, check_key
from instgenie.cache.shm_segment import SHM_DIR, Segment, check_namespace, segment_name, unlink_shm

log = logging.getLogger(__name__)


# ---- host index --------------------------------------------------------------------------------
@dataclass
class Txn:
    """One locked read-modify-write of the host index. Segments evicted with demotion are kept
    mapped here (their names already unlinked) and are written to disk after the lock is freed."""

    idx: CacheIndex
    demotions: list[Segment] = field(default_factory=list)


@dataclass
class DramStats:
    evictions: int = 0
    demotions: int = 0
    dead_owners: int = 0
    stale_segments: int = 0


#: (key, layout, data bytes) -> stored? ; writes an evicted DRAM entry to the disk tier
DemoteFn = Callable[[str, TemplateLayout, torch.Tensor], bool]


class DramTier:
    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: str,
        capacity_bytes: int,
        *,
        disk_capacity_bytes: int = 0,
        demote: DemoteFn | None = None,
        drop_disk: Callable[[str], object] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Capacities count template bytes (layout.nbytes), not the 4 KiB segment headers.
        disk_capacity_bytes > 0 with a demote callback enables demotion (the index then tracks
        the "disk" tier too); drop_disk deletes a disk entry the index evicted."""
        self.ns = check_namespace(namespace)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.owner = owner_id()
        self.demote, self.drop_disk, self.clock = demote, drop_disk, clock
        disk = disk_capacity_bytes if demote is not None else 0
        #: this process's configured capacities (bytes per tier); see _configure
        self.capacities = {"dram": capacity_bytes, "disk": disk}
        self._applied: dict[str, int] = {}  # the capacities as this process last wrote them
        self._warned: set[tuple[str, int]] = set()  # (tier, host capacity) already logged
        self.stats = DramStats()
        self._path = self.root / f"index-{self.ns}.json"
        self._lock_fd = os.open(self.root / f"index-{self.ns}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._tlock = threading.Lock()
        self._local = threading.local()
        self._raw = b""  # the index file as last read (under the lock)
        #: ready segments this process has mapped, key -> Segment: kept mapped (and pinned, by
        #: on_map) across handles, so a request costs no mmap or page registration; unmapped once
        #: idle and no longer the index's entry (evicted, deleted or replaced)
        self._mapped: dict[str, Segment] = {}
        #: run before a mapping with `pinned` set is closed (undoes the pinning)
        self.on_unmap: Callable[[Segment], None] | None = None
        with self.txn() as t:  # drop entries whose segment vanished, unlink unlisted segments
            if SHM_DIR.is_dir():
                for e in t.idx.entries("dram"):
                    if not (SHM_DIR / segment_name(self.ns, e.key)).exists():
                        t.idx.forget(e.key, "dram")
                listed = {segment_name(self.ns, e.key) for e in t.idx.entries("dram")}
                for p in SHM_DIR.glob(f"igc_{self.ns}_*"):
                    if p.name not in listed:
                        self.stats.stale_segments += unlink_shm(p.name)

    @contextmanager
    def txn(self) -> Iterator[Txn]:
        """Lock, load (dropping dead owners), yield, save even on error (every CacheIndex
        operation is atomic and side effects may have happened), unlock, then run demotions.
        Not re-entrant: a nested txn in the same thread raises instead of deadlocking."""
        if self.in_txn:
            raise RuntimeError("nested host-index transaction")
        t: Txn | None = None
        try:
            with self._tlock:
                self._local.busy = True
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
                try:
                    t = Txn(self._load())
                    dead = [o for o in t.idx.owners() if o != self.owner and not owner_alive(o)]
                    for o in dead:
                        self.apply(t, t.idx.drop_owner(o))
                    self.stats.dead_owners += len(dead)
                    self._configure(t)
                    yield t
                finally:
                    if t is not None:
                        self._save(t.idx)
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                    self._local.busy = False
        finally:
            for seg in t.demotions if t is not None else ():
                self._demote(seg)

    def _configure(self, t: Txn) -> None:
        """Write this process's configured capacities into the host index when they changed
        since this process last wrote them (in its first transaction, and after self.capacities
        is changed), never otherwise.

        The capacities are host state shared by every process of the namespace: the last process
        to be (re)configured sets them, and the others follow the index instead of writing their
        own back on every transaction (which, with differing configurations, flipped the
        capacities and evicted entries back and forth). A start with a new configuration thus
        still applies it, e.g. a disk capacity going from 0 to > 0 switches the tier back on
        (docs/decisions/0017-disk-tier-recovery.md). A process whose configuration differs from
        the host's logs it once per (tier, host value)."""
        for tier, cap in self.capacities.items():
            if self._applied.get(tier) != cap:  # first transaction, or reconfigured since
                if t.idx.capacities[tier] != cap:
                    self.apply(t, t.idx.set_capacity(tier, cap))
                self._applied[tier] = cap
            host = t.idx.capacities[tier]
            if host != cap and (tier, host) not in self._warned:
                self._warned.add((tier, host))
                log.warning("host cache %s: %s capacity is %d bytes (set by another process), "
                            "this process is configured for %d: using the host's",
                            self.ns, tier, host, cap)  # fmt: skip

    def apply(self, t: Txn, evictions: list[Eviction]) -> None:
        """Carry out index evictions (under the lock): unlink dropped segments, keep demoted ones
        mapped for writing after the lock is released, delete evicted disk entries."""
        for ev in evictions:
            if ev.tier == "disk":
                if self.drop_disk is not None:
                    self.drop_disk(ev.key)
                continue
            self.stats.evictions += 1
            seg = None
            if ev.demote_to:
                try:
                    seg = Segment.attach(self.ns, ev.key)
                except CacheMiss:
                    t.idx.abort(ev.key, ev.demote_to)
            self.unlink(ev.key)
            if seg is not None:
                t.demotions.append(seg)

    def _demote(self, seg: Segment) -> None:
        ok = False
        try:
            assert self.demote is not None and seg.data is not None
            ok = bool(self.demote(seg.key, seg.layout, seg.data))
        except Exception:
            log.exception("demotion of %s to disk failed", seg.key[:12])
        finally:
            seg.close()
        with self.txn() as t:
            if not ok:
                t.idx.abort(seg.key, "disk")
            elif not t.idx.commit(seg.key, "disk"):  # the disk tier was switched off meanwhile
                ok = False
                if self.drop_disk is not None:
                    self.drop_disk(seg.key)
        self.stats.demotions += int(ok)

    def _load(self) -> CacheIndex:
        self._raw = b""
        try:
            self._raw = self._path.read_bytes()
            idx = CacheIndex.from_dict(json.loads(self._raw), self.clock)
            for tier in TIERS:
                for e in idx.entries(tier):
                    check_key(e.key)  # a damaged index must not name arbitrary segments
            return idx
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError) as e:
            log.warning("host cache index %s unreadable (%s): starting empty", self._path, e)
        return CacheIndex(self.capacities, self.clock)

    def _save(self, idx: CacheIndex) -> None:
        raw = json.dumps(idx.to_dict()).encode()
        if raw != self._raw:  # read-only transactions write nothing
            tmp = self._path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(raw)
            os.replace(tmp, self._path)

    # ---- entry life cycle -----------------------------------------------------------------------
    def status(self, key: str) -> str:
        """ "ready", "building" or "absent" in DRAM."""
        with self.txn() as t:
            return t.idx.state(check_key(key), "dram")

    def create(
        self, key: str, layout: TemplateLayout, fresh: bool = True, back_data: bool = True
    ) -> Segment:
        """Reserve capacity (evicting/demoting LRU unused entries; CacheFull when impossible) and
        create the segment, state building. Finish with commit() or abort(). ValueError when the
        key is already in DRAM (or, if fresh, anywhere: a capture must not shadow a disk copy).
        back_data=False: the data's pages are left unbacked for the writer (Segment.back)."""
        check_key(key)
        with self.txn() as t:
            if fresh and t.idx.get(key, "disk") is not None:
                raise ValueError(f"{key[:12]} is already {t.idx.state(key, 'disk')} on disk")
            self.apply(t, t.idx.reserve(key, "dram", layout.nbytes, self.owner))
            try:
                seg = Segment.create(self.ns, key, layout)
            except BaseException:
                t.idx.abort(key, "dram")
                raise
        try:
            seg.allocate(back_data)  # outside the host lock: backing tens of GB takes a while
        except OSError as e:
            self.abort(seg)
            raise CacheFull(f"/dev/shm cannot hold {layout.nbytes} bytes: {e}") from e
        return seg

    def commit(self, seg: Segment, acquire: bool = False) -> None:
        """Set the ready flag (last write), then mark ready; optionally take a reference in the
        same locked step (so it cannot be evicted in between)."""
        seg.set_ready()
        with self.txn() as t:
            if not t.idx.commit(seg.key, "dram"):
                raise CacheMiss(f"{seg.key[:12]} vanished while building")
            if acquire:
                t.idx.acquire(seg.key, "dram", self.owner)
                self._adopt(t, seg)

    def abort(self, seg: Segment) -> None:
        seg.close()
        with self.txn() as t:
            if t.idx.abort(seg.key, "dram"):  # only then is the name still ours
                unlink_shm(segment_name(self.ns, seg.key))

    def attach(self, key: str) -> Segment | None:
        """A ready entry's mapping, with a reference taken on it (None if not ready in DRAM).
        The mapping is this process's one mapping of the segment, shared by its handles."""
        with self.txn() as t:
            e = t.idx.get(check_key(key), "dram")
            if e is None or e.state != READY:
                return None
            seg = self._mapped.get(key)
            if seg is not None and not seg.shows(self.ns):  # replaced since it was mapped
                self._retire(seg)
                seg = None
            if seg is None:
                try:
                    seg = Segment.attach(self.ns, key)
                except CacheMiss as err:
                    log.warning("dram entry %s listed but unusable (%s): forgotten", key[:12], err)
                    if not e.refs:
                        self.apply(t, t.idx.remove(key, "dram"))
                    return None
                self._adopt(t, seg)
            else:
                seg.users += 1
            t.idx.acquire(key, "dram", self.owner)
            return seg

    def _adopt(self, t: Txn, seg: Segment) -> None:
        """Keep a ready segment mapped in this process, with one user (under the lock)."""
        self._sweep(t)
        seg.users = 1
        self._mapped[seg.key] = seg

    def _retire(self, seg: Segment) -> None:
        """Forget a mapping; close it now if idle, else at its last handle's release."""
        if self._mapped.get(seg.key) is seg:
            del self._mapped[seg.key]
        if seg.users == 0:
            self._unmap(seg)

    def _unmap(self, seg: Segment) -> None:
        if self.on_unmap is not None and seg.pinned is not None:
            try:
                self.on_unmap(seg)
            except Exception:
                log.exception("unpinning segment %s failed", seg.key[:12])
        seg.pinned = None
        seg.close()

    def _sweep(self, t: Txn) -> None:
        """Close idle mappings whose entry the index no longer lists as ready (evicted or deleted
        by any process): their memory is freed only once every process unmapped it."""
        for key, seg in list(self._mapped.items()):
            if seg.users == 0 and t.idx.state(key, "dram") != READY:
                self._retire(seg)

    def release(self, seg: Segment) -> None:
        with self.txn() as t:
            try:
                t.idx.release(seg.key, "dram", self.owner)
            except ValueError:
                log.warning("release of %s without a reference", seg.key[:12])
            seg.users = max(0, seg.users - 1)
            if self._mapped.get(seg.key) is not seg:
                if seg.users == 0:
                    self._unmap(seg)  # retired while in use
            self._sweep(t)

    def delete(self, key: str) -> None:
        """Forget and unlink the DRAM copy (EntryInUse while referenced or building)."""
        with self.txn() as t:
            if t.idx.remove(check_key(key), "dram"):
                self.unlink(key)

    def unlink(self, key: str) -> None:
        """Remove a segment's name; only inside a txn, after the index forgot the entry. This
        process's mapping of it closes now if idle, else at its last handle's release."""
        unlink_shm(segment_name(self.ns, key))
        seg = self._mapped.get(key)
        if seg is not None:
            self._retire(seg)

    @property
    def in_txn(self) -> bool:
        """True inside a transaction of this thread (where another one must not start)."""
        return getattr(self._local, "busy", False)

    def refcounts(self, key: str) -> dict[str, int]:
        with self.txn() as t:
            e = t.idx.get(key, "dram")
            return dict(e.refs) if e else {}

    def close(self) -> None:
        for seg in list(self._mapped.values()):
            seg.users = 0
            self._retire(seg)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
