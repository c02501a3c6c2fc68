"""The template catalogue: templates of one size and step count, Zipf popularity, cache bytes.

Popularity: the template of popularity rank k (1-based) is drawn with probability proportional to
k^-zipf; ranks are a seeded permutation of the registration order, so placement (which follows
registration order) and popularity are independent. Bytes: what the worker's capture stores,
pricing.cached_bytes of every hooked block's output (all its tokens, every batch row) at every
step (latents and prompt embeddings, a few MB, are left out).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from instgenie.scheduler.pricing import cached_bytes
from instgenie.scheduler.spec import CostSpec


def cache_bytes(spec: CostSpec, pixels: int, steps: int, rows: int) -> int:
    """Bytes of one template's cache: every block's rows at every step."""
    per_step = sum(
        cached_bytes(max(1, pixels // (b.stride * b.stride)), b.channels, rows, spec.cache_dtype)
        for b in spec.blocks
    )
    return per_step * steps


@dataclass(frozen=True)
class Catalogue:
    ids: tuple[str, ...]  # template ids, registration order
    probs: np.ndarray  # popularity of each, sums to 1 (same order)
    nbytes: int  # cache bytes of each template, bytes

    @classmethod
    def zipf(cls, n: int, s: float, nbytes: int, seed: int) -> Catalogue:
        rng = np.random.default_rng([seed, 1])
        ranks = rng.permutation(n) + 1
        w = ranks.astype(np.float64) ** -s
        return cls(tuple(f"t{i:05d}" for i in range(n)), w / w.sum(), nbytes)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n template indices drawn by popularity."""
        return rng.choice(len(self.ids), size=n, p=self.probs)

    def total_bytes(self) -> int:
        return self.nbytes * len(self.ids)
