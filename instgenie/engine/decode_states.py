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

import torch

from instgenie.engine.bytes_lru import BytesLRU
from instgenie.engine.crop_forward import DecodeState

#: default capacity, bytes: a 1024² SDXL entry is 256 KiB of fp32 latents + 8 KiB of statistics
DECODE_STATE_BYTES = 64 << 20


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


class DecodeStateCache(BytesLRU[DecodeState]):
    def __init__(self, capacity_bytes: int = DECODE_STATE_BYTES) -> None:
        super().__init__(capacity_bytes, "decode state")

    def get(self, key: str, latents: torch.Tensor) -> DecodeState | None:
        """The entry of template `key` if it was computed from `latents`, else None (counted as a
        miss; a stale entry is dropped)."""
        state = self.find(key)
        if state is not None and _same(state.latents, latents):
            self.hits += 1
            return state
        if state is not None:
            self.discard(key)
        self.misses += 1
        return None

    def put(self, key: str, state: DecodeState) -> None:
        """Keep `state` for `key` (replacing its entry), evicting the least recently used."""
        self.keep(key, state, state.nbytes)

    def stats(self) -> dict[str, float]:
        """Counters (prefix `decode_state_`)."""
        return self.counters("decode_state_")
