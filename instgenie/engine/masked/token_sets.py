"""Packed token sets of a masked step: which rows compute which tokens, as device index tensors
(built by StepContext from its requests' token masks), and their padding to a bucketed graph's
capacity (engine/bucket_graphs.py, decision 0051)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from instgenie.scheduler import buckets


@dataclass
class TokenSet:
    """Packed masked tokens of all rows for one token count L (indices on the model's device)."""

    L: int
    #: (T,) int64 indices into the batch flattened to (R * L, C)
    flat_idx: torch.Tensor
    #: (T,) int64 row of each packed token
    row_of: torch.Tensor
    #: (R + 1,) int32 cumulative query counts, and cumulative key counts (r * L)
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    num_rows: int
    #: padded to a bucket's capacity (StepContext.pad_to): (T,) int64 where each packed row's
    #: result goes, R * L (the output's trash row) for a pad; None: flat_idx (no pads)
    scatter_idx: torch.Tensor | None = None
    #: (R,) bool, rows that compute all L tokens (no cache, or a mask covering the grid; pads
    #: excluded): conv blocks on whole maps normalise them with their own GroupNorm statistics
    #: (conv_blocks._map_forward); None only for sets built elsewhere
    full_rows: torch.Tensor | None = None

    @property
    def total(self) -> int:
        return int(self.flat_idx.shape[0])


@dataclass
class JointSet:
    """Flux joint sequences: per row, queries [text (Tt); masked image tokens], keys
    [text (Tt); all image tokens (L)]. Indices on the model's device."""

    #: (Q,) indices into the batch's joint tokens flattened to (R * (Tt + L), C), Q = R*Tt + T
    sel: torch.Tensor
    #: (R * Tt,) and (T,) positions of text / image queries within the packed Q order
    txt_pos: torch.Tensor
    img_pos: torch.Tensor
    #: (Q,) position of each query within its row's joint sequence (indexes the RoPE tables)
    pos_in_row: torch.Tensor
    #: (Q,) row of each query
    row_of: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int


def _pad(
    idx: list[torch.Tensor], rows: list[torch.Tensor], counts: list[int], capacity: int, L: int
) -> list[torch.Tensor]:
    """Pad the per-row token lists (in place) to `capacity` tokens in all; the scatter indices.
    Rows take pads as `buckets.pads` says (in order, each up to L). A pad of row r gathers token
    0 of r (a finite, row-local input) and scatters to R * L, the trash row."""
    R = len(counts)
    scatter = list(idx)
    for r, n in enumerate(buckets.pads(counts, capacity, L)):
        if n == 0:
            continue
        idx[r] = torch.cat([idx[r], torch.full((n,), r * L, dtype=torch.int64)])
        scatter[r] = torch.cat([scatter[r], torch.full((n,), R * L, dtype=torch.int64)])
        rows[r] = torch.cat([rows[r], torch.full((n,), r, dtype=torch.int64)])
        counts[r] += n
    return scatter
