"""Masked forwards of the convolutional blocks of UNet families: diffusers' ResnetBlock2D,
Downsample2D and Upsample2D compute only the tiles that cover a cache-reading row's masked tokens
(tiles.py), reading each tile's halo from the block's input map, whose unmasked positions hold
the template's values (every block before it wrote its cached output there). The row's masked
tokens are scattered into the block's cached output; the other rows (captures, full-path
requests) run the stock forward.

GroupNorm statistics are global over the map, so a tile cannot compute them: a cache-reading row
normalises with the statistics of the template's own run at this step (captured with the cache,
`GroupStats`), as SIGE does. For a replay of the template's own prompt, seed and mask every input
equals the template's, so the result equals the full computation (tests/engine/
test_sparse_convs.py); for an edit, the masked region is normalised as the template's map was.

Per ResNet (time_embedding_norm "default", no resampling inside, SiLU):
    h  = silu(gn1(x; template stats)) * valid        window a = t + 4, invalid = zero padding
    h  = conv1(h, padding 0) + time_emb_proj(silu(temb))         (t + 2)^2
    h  = silu(gn2(h; template stats)) * valid_inner
    y  = (shortcut(x centre) + conv2(h, padding 0)) / output_scale_factor      t^2
The fused GroupNorm + SiLU swap (engine/fused_norms.py) is honoured: its norm applies the SiLU
and `nonlinearity` is identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.downsampling import Downsample2D
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.upsampling import Upsample2D
from torch import nn

from instgenie.engine.kernels import kernel_enabled, optional_kernel
from instgenie.engine.masked.tiles import TileSet


def check_supported(block: nn.Module) -> str | None:
    """None if the sparse forward reproduces this block, else why not."""
    if isinstance(block, ResnetBlock2D):
        if block.upsample is not None or block.downsample is not None:
            return "resampling inside the ResNet"
        if block.time_embedding_norm != "default":
            return f"time_embedding_norm {block.time_embedding_norm!r}"
        if not isinstance(block.norm1, nn.GroupNorm) or not isinstance(block.norm2, nn.GroupNorm):
            return "norms other than GroupNorm"
        if type(block.nonlinearity) not in (nn.SiLU, nn.Identity):
            return f"nonlinearity {type(block.nonlinearity).__name__}"
        if _kernel(block.conv1) != (3, 1, 1) or _kernel(block.conv2) != (3, 1, 1):
            return "convolutions other than 3x3, stride 1, padding 1"
        if block.conv_shortcut is not None and _kernel(block.conv_shortcut) != (1, 1, 0):
            return "a shortcut other than a 1x1 convolution"
        return None
    if isinstance(block, Downsample2D):
        if block.norm is not None or not block.use_conv or _kernel(block.conv) != (3, 2, 1):
            return "a downsampler other than a 3x3, stride 2, padding 1 convolution"
        return None
    if isinstance(block, Upsample2D):
        if block.norm is not None or block.use_conv_transpose or not block.interpolate:
            return "an upsampler other than nearest 2x + convolution"
        if not block.use_conv or _kernel(getattr(block, block.name if block.name == "conv"
                                                 else "Conv2d_0")) != (3, 1, 1):  # fmt: skip
            return "an upsampler other than nearest 2x + 3x3 convolution"
        return None
    return f"{type(block).__name__} has no sparse forward"


def kind_of(block: nn.Module) -> str:
    return {ResnetBlock2D: "resnet", Downsample2D: "down", Upsample2D: "up"}[type(block)]


def _kernel(conv: nn.Module) -> tuple[int, int, int] | None:
    if not isinstance(conv, nn.Conv2d) or conv.groups != 1 or conv.dilation != (1, 1):
        return None
    k, s, p = conv.kernel_size, conv.stride, conv.padding
    if k[0] != k[1] or s[0] != s[1] or not isinstance(p, tuple) or p[0] != p[1]:
        return None
    return k[0], s[0], p[0]


def _conv(conv: nn.Conv2d, x: torch.Tensor, stride: int = 1) -> torch.Tensor:
    """conv's weights without its padding (tiles carry their halo)."""
    return F.conv2d(x, conv.weight, conv.bias, stride)


