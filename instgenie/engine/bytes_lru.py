"""A least-recently-used map bounded by its values' bytes, with hit/miss/eviction counters: the
store under the prompt cache (prompt_cache.py) and the templates' decoder statistics
(decode_states.py).

Invariants: `bytes` is the sum of the kept entries' sizes (as given to `put`, e.g. tensor
storage); it never exceeds `capacity`; an entry larger than the whole capacity is not kept;
capacity 0 keeps nothing; `find` and `keep` make an entry the most recently used. Subclasses
count hits and misses in their own lookups.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

V = TypeVar("V")


class BytesLRU(Generic[V]):
    def __init__(self, capacity_bytes: int, what: str) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{what} capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def find(self, key: Hashable) -> V | None:
        """The value of `key` (now the most recently used), or None; counts neither."""
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        return hit[0]

    def keep(self, key: Hashable, value: V, nbytes: int) -> bool:
        """Keep `value` for `key` (replacing its entry), evicting the least recently used;
        False when it is larger than the whole capacity (not kept)."""
        self.discard(key)
        if not 0 < nbytes <= self.capacity:
            return False
        while self.bytes + nbytes > self.capacity:
            _, (_, old) = self._entries.popitem(last=False)
            self.bytes -= old
            self.evictions += 1
        self._entries[key] = (value, nbytes)
        self.bytes += nbytes
        return True

    def discard(self, key: Hashable) -> None:
        hit = self._entries.pop(key, None)
        if hit is not None:
            self.bytes -= hit[1]

    @contextmanager
    def untracked(self) -> Iterator[None]:
        """Inside it lookups and keeps run as usual; on exit the entries kept inside are dropped
        and the counters are what they were (a worker's warm-up leaves the cache as found)."""
        keys, counts = set(self._entries), (self.hits, self.misses, self.evictions)
        try:
            yield
        finally:
            for key in [k for k in self._entries if k not in keys]:
                self.discard(key)
            self.hits, self.misses, self.evictions = counts

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def counters(self, prefix: str) -> dict[str, float]:
        """Counters named `<prefix>hits`, `misses`, `evictions`, `bytes`, `entries`."""
        return {
            f"{prefix}hits": float(self.hits),
            f"{prefix}misses": float(self.misses),
            f"{prefix}evictions": float(self.evictions),
            f"{prefix}bytes": float(self.bytes),
            f"{prefix}entries": float(len(self._entries)),
        }
