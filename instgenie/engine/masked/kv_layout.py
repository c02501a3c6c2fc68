"""Where a Flux backbone's keys and values sit in a template's cache (ExecConfig.kv_cache on;
engine/masked/flux_kv.py reads and writes them through the step context).

A K/V block b caches, per step and CFG row, its image tokens' keys in block b's own slot and
their values in slot `values[b]` (after every other cached block, so slot ids stay 0..n-1, as
cache/layout.py needs), both (rows, L, inner) in the cache dtype: keys after the block's RMSNorm
and RoPE (what attention reads), values as projected. Its output is not cached: a masked K/V
block reads only its masked tokens' inputs (computed by the block before it), and the unmasked
rows of the last block's output feed only the model's final projection of unmasked tokens, whose
latents are replaced by the template's after the step (executor.after_step). So a K/V template
holds 2 slabs per block where an output cache holds 1 (2x the bytes), and a K/V block cannot
compute all its tokens (its unmasked inputs are not cached): the planner gets no choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from instgenie.scheduler.pricing import KV_KINDS  # hooked block kinds whose K/V can be cached


@dataclass(frozen=True)
class KVLayout:
    #: K/V block id -> the cache slot of its values (its keys are in its own slot)
    values: dict[int, int]

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.values

    @property
    def num_slots(self) -> int:
        """Cache slots it adds beyond the hooked blocks' own."""
        return len(self.values)


def kv_layout(blocks: list, first_free: int) -> KVLayout | None:
    """The KVLayout of the K/V kinds among `blocks` (hooks.BlockInfo, id order) but the first,
    their value slots numbered from `first_free` (the first id after every other cached block);
    None when there are none (UNet families). The first block's inputs are the edit's own (the
    embedder runs on every token): it computes every key and value from them, as with an output
    cache, and caches its output, which the second block's masked rows start from. Its keys and
    values in a cache would be the template's, whose conditioning (Flux Fill: the mask and the
    masked image's latents) differs from the edit's around the mask: measured on flux-fill:ref,
    whole-image SSIM against the full path 0.989 with it cached against 0.993 without
    (docs/benchmarks/quality.md)."""
    ids = [b.block_id for b in blocks if b.kind in KV_KINDS][1:]
    if not ids:
        return None
    return KVLayout({b: first_free + i for i, b in enumerate(ids)})
