"""The step-context side of sparse convolutions: a hooked ResNet / sampler's forward for a batch
whose rows mix cache-reading edits (tiles: sparse_convs.py) and rows that compute every token
(captures and full-path requests: the stock forward), and the capture of the template's
GroupNorm statistics.

The block's output map is the template's cached output (`StepContext.map_buffer`: a fresh
tensor, never a staging buffer, because UNet skip connections read it long after the next block)
with each edit's masked tokens scattered in; it is returned as an NCHW view of token-major
memory (channels_last), as the UNet's channels_last layout produces it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from instgenie.engine.masked import sparse_convs
from instgenie.engine.masked.context import StepContext


def image_output(out: torch.Tensor) -> torch.Tensor:
    """A conv block's (R, C, H, W) output as cache rows (R, H * W, C)."""
    R, C = out.shape[:2]
    return out.permute(0, 2, 3, 1).reshape(R, -1, C)


def _args(kind: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any]:
    """(input map, time embedding or the upsampler's output_size)."""
    x = args[0] if args else kwargs["hidden_states" if kind != "resnet" else "input_tensor"]
    if kind == "resnet":
        return x, args[1] if len(args) > 1 else kwargs.get("temb")
    return x, args[1] if len(args) > 1 else kwargs.get("output_size")


def capture_forward(kind: str):
    """The forward of a block that computes every token while some row captures: the stock
    forward's values, plus (ResNets) each row's GroupNorm statistics for the capture."""

    def forward(block: nn.Module, ctx: StepContext, block_id: int, *args: Any, **kwargs: Any):
        if kind != "resnet":
            return None  # samplers have no statistics: the stock forward
        x, temb = _args(kind, args, kwargs)
        y, stats = sparse_convs.resnet_dense(block, x, temb)
        ctx.put_stats(block_id, stats)
        return y

    return forward


def _map_forward(kind: str, block: nn.Module, ctx: StepContext, block_id: int, x: torch.Tensor,
                 extra: Any, out_hw: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """The tiles' values computed on whole maps: the block on every row's whole map, then each
    row's tokens of the token set scattered into the cached output. Cache-reading rows are
    normalised with the template's statistics, rows that compute every token with their own
    (TokenSet.full_rows), as in the tile form, so a request computes the same values whichever
    form its step takes. A bucketed graph's form (padded token sets: fixed shapes), and an eager
    step's where its tiles would cover the maps anyway (_maps_pay)."""
    R, _, H, W = x.shape
    ho, wo = out_hw
    L = ho * wo
    ts = ctx.tokens(L)
    assert ts.full_rows is not None
    if kind == "resnet":
        stats = ctx.conv_stats(block_id, x.dtype)
        y, own = sparse_convs.resnet_map(block, x, extra, stats, ts.full_rows, ctx.ones(R * H * W))
        if ctx.capturing:
            ctx.put_stats(block_id, own)  # the capturing rows' own (they compute every token)
    else:
        y = type(block).forward(block, x)  # the class's: not this hook again
    c_out = y.shape[1]
    y_rows = y.permute(0, 2, 3, 1).reshape(R * L, c_out)  # a view when channels_last
    fresh = y_rows.index_select(0, ts.flat_idx)
    if ts.scatter_idx is not None:  # padded (a bucket)
        out = ctx.compose(block_id, y_rows.view(R, L, c_out), ts, fresh)
    else:  # a fresh map, never a loader's staging buffer (skip connections read it later)
        out = ctx.map_buffer(block_id, (R, L, c_out), y.dtype)
        out.view(R * L, c_out).index_copy_(0, ts.flat_idx, fresh.to(out.dtype))
    return out.view(R, ho, wo, c_out).permute(0, 3, 1, 2)


def _maps_pay(ctx: StepContext, kind: str, out_hw: tuple[int, int], R: int) -> bool:
    """Whether an eager step computes whole maps rather than tiles: the tiles' convolution
    outputs would number at least the sparse rows' maps' (a ResNet's conv1 on (t + 2)^2
    positions a tile and conv2 on t^2, against 2 per map position; a sampler's t^2 against 1):
    coarse grids, large masks. Both forms give the same values; pricing.conv_row_macs prices
    a row at the cheaper of the two by its MACs."""
    L = out_hw[0] * out_hw[1]
    dense = ctx.dense_rows(L)
    sparse_rows = R - (0 if dense is None else int(dense.numel()))
    ts = ctx.tiles(kind, out_hw)
    if kind == "resnet":
        return ts.n > 0 and ts.n * ((ts.t + 2) ** 2 + ts.t**2) >= 2 * sparse_rows * L
    return ts.n > 0 and ts.n * ts.t**2 >= sparse_rows * L


def masked_forward(kind: str):
    def forward(block: nn.Module, ctx: StepContext, block_id: int, *args: Any, **kwargs: Any):
        x, extra = _args(kind, args, kwargs)
        R, _, H, W = x.shape
        ho, wo = {"resnet": (H, W), "down": ((H + 1) // 2, (W + 1) // 2), "up": (2 * H, 2 * W)}[
            kind
        ]
        if kind == "up" and extra is not None and tuple(extra) != (ho, wo):
            raise NotImplementedError("sparse upsampling to an explicit output size")
        if ctx.pad_to is not None or _maps_pay(ctx, kind, (ho, wo), R):
            return _map_forward(kind, block, ctx, block_id, x, extra, (ho, wo))
        c_out = block.out_channels
        out = ctx.map_buffer(block_id, (R, ho * wo, c_out), x.dtype)
        rows = out.view(R * ho * wo, c_out)
        dense = ctx.dense_rows(ho * wo)
        if dense is not None:  # captures, full-path rows, full masks: stock forward
            xd = x.index_select(0, dense)
            if kind == "resnet":
                temb = extra.index_select(0, dense) if extra is not None else None
                yd, stats = sparse_convs.resnet_dense(block, xd, temb)
                if ctx.capturing:
                    full = stats.new_zeros(R, stats.shape[1])
                    full.index_copy_(0, dense, stats)
                    ctx.put_stats(block_id, full)
            else:
                yd = type(block).forward(block, xd)  # the class's: not this hook again
            out.view(R, ho, wo, c_out).index_copy_(0, dense, yd.permute(0, 2, 3, 1).to(out.dtype))
        ts = ctx.tiles(kind, (ho, wo))
        if ts.n:
            stats = ctx.conv_stats(block_id, x.dtype) if kind == "resnet" else None
            tiles = sparse_convs.tiles_forward(block, kind, x, ts, stats, extra)
            sparse_convs.scatter_tiles(rows, tiles, ts)
        return out.view(R, ho, wo, c_out).permute(0, 3, 1, 2)

    return forward
