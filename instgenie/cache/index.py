"""Cache index: which template lives in which tier, its size, state, users and recency.

A pure state machine (no I/O, injectable clock), so every eviction decision can be tested with a
fake clock. Operations return what the caller must do (a list of `Eviction`s to carry out, in
order); the caller moves the bytes.

Invariants (checked by `check_invariants`, asserted after every step of the property test):
  * per enabled tier: sum of entry sizes (bytes) <= capacity (bytes); a disabled tier is empty;
  * reference counts are > 0 per owner (an owner with no reference is not listed);
  * an entry with references or in state "building" is never evicted, nor is the disk entry of
    a key being loaded into DRAM (state "building" there: the loader is reading its file);
  * a "building" entry has no references (readers only see "ready" entries).
Entries are keyed by (key, tier): a template may be in DRAM and on disk at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

TIERS = ("dram", "disk")
BUILDING, READY = "building", "ready"
#: owner used by single-process callers; cross-process callers pass "pid:start_time"
LOCAL = "local"


class CacheFull(Exception):
    """No room: the tier is smaller than the entry, or only in-use/building entries remain."""


class TierDisabled(CacheFull):
    """The tier is switched off (e.g. the disk filled up)."""


class TooLarge(CacheFull):
    """No room ever: the entry is larger than every tier's whole capacity (a tier configured
    off counts as 0 bytes), so no eviction and no wait can make it fit on this host."""


class EntryInUse(Exception):
    """The entry has references (or is being built) and cannot be removed."""


@dataclass(frozen=True)
class Eviction:
    """Carry out in list order: for demote_to="disk", copy the bytes to a disk entry that the index
    has already reserved (state building; commit or abort it afterwards), then free the source."""

    key: str
    tier: str
    nbytes: int
    demote_to: str | None = None


@dataclass
class IndexEntry:
    key: str
    tier: str
    nbytes: int
    state: str
    #: clock value of the last reserve/commit/acquire/release/touch (seconds)
    last_use: float
    #: owner -> number of references held (always > 0)
    refs: dict[str, int] = field(default_factory=dict)
    #: owner that reserved the entry; only meaningful while building
    builder: str = LOCAL
    #: tie-break for equal last_use values: larger = used later
    seq: int = 0

    @property
    def refcount(self) -> int:
        return sum(self.refs.values())

    @property
    def evictable(self) -> bool:
        return self.state == READY and not self.refs


class CacheIndex:
    def __init__(
        self,
        capacities: Mapping[str, int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for tier, cap in capacities.items():
            if tier not in TIERS or type(cap) is not int or cap < 0:
                raise ValueError(f"bad tier capacity {tier!r}: {cap!r}")
        self.capacities = {t: capacities.get(t, 0) for t in TIERS}
        #: a tier with capacity 0 is off from the start
        self.disabled = {t for t in TIERS if self.capacities[t] == 0}
        self.clock = clock
        self._entries: dict[tuple[str, str], IndexEntry] = {}
        self._seq = 0

    # ---- queries ---------------------------------------------------------------------------------
    def get(self, key: str, tier: str) -> IndexEntry | None:
        return self._entries.get((key, tier))

    def state(self, key: str, tier: str) -> str:
        """ "ready", "building" or "absent"."""
        e = self._entries.get((key, tier))
        return e.state if e else "absent"

    def entries(self, tier: str) -> list[IndexEntry]:
        """The tier's entries, least recently used first."""
        es = [e for (_, t), e in self._entries.items() if t == tier]
        return sorted(es, key=lambda e: (e.last_use, e.seq))

    def used(self, tier: str) -> int:
        return sum(e.nbytes for (_, t), e in self._entries.items() if t == tier)

    def is_enabled(self, tier: str) -> bool:
        return tier not in self.disabled

    def owners(self) -> set[str]:
        out = set()
        for e in self._entries.values():
            out.update(e.refs)
            if e.state == BUILDING:
                out.add(e.builder)
        return out

    # ---- state machine ---------------------------------------------------------------------------
    def reserve(self, key: str, tier: str, nbytes: int, owner: str = LOCAL) -> list[Eviction]:
        """Add key to tier in state building, making room by evicting LRU unused ready entries.

        Atomic: raises CacheFull (changing nothing) when even evicting every evictable entry
        would not make room. DRAM victims are demoted to disk when the disk tier is enabled, the
        victim has no disk entry yet and disk room can be made; otherwise they are dropped."""
        self._tier(tier)
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"bad size {nbytes!r}")
        if (key, tier) in self._entries:
            raise ValueError(f"{key[:12]} is already {self.state(key, tier)} in {tier}")
        victims = self._victims(tier, nbytes)
        out: list[Eviction] = []
        for v in victims:
            del self._entries[(v.key, tier)]
            # the key being reserved may be on disk (a load): its file must stay
            out.extend(self._demote_or_drop(v, owner, exclude=key))
        self._add(key, tier, nbytes, owner)
        return out

    def commit(self, key: str, tier: str) -> bool:
        """building -> ready. False when the entry vanished meanwhile (tier disabled, removed)."""
        e = self._entries.get((key, tier))
        if e is None:
            return False
        if e.state != BUILDING:
            raise ValueError(f"{key[:12]} in {tier} is not building")
        e.state = READY
        self._stamp(e)
        return True

    def abort(self, key: str, tier: str) -> bool:
        """building -> absent. False when there was nothing to abort."""
        e = self._entries.get((key, tier))
        if e is None or e.state != BUILDING:
            return False
        del self._entries[(key, tier)]
        return True

    def acquire(self, key: str, tier: str = "dram", owner: str = LOCAL) -> int:
        """Take a reference on a ready entry (KeyError if absent or still building); returns the
        entry's new reference count."""
        e = self._entries.get((key, tier))
        if e is None or e.state != READY:
            raise KeyError(f"{key[:12]} is not ready in {tier}")
        e.refs[owner] = e.refs.get(owner, 0) + 1
        self._stamp(e)
        return e.refcount

    def release(self, key: str, tier: str = "dram", owner: str = LOCAL) -> int:
        e = self._entries.get((key, tier))
        if e is None or e.refs.get(owner, 0) <= 0:
            raise ValueError(f"{owner} holds no reference on {key[:12]} in {tier}")
        e.refs[owner] -= 1
        if not e.refs[owner]:
            del e.refs[owner]
        self._stamp(e)
        return e.refcount

    def touch(self, key: str, tier: str | None = None, at: float | None = None) -> None:
        """Mark as used now (or at time `at`, e.g. a file's mtime when rebuilding the index)."""
        for t in self._tiers(tier):
            e = self._entries.get((key, t))
            if e is not None:
                self._stamp(e, at)

    def remove(self, key: str, tier: str | None = None) -> list[Eviction]:
        """Forget key (in one tier or all); raises EntryInUse if it has references or is being
        built by someone else's writer (abort that instead)."""
        es = [e for t in self._tiers(tier) if (e := self._entries.get((key, t)))]
        for e in es:
            if e.refs or e.state == BUILDING:
                raise EntryInUse(f"{key[:12]} in {e.tier} is {e.state}, {e.refcount} refs")
        for e in es:
            del self._entries[(key, e.tier)]
        return [Eviction(e.key, e.tier, e.nbytes) for e in es]

    def forget(self, key: str, tier: str) -> Eviction | None:
        """Drop the record whatever its state or references: its storage vanished underneath
        (e.g. the segment was removed by hand). Holders keep their open mappings."""
        e = self._entries.pop((key, tier), None)
        return Eviction(e.key, tier, e.nbytes) if e else None

    def evict_for(self, tier: str, nbytes: int, exclude: str | None = None) -> list[Eviction]:
        """Drop LRU evictable entries of tier until nbytes are freed or none is left (the device
        ran out of space before the index's capacity did, e.g. ENOSPC). Never demotes."""
        out, freed = [], 0
        for e in self.entries(tier):
            if freed >= nbytes:
                break
            if self._evictable(e) and e.key != exclude:
                del self._entries[(e.key, tier)]
                out.append(Eviction(e.key, tier, e.nbytes))
                freed += e.nbytes
        return out

    def disable_tier(self, tier: str) -> list[Eviction]:
        """Switch a tier off: every entry is forgotten (refs included: readers already hold open
        files or mappings) and returned; reserve on it raises TierDisabled until enable_tier."""
        self._tier(tier, enabled_only=False)
        self.disabled.add(tier)
        es = [e for (_, t), e in self._entries.items() if t == tier]
        for e in es:
            del self._entries[(e.key, tier)]
        return [Eviction(e.key, tier, e.nbytes) for e in es]

    def set_capacity(self, tier: str, nbytes: int) -> list[Eviction]:
        """Change a tier's capacity (bytes), dropping LRU evictable entries that no longer fit.
        Entries in use stay (the tier is over capacity until they are released and evicted).
        0 switches the tier off; a capacity above 0 after 0 switches it on (a tier switched off
        by a failure, e.g. ENOSPC, stays off until enable_tier)."""
        self._tier(tier, enabled_only=False)
        old, self.capacities[tier] = self.capacities[tier], nbytes
        if nbytes == 0:
            return self.disable_tier(tier)
        if old == 0:
            self.disabled.discard(tier)  # switched on by configuration
        return self.evict_for(tier, self.used(tier) - nbytes)

    def enable_tier(self, tier: str) -> None:
        self._tier(tier, enabled_only=False)
        if self.capacities[tier] > 0:
            self.disabled.discard(tier)

    def drop_owner(self, owner: str) -> list[Eviction]:
        """A process died: drop its references and abort the entries it was building (returned:
        the caller frees their partial bytes)."""
        out = []
        for e in list(self._entries.values()):
            e.refs.pop(owner, None)
            if e.state == BUILDING and e.builder == owner:
                del self._entries[(e.key, e.tier)]
                out.append(Eviction(e.key, e.tier, e.nbytes))
        return out

    def check_invariants(self) -> None:
        for t in TIERS:
            used = self.used(t)
            assert used <= self.capacities[t], f"{t}: {used} > {self.capacities[t]} bytes"
            assert t not in self.disabled or used == 0, f"disabled tier {t} holds entries"
        for e in self._entries.values():
            assert e.state in (BUILDING, READY) and e.nbytes >= 0
            assert all(n > 0 for n in e.refs.values()), f"non-positive refcount {e.refs}"
            assert e.state == READY or not e.refs, "building entry with readers"

    # ---- serialization (the host index is this state as JSON) -----------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "capacities": dict(self.capacities),
            "disabled": sorted(self.disabled),
            "seq": self._seq,
            "entries": [vars(e) | {"refs": dict(e.refs)} for e in self._entries.values()],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], clock: Callable[[], float]) -> CacheIndex:
        idx = cls(d["capacities"], clock)
        idx.disabled = set(d["disabled"]) & set(TIERS) | idx.disabled
        idx._seq = int(d["seq"])
        for raw in d["entries"]:
            e = IndexEntry(**raw)
            if e.tier not in TIERS or e.state not in (BUILDING, READY):
                raise ValueError(f"bad index entry {raw!r}")
            idx._entries[(e.key, e.tier)] = e
        return idx

    # ---- internals -------------------------------------------------------------------------------
    def _tier(self, tier: str, enabled_only: bool = True) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}")
        if enabled_only and tier in self.disabled:
            raise TierDisabled(f"tier {tier} is disabled")

    def _tiers(self, tier: str | None) -> tuple[str, ...]:
        return TIERS if tier is None else (tier,)

    def _stamp(self, e: IndexEntry, at: float | None = None) -> None:
        self._seq += 1
        e.last_use, e.seq = (self.clock() if at is None else at), self._seq

    def _add(self, key: str, tier: str, nbytes: int, owner: str) -> None:
        e = IndexEntry(key, tier, nbytes, BUILDING, 0.0, builder=owner)
        self._stamp(e)
        self._entries[(key, tier)] = e

    def _evictable(self, e: IndexEntry) -> bool:
        if e.tier == "disk" and self.state(e.key, "dram") == BUILDING:
            return False  # being loaded into DRAM: the loader reads its file
        return e.evictable

    def _victims(self, tier: str, nbytes: int, exclude: str | None = None) -> list[IndexEntry]:
        """LRU evictable entries (but not key `exclude`) whose removal makes nbytes fit;
        CacheFull if impossible."""
        cap, used = self.capacities[tier], self.used(tier)
        need = used + nbytes - cap
        victims: list[IndexEntry] = []
        for e in self.entries(tier):
            if need <= 0:
                break
            if self._evictable(e) and e.key != exclude:
                victims.append(e)
                need -= e.nbytes
        if need > 0:
            raise CacheFull(f"{tier}: {nbytes} bytes do not fit ({used}/{cap} used, rest in use)")
        return victims

    def _demote_or_drop(self, v: IndexEntry, owner: str, exclude: str) -> list[Eviction]:
        if v.tier != "dram" or "disk" in self.disabled or (v.key, "disk") in self._entries:
            return [Eviction(v.key, v.tier, v.nbytes)]
        try:
            disk_victims = self._victims("disk", v.nbytes, exclude)
        except CacheFull:
            return [Eviction(v.key, v.tier, v.nbytes)]
        out = []
        for d in disk_victims:
            del self._entries[(d.key, "disk")]
            out.append(Eviction(d.key, "disk", d.nbytes))
        self._add(v.key, "disk", v.nbytes, owner)
        return [*out, Eviction(v.key, v.tier, v.nbytes, demote_to="disk")]
