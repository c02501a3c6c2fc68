"""A byte-budgeted LRU with pins: the adapter caches' bookkeeping, no tensors, no I/O.

Invariants: `used` is the sum of the entries' bytes; an entry with pins > 0 is never evicted;
after `put`, used <= capacity unless the pinned entries and the new one alone exceed it (then
nothing else unpinned is left): a new entry is never evicted by its own insertion. Eviction
order: least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any


@dataclass
class _Entry:
    value: Any
    nbytes: int
    pins: int = 0


class ByteLru:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Any | None:
        """The value (now the most recently used), or None."""
        e = self._entries.get(key)
        if e is None:
            return None
        self._entries.move_to_end(key)
        return e.value

    def put(self, key: Hashable, value: Any, nbytes: int) -> list[Hashable]:
        """Insert (or replace) `key`; returns the keys evicted to make room."""
        old = self._entries.pop(key, None)
        pins = 0
        if old is not None:
            self.used -= old.nbytes
            pins = old.pins
        self._entries[key] = _Entry(value, nbytes, pins)
        self.used += nbytes
        return self._evict(exclude=key)  # the new entry is about to be used

    def pin(self, key: Hashable) -> None:
        self._entries[key].pins += 1

    def unpin(self, key: Hashable) -> list[Hashable]:
        """Drop one pin; an entry over the budget may then be evicted (returned)."""
        e = self._entries.get(key)
        if e is None:
            return []
        if e.pins <= 0:
            raise RuntimeError(f"unpin of {key!r}, which is not pinned")
        e.pins -= 1
        return self._evict()

    def pins(self, key: Hashable) -> int:
        e = self._entries.get(key)
        return 0 if e is None else e.pins

    def remove(self, key: Hashable) -> bool:
        """Forget `key` (even pinned: its users keep their references)."""
        e = self._entries.pop(key, None)
        if e is None:
            return False
        self.used -= e.nbytes
        return True

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def _evict(self, exclude: Hashable = None) -> list[Hashable]:
        out = []
        for key in list(self._entries):
            if self.used <= self.capacity:
                break
            e = self._entries[key]
            if e.pins == 0 and key != exclude:
                del self._entries[key]
                self.used -= e.nbytes
                out.append(key)
        return out
