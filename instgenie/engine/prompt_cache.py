"""An LRU of prompt-encoder outputs, keyed by the texts (and flags) that produced them.

Edits on a template repeat their prompts (a try-on garment, a retouch instruction): the text
encoders, run per request, took 36 ms (SDXL: CLIP-L + OpenCLIP-bigG) and 35 ms (Flux: CLIP-L +
T5-XXL) of each request's encode on an H100 (docs/benchmarks/stages-h100.md), in the denoise
loop's process, between steps. The encoders are deterministic functions of the token ids (eval
mode, no dropout), so a hit returns the tensors encoding would return.

Invariants: capacity and `bytes` are in bytes of tensor storage (numel * element size); an
entry larger than the whole capacity is not kept; capacity 0 keeps nothing. The returned tensors
are shared by every request that hits: consumers must not write to them (the families
concatenate or copy them into each step's inputs; tests/engine/test_stage_work.py checks that a
request's output is unchanged by its prompt being cached).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from instgenie.engine.bytes_lru import BytesLRU
from instgenie.lora.apply import text_key

Entry = tuple[torch.Tensor | None, ...]


def entry_bytes(entry: Entry) -> int:
    return sum(t.numel() * t.element_size() for t in entry if t is not None)


class PromptCache(BytesLRU[Entry]):
    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes, "prompt cache")

    def get(self, key: Hashable, encode: Callable[[], Entry]) -> Entry:
        """The cached entry for `key`, or `encode()`'s result (kept if it fits). The key includes
        the text-encoder LoRAs active for this encode (lora.apply.text_key)."""
        key = (key, text_key())
        hit = self.find(key)
        if hit is not None:
            self.hits += 1
            return hit
        self.misses += 1
        entry = tuple(encode())
        self.keep(key, entry, entry_bytes(entry))
        return entry

    def stats(self) -> dict[str, float]:
        """Counters for the worker's Stats (prefix `prompt_`)."""
        return self.counters("prompt_")
