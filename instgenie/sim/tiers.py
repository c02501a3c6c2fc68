"""One host's template-cache tiers as the simulator keeps them: DRAM and disk, each an LRU by bytes
(cache/tiered.py's policy, without its mechanics). A capture commits to DRAM; making room in DRAM
demotes its least recently used entries to disk; making room on disk drops them. A read of an
entry only on disk streams it for that edit and promotes it to DRAM (tiered.py loads a disk
entry into DRAM on acquire). A template larger than DRAM is captured straight to disk. Units:
bytes."""

from __future__ import annotations

from collections import OrderedDict


class LRU:
    """Entries (template id -> bytes), least recently used first, within `capacity` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.used = 0

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def touch(self, key: str) -> None:
        self.entries.move_to_end(key)

    def put(self, key: str, nbytes: int) -> list[tuple[str, int]]:
        """Insert (or refresh) `key` as most recently used; returns the entries evicted to make
        room, LRU first. An entry larger than the capacity is not inserted."""
        if key in self.entries:
            self.touch(key)
            return []
        if nbytes > self.capacity:
            return []
        out = []
        while self.used + nbytes > self.capacity:
            k, n = self.entries.popitem(last=False)
            self.used -= n
            out.append((k, n))
        self.entries[key] = nbytes
        self.used += nbytes
        return out


class HostTiers:
    """A host's DRAM and disk tiers; `ideal`: every template is in DRAM, always."""

    def __init__(self, dram_bytes: int, disk_bytes: int, ideal: bool = False) -> None:
        self.dram = LRU(dram_bytes)
        self.disk = LRU(disk_bytes)
        self.ideal = ideal
        self.captures = 0  # captures committed here, count
        self.promotions = 0  # disk entries promoted to DRAM by a read, count

    def tier(self, template: str) -> str | None:
        """The fastest tier holding `template`'s cache ("dram" | "disk"), None if absent."""
        if self.ideal or template in self.dram:
            return "dram"
        return "disk" if template in self.disk else None

    def commit(self, template: str, nbytes: int) -> None:
        """A capture (or promotion) lands in DRAM; DRAM's evictions are demoted to disk."""
        if nbytes > self.dram.capacity:
            self.disk.put(template, nbytes)  # captured straight to disk
            return
        for key, n in self.dram.put(template, nbytes):
            self.disk.put(key, n)  # demoted; the disk's own evictions are dropped

    def read(self, template: str, nbytes: int) -> str | None:
        """An edit opens `template`'s cache: its tier for this edit; LRU order refreshed, a disk
        entry promoted to DRAM (for the next edits)."""
        tier = self.tier(template)
        if self.ideal or tier is None:
            return tier
        if tier == "dram":
            self.dram.touch(template)
        else:
            self.disk.touch(template)
            if nbytes <= self.dram.capacity:
                self.promotions += 1
                self.commit(template, nbytes)
        return tier

    @property
    def templates(self) -> int:
        """Templates held in any tier, count."""
        return len(set(self.dram.entries) | set(self.disk.entries))