# ---- GroupNorm statistics ------------------------------------------------------------------
def group_stats(x: torch.Tensor, num_groups: int, eps: float) -> torch.Tensor:
    """(R, 2, G) float32 (float64 for float64 maps): mean and 1/sqrt(var + eps) per row and
    group, as torch's group_norm computes them."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    var, mean = torch.var_mean(x.to(dt).reshape(x.shape[0], num_groups, -1), dim=-1,
                               unbiased=False)  # fmt: skip
    return torch.stack([mean, (var + eps).rsqrt()], dim=1)


def folded_norm(norm: nn.GroupNorm, stats: torch.Tensor, add: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(scale, shift) (R, C) float32 (float64 for float64 statistics) with
    norm(x + add)[r, c] = x * scale[r, c] + shift[r, c] under row r's statistics (R, 2, G):
    scale = rstd * weight, shift = bias + (add - mean) * scale."""
    R, _, G = stats.shape
    C = norm.num_channels
    mean = stats[:, 0].repeat_interleave(C // G, dim=1)
    scale = stats[:, 1].repeat_interleave(C // G, dim=1)
    dt = scale.dtype
    if norm.weight is not None:
        scale = scale * norm.weight.to(dt)
    centred = -mean if add is None else add.to(dt) - mean
    shift = centred * scale + (norm.bias.to(dt) if norm.bias is not None else 0.0)
    return scale.contiguous(), shift.contiguous()


def _silu_after(norm: nn.Module, act: nn.Module) -> bool:
    """Whether the norm's output goes through SiLU (FusedGroupNorm(silu=True) applies it itself;
    its `nonlinearity` is identity)."""
    return bool(getattr(norm, "silu", False)) or isinstance(act, nn.SiLU)


def _tile_norm(norm: nn.Module, x: torch.Tensor):  # noqa: ANN202 - the kernel or its reference
    """The fused tile kernel where the norm's kernel switch (ExecConfig.fused_group_norm) allows
    it on x's device and dtype, else the torch reference."""
    mode = getattr(norm, "mode", "off")
    if x.dtype in (torch.float16, torch.bfloat16, torch.float32) and kernel_enabled(mode, x.device):
        kernel = optional_kernel("tile_norm", "tile_norm")
        if kernel is not None:
            return kernel
    from triton_kernels.tile_norm import tile_norm_reference

    return tile_norm_reference


def resnet_stats_width(block: ResnetBlock2D) -> int:
    """Floats of one row's statistics of this ResNet: mean and rstd of norm1's and norm2's
    groups."""
    return 2 * (block.norm1.num_groups + block.norm2.num_groups)


def resnet_dense(
    block: ResnetBlock2D, x: torch.Tensor, temb: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock forward (the same module calls, so the same values), plus each row's
    statistics (R, resnet_stats_width) of norm1's and norm2's inputs (captures record them)."""
    s1 = group_stats(x, block.norm1.num_groups, block.norm1.eps)
    h = block.nonlinearity(block.norm1(x))
    h = block.conv1(h)
    if block.time_emb_proj is not None and temb is not None:
        if not block.skip_time_act:
            temb = block.nonlinearity(temb)
        h = h + block.time_emb_proj(temb)[:, :, None, None]
    s2 = group_stats(h, block.norm2.num_groups, block.norm2.eps)
    h = block.nonlinearity(block.norm2(h))
    h = block.conv2(block.dropout(h))
    shortcut = x if block.conv_shortcut is None else block.conv_shortcut(x)
    y = (shortcut + h) / block.output_scale_factor
    return y, torch.cat([s1.flatten(1), s2.flatten(1)], dim=1)


# ---- whole maps (bucketed graphs) ------------------------------------------------------------
def resnet_map(
    block: ResnetBlock2D, x: torch.Tensor, temb: torch.Tensor | None, stats: torch.Tensor,
    own: torch.Tensor, valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The ResNet on whole maps (the tiles' values in fixed shapes): each row is normalised
    with `stats` (R, width), the template's, or, where `own` (R,) bool is set, with its own
    (resnet_dense's values). Every output token is the function a tile computes for it (same
    inputs, same statistics, zero padding at the border), so the tokens a caller keeps equal the
    tiles' up to the convolutions' rounding. `valid`: (R * H * W,) bool, all set. Returns
    (R, C_out, H, W), channels_last for a channels_last x, and every row's own statistics
    (R, width) as resnet_dense gives them (captures record them)."""
    R, C, H, W = x.shape
    g1, g2 = block.norm1.num_groups, block.norm2.num_groups
    stats = stats.view(R, -1)
    pick = own.view(R, 1, 1)
    s1 = stats[:, : 2 * g1].view(R, 2, g1)
    own1 = group_stats(x, g1, block.norm1.eps)
    s1 = torch.where(pick, own1.to(s1.dtype), s1)
    tile_row = torch.arange(R, device=x.device)
    tn = _tile_norm(block.norm1, x)
    rows = x.permute(0, 2, 3, 1).reshape(R * H * W, C)  # a view for a channels_last map
    h = tn(rows, None, valid, tile_row, H * W, *folded_norm(block.norm1, s1),
           _silu_after(block.norm1, block.nonlinearity))  # fmt: skip
    h = block.conv1(h.view(R, H, W, C).permute(0, 3, 1, 2))  # its own zero padding
    add = None
    if block.time_emb_proj is not None and temb is not None:
        if not block.skip_time_act:
            temb = block.nonlinearity(temb)
        add = block.time_emb_proj(temb)  # (R, C'): added before norm2, folded into its shift
    c2 = h.shape[1]
    s2 = stats[:, 2 * g1 :].view(R, 2, g2)
    h_in = h if add is None else h + add[:, :, None, None].to(h.dtype)
    own2 = group_stats(h_in, g2, block.norm2.eps)
    s2 = torch.where(pick, own2.to(s2.dtype), s2)
    h_rows = h.permute(0, 2, 3, 1).reshape(R * H * W, c2)
    h = tn(h_rows, None, valid, tile_row, H * W, *folded_norm(block.norm2, s2, add),
           _silu_after(block.norm2, block.nonlinearity))  # fmt: skip
    h = block.conv2(block.dropout(h.view(R, H, W, c2).permute(0, 3, 1, 2)))
    shortcut = x if block.conv_shortcut is None else block.conv_shortcut(x)
    own = torch.cat([own1.flatten(1), own2.flatten(1)], dim=1)
    return (shortcut + h) / block.output_scale_factor, own


# ---- tiles -----------------------------------------------------------------------------------
def gather_windows(x: torch.Tensor, ts: TileSet) -> torch.Tensor:
    """(n, C, a, a) input windows of every active tile, channels_last memory."""
    R, C, H, W = x.shape
    rows = x.permute(0, 2, 3, 1).reshape(R * H * W, C)  # a view for a channels_last map
    g = rows.index_select(0, ts.gather).view(ts.n, ts.a, ts.a, C)
    return g.permute(0, 3, 1, 2)


def resnet_tiles(
    block: ResnetBlock2D, x: torch.Tensor, temb: torch.Tensor | None, ts: TileSet,
    stats: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """(n, C_out, t, t) outputs of every active tile (channels_last); stats (R, width) per row.
    Tiles stay token-major (NHWC) end to end: the norms are one pass each (tile_norm), and the
    time embedding folds into norm2's shift."""
    R, C, H, W = x.shape
    a, n, g1 = ts.a, ts.n, block.norm1.num_groups
    rows = x.permute(0, 2, 3, 1).reshape(R * H * W, C)  # a view for a channels_last map
    stats = stats.view(R, -1)
    s1 = stats[:, : 2 * g1].view(R, 2, g1)
    s2 = stats[:, 2 * g1 :].view(R, 2, block.norm2.num_groups)
    silu1 = _silu_after(block.norm1, block.nonlinearity)
    silu2 = _silu_after(block.norm2, block.nonlinearity)
    tn = _tile_norm(block.norm1, x)
    h = tn(rows, ts.gather, ts.valid.view(-1), ts.tile_row, a * a, *folded_norm(block.norm1, s1),
           silu1)  # fmt: skip
    h = _conv(block.conv1, h.view(n, a, a, C).permute(0, 3, 1, 2))  # (n, C', a - 2, a - 2)
    add = None
    if block.time_emb_proj is not None and temb is not None:
        if not block.skip_time_act:
            temb = block.nonlinearity(temb)
        add = block.time_emb_proj(temb)  # (R, C'): added before norm2, folded into its shift
    c2, b = h.shape[1], a - 2
    h_rows = h.permute(0, 2, 3, 1).reshape(n * b * b, c2)  # a view when cuDNN returns NHWC
    h = tn(h_rows, None, ts.valid_inner, ts.tile_row, b * b, *folded_norm(block.norm2, s2, add),
           silu2)  # fmt: skip
    h = _conv(block.conv2, block.dropout(h.view(n, b, b, c2).permute(0, 3, 1, 2)))
    t = ts.t
    centre = rows.index_select(0, ts.centre).view(n, t, t, C).permute(0, 3, 1, 2)
    shortcut = centre if block.conv_shortcut is None else _conv(block.conv_shortcut, centre)
    return (shortcut + h) / block.output_scale_factor


def down_tiles(block: Downsample2D, x: torch.Tensor, ts: TileSet) -> torch.Tensor:
    return _conv(block.conv, gather_windows(x, ts) * ts.valid, stride=2)


def up_tiles(block: Upsample2D, x: torch.Tensor, ts: TileSet) -> torch.Tensor:
    win = gather_windows(x, ts)  # (n, C, t/2 + 2, t/2 + 2) source positions
    up = win.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)[:, :, 1:-1, 1:-1]
    conv = block.conv if block.name == "conv" else block.Conv2d_0
    return _conv(conv, up * ts.valid)


def scatter_tiles(out_rows: torch.Tensor, tiles: torch.Tensor, ts: TileSet) -> None:
    """Write the masked tokens of `tiles` (n, C, t, t) into out_rows (R * Ho * Wo, C)."""
    n, C = tiles.shape[:2]
    flat = tiles.permute(0, 2, 3, 1).reshape(n * ts.t * ts.t, C)
    out_rows.index_copy_(0, ts.dst, flat.index_select(0, ts.src).to(out_rows.dtype))


def tiles_forward(block: nn.Module, kind: str, x: torch.Tensor, ts: TileSet,
                  stats: torch.Tensor | None, temb: Any = None) -> torch.Tensor:  # fmt: skip
    if kind == "resnet":
        assert stats is not None
        return resnet_tiles(block, x, temb, ts, stats)
    if kind == "down":
        return down_tiles(block, x, ts)
    return up_tiles(block, x, ts)
