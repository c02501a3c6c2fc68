"""Tile geometry of sparse convolutions: which windows of a block's input map each cache-reading
row gathers, and where the computed outputs go (SIGE's gather / scatter, generalised to a
varlen batch of rows with different masks).

A block's output grid (Ho, Wo) is cut into t x t tiles (t = `tile_size(Ho, Wo)`); a tile is
active in a row when it holds one of the row's masked tokens at that grid. Each active tile
reads one input window: `a x a` positions of the input grid starting at (oy, ox), which may
reach past the image (those positions are "invalid": the convolution's zero padding). After the
block computes its t x t outputs per tile, exactly the row's masked tokens are scattered into the
block's output (the template's cached output elsewhere), so the result does not depend on t.

Windows per kind (t even; units: positions of the named grid):
  resnet   input = output grid, a = t + 4 (two 3x3 convolutions: halo 2), origin (ty*t - 2, ...)
  down     3x3 conv, stride 2, padding 1: input grid is 2x the output's, a = 2t + 1,
           origin (2*ty*t - 1, ...)
  up       nearest 2x upsampling, then a 3x3 conv: input grid is half the output's; the window
           is a = t/2 + 2 source positions from (ty*t/2 - 1, ...), which upsample to t + 4
           positions from output row ty*t - 2 (the conv reads t + 2 of them, from ty*t - 1)
Pure index arithmetic on CPU; `TileSet.to(device)` moves the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("resnet", "down", "up")


def tile_size(ho: int, wo: int) -> int:
    """Tile side for an output grid: 8, or 4 on grids under 32 tokens a side (coarse grids
    waste more on partly covered tiles than they lose to the halo). Always even."""
    return 8 if min(ho, wo) >= 32 else 4


def window(kind: str, t: int) -> tuple[int, int, int]:
    """(input window side a, origin offset, origin scale): a tile at output (ty*t, tx*t) reads the
    input window of side a whose origin is (scale * ty*t + offset) / 2**(kind == 'up')."""
    if kind == "resnet":
        return t + 4, -2, 1
    if kind == "down":
        return 2 * t + 1, -1, 2
    if kind == "up":
        return t // 2 + 2, -2, 1  # origin in output units (ty*t - 2), halved: ty*t/2 - 1
    raise ValueError(f"unknown sparse conv kind {kind!r}")


@dataclass
class TileSet:
    """Active tiles of every cache-reading row for one (kind, output grid)."""

    kind: str
    t: int  # tile side, output positions
    a: int  # input window side, input positions
    n: int  # active tiles (all rows)
    #: (n * a * a,) int64 rows of the input map flattened token-major to (R * Hi * Wi, C) (an
    #: invalid position reads row 0: it is zeroed after the block's norm)
    gather: torch.Tensor
    #: (n, 1, a, a) bool: window positions inside the input image; for "up", (n, 1, t+2, t+2)
    #: positions of the upsampled map the conv reads, inside the output image
    valid: torch.Tensor
    #: (n,) int64 batch row of each tile
    tile_row: torch.Tensor
    #: (T,) int64 rows of the tiles' outputs flattened to (n * t * t, C) holding masked tokens,
    #: and (T,) int64 their rows in the output map flattened to (R * Ho * Wo, C)
    src: torch.Tensor
    dst: torch.Tensor
    #: ResNets: (n * (a-2)^2,) bool validity of conv1's outputs (conv2's zero padding), and
    #: (n * t * t,) int64 input rows of each tile's centre (the shortcut); None otherwise
    valid_inner: torch.Tensor | None = None
    centre: torch.Tensor | None = None

    def to(self, device: torch.device) -> TileSet:
        fields = ("gather", "valid", "tile_row", "src", "dst", "valid_inner", "centre")
        move = {f: None if (v := getattr(self, f)) is None else v.to(device, non_blocking=True)
                for f in fields}  # fmt: skip
        return TileSet(self.kind, self.t, self.a, self.n, **move)


def build_tiles(
    kind: str,
    out_hw: tuple[int, int],
    rows: list[tuple[int, torch.Tensor]],
) -> TileSet:
    """Tiles of `kind` whose output grid is out_hw = (Ho, Wo), for `rows`: (batch row, its masked
    token indices (n,) int64 at that grid) per cache-reading row."""
    ho, wo = out_hw
    t = tile_size(ho, wo)
    a, offset, scale = window(kind, t)
    hi, wi = {"resnet": (ho, wo), "down": (2 * ho, 2 * wo), "up": (ho // 2, wo // 2)}[kind]
    ny, nx = math.ceil(ho / t), math.ceil(wo / t)
    gathers, valids, tile_rows, srcs, dsts = [], [], [], [], []
    first_tile = 0
    r_a = torch.arange(a)
    for r, idx in rows:
        mask = torch.zeros(ho * wo, dtype=torch.bool)
        mask[idx] = True
        grid = F.pad(mask.view(1, 1, ho, wo).float(), (0, nx * t - wo, 0, ny * t - ho))
        active = F.max_pool2d(grid, t)[0, 0].flatten().nonzero().flatten()  # tile ids
        ty, tx = active // nx, active % nx
        if kind == "up":
            oy, ox = (ty * t + offset) // 2, (tx * t + offset) // 2
        else:
            oy, ox = scale * ty * t + offset, scale * tx * t + offset
        ys, xs = oy[:, None] + r_a, ox[:, None] + r_a  # (n_r, a)
        inside = ((ys >= 0) & (ys < hi))[:, :, None] & ((xs >= 0) & (xs < wi))[:, None, :]
        flat = ys.clamp(0, hi - 1)[:, :, None] * wi + xs.clamp(0, wi - 1)[:, None, :]
        gathers.append((flat + r * hi * wi).masked_fill(~inside, 0).flatten())
        if kind == "up":  # validity of the t + 2 upsampled positions the conv reads
            r_u = torch.arange(t + 2) - 1
            uy, ux = ty[:, None] * t + r_u, tx[:, None] * t + r_u
            inside = ((uy >= 0) & (uy < ho))[:, :, None] & ((ux >= 0) & (ux < wo))[:, None, :]
        valids.append(inside[:, None])
        tile_rows.append(torch.full((active.numel(),), r, dtype=torch.int64))
        # scatter: each masked token's tile (its position among this row's active tiles) and
        # offset inside the tile
        py, px = idx // wo, idx % wo
        tile_of = (py // t) * nx + px // t
        slot = torch.searchsorted(active, tile_of)
        srcs.append(((first_tile + slot) * t + py % t) * t + px % t)
        dsts.append(idx + r * ho * wo)
        first_tile += active.numel()
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
    v_side = t + 2 if kind == "up" else a
    valid = torch.cat(valids) if valids else torch.zeros(0, 1, v_side, v_side, dtype=torch.bool)
    gather = cat(gathers, torch.int64)
    inner = centre = None
    if kind == "resnet":
        inner = valid[:, 0, 1:-1, 1:-1].reshape(-1)
        centre = gather.view(-1, a, a)[:, 2:-2, 2:-2].reshape(-1)
    return TileSet(
        kind=kind,
        t=t,
        a=a,
        n=first_tile,
        gather=gather,
        valid=valid,
        tile_row=cat(tile_rows, torch.int64),
        src=cat(srcs, torch.int64),
        dst=cat(dsts, torch.int64),
        valid_inner=inner,
        centre=centre,
    )
