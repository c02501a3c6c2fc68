"""A bytes-bounded LRU of templates' decoder statistics (crop_forward.DecodeState), keyed by
the template cache key (RequestState.cache_key), in the process that VAE-decodes.

A state is computed at first use from the template's final latents, which every edit of the
template carries (RequestState.template_latents): its prefix statistics first (the
latent-resolution layers, cheap), its suffix statistics (one whole decode) only once an edit
of it is decoded cropped. Invariants: capacity and `bytes` count tensor storage (numel x
element size) of the entries; an entry larger than the whole capacity is not kept; capacity 0
keeps nothing. An entry is returned only for latents equal to the ones it was computed from (a
template recaptured under its key with other latents is computed anew).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from instgenie.engine.crop_forward import DecodeState

#: default capacity, bytes: a 1024² SDXL entry is 256 KiB of fp32 latents + 8 KiB of statistics
DECODE_STATE_BYTES = 64 << 20


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


class DecodeStateCache:
    def __init__(self, capacity_bytes: int = DECODE_STATE_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"decode state capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self._entries: OrderedDict[str, DecodeState] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, key: str, latents: torch.Tensor) -> DecodeState | None:
        """The entry of template `key` if it was computed from `latents`, else None (counted as a
        miss; a stale entry is dropped)."""
        state = self._entries.get(key)
        if state is not None and _same(state.latents, latents):
            self._entries.move_to_end(key)
            self.hits += 1
            return state
        if state is not None:
            self._drop(key)
        self.misses += 1
        return None

    def put(self, key: str, state: DecodeState) -> None:
        """Keep `state` for `key` (replacing its entry), evicting the least recently used."""
        if key in self._entries:
            self._drop(key)
        size = state.nbytes
        if not 0 < size <= self.capacity:
            return
        while self.bytes + size > self.capacity:
            old = next(iter(self._entries))
            self._drop(old)
            self.evictions += 1
        self._entries[key] = state
        self.bytes += size

    def _drop(self, key: str) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def stats(self) -> dict[str, float]:
        """Counters (prefix `decode_state_`)."""
        return {
            "decode_state_hits": float(self.hits),
            "decode_state_misses": float(self.misses),
            "decode_state_evictions": float(self.evictions),
            "decode_state_bytes": float(self.bytes),
            "decode_state_entries": float(len(self._entries)),
        }
