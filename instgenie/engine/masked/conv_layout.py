"""Where a backbone's sparse conv blocks and the template's GroupNorm statistics sit in a cache
(engine/masked/conv_blocks.py reads and writes them through the step context)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ConvLayout:
    """A backbone's sparse conv blocks (hooks.install with sparse_convs) and where the template's
    GroupNorm statistics live in its cache: one pseudo-block `stats_block` (no module; the id
    after the last hooked block) of shape (rows, 1, 2 * width) per step, in the activations'
    dtype, holding each row's float statistics as hi + lo parts (hi = v rounded to the dtype,
    lo = the remainder rounded: about twice the dtype's precision, so float16 caches keep
    means and rstds to ~1e-7 relative; float8 caches cannot hold them: executor.py)."""

    #: block id -> (kind "resnet" | "down" | "up", output level)
    blocks: dict[int, tuple[str, int]]
    #: ResNet block id -> (offset, width) of its statistics in a row's vector
    stats: dict[int, tuple[int, int]]
    width: int
    stats_block: int


def encode_stats(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(rows, width) float statistics -> (rows, 1, 2 * width) hi/lo parts in `dtype`."""
    hi = v.to(dtype)
    lo = (v - hi.to(v.dtype)).to(dtype)
    return torch.cat([hi, lo], dim=1)[:, None]


def decode_stats(enc: torch.Tensor) -> torch.Tensor:
    """encode_stats's inverse: (rows, 1, 2 * width) -> (rows, width) float32 (float64 for
    float64 parts)."""
    dt = torch.float64 if enc.dtype == torch.float64 else torch.float32
    w = enc.shape[-1] // 2
    return enc[:, 0, :w].to(dt) + enc[:, 0, w:].to(dt)
