"""One host's template-cache tiers as the simulator keeps them: DRAM and disk, each an LRU by bytes
(cache/tiered.py's policy, without its mechanics). A capture reserves its DRAM bytes when it
starts (cache/dram.py DramTier.create, at the end of the capture's first step) and commits at its
end; making room in DRAM demotes its least recently used entries to disk, never one an edit is
reading (in use); a capture that finds no room records nothing (host_store.py
_StreamingWriter.no_room). Making room on disk drops entries. A read of an entry only on disk
streams it for that edit and promotes it to DRAM (tiered.py loads a disk entry into DRAM on
acquire). A template larger than DRAM is captured straight to disk. Units: bytes."""

from __future__ import annotations

from collections import Counter, OrderedDict


class LRU:
    """Entries (template id -> bytes), least recently used first, within `capacity` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.used = 0  # bytes of entries and reservations

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def touch(self, key: str) -> None:
        self.entries.move_to_end(key)

    def make_room(self, nbytes: int, in_use: Counter | None = None) -> list[tuple[str, int]] | None:
        """Evict least recently used entries not `in_use` until `nbytes` more fit, and count
        those bytes as used (a reservation); returns the evicted entries, LRU first, or None
        (nothing evicted, nothing reserved) when they cannot fit."""
        if nbytes > self.capacity:
            return None
        free = self.capacity - self.used
        victims = []
        for k, n in self.entries.items():
            if free >= nbytes:
                break
            if not (in_use and in_use[k]):
                victims.append((k, n))
                free += n
        if free < nbytes:
            return None
        for k, n in victims:
            del self.entries[k]
            self.used -= n
        self.used += nbytes
        return victims

    def put(self, key: str, nbytes: int, reserved: bool = False) -> list[tuple[str, int]]:
        """Insert (or refresh) `key` as most recently used; returns the entries evicted to make
        room, LRU first. An entry larger than the capacity is not inserted. `reserved`: its
        bytes were counted by make_room already."""
        if key in self.entries:
            self.touch(key)
            return []
        if reserved:
            self.entries[key] = nbytes
            return []
        out = self.make_room(nbytes)
        if out is None:
            return []
        self.entries[key] = nbytes
        return out


class HostTiers:
    """A host's DRAM and disk tiers; `ideal`: every template is in DRAM, always."""

    def __init__(self, dram_bytes: int, disk_bytes: int, ideal: bool = False) -> None:
        self.dram = LRU(dram_bytes)
        self.disk = LRU(disk_bytes)
        self.ideal = ideal
        self.captures = 0  # captures committed here, count
        self.promotions = 0  # disk entries promoted to DRAM by a read, count
        self.no_room = 0  # captures that found no room (every entry in use), count
        self.in_use: Counter[str] = Counter()  # template -> edits reading it now
        self._reserved: dict[str, int] = {}  # template -> DRAM bytes its running capture holds

    def tier(self, template: str) -> str | None:
        """The fastest tier holding `template`'s cache ("dram" | "disk"), None if absent."""
        if self.ideal or template in self.dram:
            return "dram"
        return "disk" if template in self.disk else None

    def reserve(self, template: str, nbytes: int) -> bool:
        """A capture starts: room for it in DRAM, made from LRU entries not in use (demoted to
        disk). False when there is none: it records nothing. A template larger than DRAM goes
        straight to disk at commit."""
        if self.ideal or nbytes > self.dram.capacity:
            return True
        evicted = self.dram.make_room(nbytes, self.in_use)
        if evicted is None:
            self.no_room += 1
            return False
        self._reserved[template] = nbytes
        for key, n in evicted:
            self.disk.put(key, n)
        return True

    def commit(self, template: str, nbytes: int) -> None:
        """A capture (or promotion) lands in DRAM; DRAM's evictions are demoted to disk."""
        if nbytes > self.dram.capacity:
            self.disk.put(template, nbytes)  # captured straight to disk
            return
        reserved = self._reserved.pop(template, None) is not None
        for key, n in self.dram.put(template, nbytes, reserved):
            self.disk.put(key, n)  # demoted; the disk's own evictions are dropped

    def read(self, template: str, nbytes: int) -> str | None:
        """An edit opens `template`'s cache: its tier for this edit; LRU order refreshed, a disk
        entry promoted to DRAM (for the next edits). The entry is in use until `release`."""
        tier = self.tier(template)
        if self.ideal or tier is None:
            return tier
        self.in_use[template] += 1
        if tier == "dram":
            self.dram.touch(template)
        else:
            self.disk.touch(template)
            if nbytes <= self.dram.capacity:
                self.promotions += 1
                self.commit(template, nbytes)
        return tier

    def release(self, template: str) -> None:
        """An edit that read `template`'s cache (read() gave a tier) is done with it: the entry
        counts as used now (cache/index.py stamps an entry at acquire, release and commit)."""
        for lru in (self.dram, self.disk):
            if template in lru:
                lru.touch(template)
        if self.in_use.get(template, 0) > 1:
            self.in_use[template] -= 1
        else:
            self.in_use.pop(template, None)

    @property
    def templates(self) -> int:
        """Templates held in any tier, count."""
        return len(set(self.dram.entries) | set(self.disk.entries))
