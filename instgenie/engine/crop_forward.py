"""The AutoencoderKL decoder split at its first upsampler, so that the part after it can run on
a crop of the map with GroupNorm statistics taken from a template's decode.

A diffusers `Decoder` is local (3x3 convolutions, nearest upsampling) except for two global
parts: every GroupNorm's per-(row, group) mean and variance over the whole map, and the
mid-block self-attention. Both sit at latent resolution, where the decoder is cheap (SDXL's
VAE at 1024²: about 8 % of its convolutions' multiply-adds, and 5 % in the attention), so the
*prefix* — post_quant_conv, conv_in, the mid-block and the up-blocks' ResNets before the first
upsampler — always runs on the whole latent map, exactly as diffusers runs it, and reports each
of its GroupNorms' statistics on the way. The *suffix* — the first upsampler onwards, on maps of
4x, 16x, 64x the pixels — runs either on the whole map with the stock modules
(the same operations as `vae.decode`) or on a crop, each GroupNorm normalising with the
statistics a whole decode of the template recorded (`DecodeState`; SIGE's approach). Zero
padding at a crop's inner edges falsifies pixels within the suffix's receptive radius of them
(`suffix_radius`); the caller keeps a margin.

Layer order is the forward order of `_prefix` + `_suffix`; statistics are indexed by it. The
forwards call the decoder's own submodules (fused GroupNorm and convolution kernels included:
engine/fused_norms.py, engine/fused_conv.py); only a replayed normalisation is recomputed here,
as torch ops in at least float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D, UpDecoderBlock2D
from torch import nn
from torch.nn import functional as F

from instgenie.engine.fused_norms import FusedGroupNorm

#: (mean, rstd) of one GroupNorm for one row, each (groups,)
Stats = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Box:
    """A crop of a (height, width) latent map: rows [y0, y1), columns [x0, x1), latent units."""

    y0: int
    y1: int
    x0: int
    x1: int
    height: int  # the whole map's size, latents
    width: int

    @property
    def area(self) -> int:
        return (self.y1 - self.y0) * (self.x1 - self.x0)

    @property
    def is_whole(self) -> bool:
        return (self.y0, self.x0, self.y1, self.x1) == (0, 0, self.height, self.width)


@dataclass(frozen=True, eq=False)
class DecodeState:
    """What a crop decode needs of a template's whole decode.

    Invariants: `norms[i]` is the i-th GroupNorm's (mean, rstd) in forward order (prefix then
    suffix), each (groups,), float32 for half-precision VAEs else the VAE's dtype; `num_prefix`
    of them belong to the prefix; `latents` are the template latents they were computed from
    ((1, C, h, w), the decoder's input scale and dtype): a state whose latents differ from a
    request's template latents is stale."""

    norms: tuple[Stats, ...]
    num_prefix: int
    latents: torch.Tensor

    @property
    def is_complete(self) -> bool:
        """Whether it holds the suffix's statistics too (record_decode), not only the prefix's
        (record_prefix)."""
        return len(self.norms) > self.num_prefix

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in self.norms for t in pair] + [self.latents]
        return sum(t.numel() * t.element_size() for t in tensors)


class UnsupportedDecoder(TypeError):
    """The VAE's decoder has a part this split does not reproduce (a spatial norm, an attention
    up-block, a time-conditioned or resampling ResNet, tiling): decode it whole."""


def check_decoder(vae: AutoencoderKL) -> None:
    """Raise UnsupportedDecoder unless `vae.decoder` has exactly the parts the split runs."""
    dec = vae.decoder
    if getattr(vae, "use_tiling", False):
        raise UnsupportedDecoder("tiled decoding is on")
    if not isinstance(dec.mid_block, UNetMidBlock2D) or not isinstance(
        dec.conv_norm_out, nn.GroupNorm
    ):
        raise UnsupportedDecoder("the decoder's mid-block or output norm is not the stock one")
    if not all(isinstance(b, UpDecoderBlock2D) for b in dec.up_blocks):
        raise UnsupportedDecoder("the decoder has up-blocks other than UpDecoderBlock2D")
    for r in [*dec.mid_block.resnets, *(r for b in dec.up_blocks for r in b.resnets)]:
        if r.upsample is not None or r.downsample is not None or r.time_emb_proj is not None:
            raise UnsupportedDecoder("a decoder ResNet resamples or is time-conditioned")
        if not isinstance(r.norm1, nn.GroupNorm) or not isinstance(r.norm2, nn.GroupNorm):
            raise UnsupportedDecoder("a decoder ResNet is not group-normed")
    for a in dec.mid_block.attentions:
        if a is not None and (a.spatial_norm is not None or a.norm_q is not None or a.norm_k
                              is not None or a.norm_cross):  # fmt: skip
            raise UnsupportedDecoder("the mid-block attention has a spatial, q/k or cross norm")


class _Observe:
    """The stock GroupNorm forward (torch's op or the fused kernel), recording each call's
    per-(row, group) statistics: the prefix, and a template's whole decode."""

    def __init__(self) -> None:
        self.stats: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, groups) each

    def __call__(self, norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        var, mean = torch.var_mean(
            x.reshape(x.shape[0], norm.num_groups, -1).to(acc), dim=-1, unbiased=False
        )
        self.stats.append((mean, torch.rsqrt(var + norm.eps)))
        return norm(x)


class _Stock:
    """The stock GroupNorm forward, nothing recorded: the suffix of a whole decode."""

    def __call__(self, norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)


class _Replay:
    """Normalises the i-th call with `norms[i]` (one row's statistics) instead of its input's."""

    def __init__(self, norms: tuple[Stats, ...], start: int) -> None:
        self.norms, self.i = norms, start

    def __call__(self, norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        mean, rstd = self.norms[self.i]
        self.i += 1
        acc = torch.promote_types(x.dtype, torch.float32)
        c, per = x.shape[1], x.shape[1] // norm.num_groups
        # y = (x - mean) * rstd * w + b as one scale and shift per channel, in `acc`
        scale = rstd.to(acc).repeat_interleave(per)
        if norm.weight is not None:
            scale = scale * norm.weight.to(acc)
        shift = -mean.to(acc).repeat_interleave(per) * scale
        if norm.bias is not None:
            shift = shift + norm.bias.to(acc)
        view = (1, c) + (1,) * (x.dim() - 2)
        y = torch.addcmul(shift.reshape(view), x.to(acc), scale.reshape(view)).to(x.dtype)
        return F.silu(y) if isinstance(norm, FusedGroupNorm) and norm.silu else y


def _resnet(r: ResnetBlock2D, x: torch.Tensor, norm) -> torch.Tensor:
    # ResnetBlock2D.forward without a time embedding (check_decoder), its norms through `norm`;
    # `nonlinearity` is identity where fuse_group_norms moved the SiLU into the norm
    h = r.conv1(r.nonlinearity(norm(r.norm1, x)))
    h = r.conv2(r.dropout(r.nonlinearity(norm(r.norm2, h))))
    skip = x if r.conv_shortcut is None else r.conv_shortcut(x)
    return (skip + h) / r.output_scale_factor


def _attention(attn: nn.Module, x: torch.Tensor, norm) -> torch.Tensor:
    # Attention(+AttnProcessor2_0)'s forward with its GroupNorm through `norm`, which for a 4-D
    # map normalises as diffusers' (B, C, HW) view does; the mid-block's, whole map only
    residual, (n, c, h, w) = x, x.shape
    if attn.group_norm is not None:
        x = norm(attn.group_norm, x)
    t = x.reshape(n, c, h * w).transpose(1, 2)
    d = c // attn.heads
    q, k, v = (p(t).view(n, -1, attn.heads, d).transpose(1, 2) for p in _projections(attn))
    o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
    o = attn.to_out[1](attn.to_out[0](o.transpose(1, 2).reshape(n, h * w, c).to(q.dtype)))
    o = o.transpose(-1, -2).reshape(n, c, h, w)
    if attn.residual_connection:
        o = o + residual
    return o / attn.rescale_output_factor


def _projections(attn: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    return attn.to_q, attn.to_k, attn.to_v


def _first_upsampling(vae: AutoencoderKL) -> int:
    """Index of the first up-block with an upsampler (len(up_blocks) when none has one)."""
    blocks = vae.decoder.up_blocks
    return next((i for i, b in enumerate(blocks) if b.upsamplers), len(blocks))


def _prefix(vae: AutoencoderKL, z: torch.Tensor, norm: _Observe) -> torch.Tensor:
    """Every layer at latent resolution, on the whole map: (n, C, h, w) at the first upsampler."""
    dec = vae.decoder
    if vae.post_quant_conv is not None:
        z = vae.post_quant_conv(z)
    x = dec.conv_in(z)
    mid = dec.mid_block
    x = _resnet(mid.resnets[0], x, norm)
    for attn, r in zip(mid.attentions, mid.resnets[1:], strict=True):
        if attn is not None:
            x = _attention(attn, x, norm)
        x = _resnet(r, x, norm)
    for block in dec.up_blocks[: _first_upsampling(vae) + 1]:
        for r in block.resnets:
            x = _resnet(r, x, norm)
    return x


def _suffix(vae: AutoencoderKL, x: torch.Tensor, norm) -> torch.Tensor:
    """The rest, from the first upsampler on: (n, 3, h x scale, w x scale) in [-1, 1]."""
    dec = vae.decoder
    first = _first_upsampling(vae)
    for i, block in enumerate(dec.up_blocks[first:], start=first):
        if i > first:
            for r in block.resnets:
                x = _resnet(r, x, norm)
        for up in block.upsamplers or ():
            x = up(x)
    return dec.conv_out(dec.conv_act(norm(dec.conv_norm_out, x)))


def suffix_radius(vae: AutoencoderKL) -> float:
    """The suffix's receptive radius in latents: how far from a crop's inner edge zero padding
    can reach (each k x k convolution adds (k - 1) / 2 pixels at its resolution)."""
    dec, scale, radius = vae.decoder, 1, 0.0

    def conv(c: nn.Conv2d) -> float:
        return (c.kernel_size[0] - 1) / 2 / scale

    first = _first_upsampling(vae)
    for i, block in enumerate(dec.up_blocks[first:], start=first):
        if i > first:
            radius += sum(conv(r.conv1) + conv(r.conv2) for r in block.resnets)
        for up in block.upsamplers or ():
            scale *= 2
            radius += conv(up.conv) if getattr(up, "conv", None) is not None else 0.0
    return radius + conv(dec.conv_out)


def decode_prefix(vae: AutoencoderKL, latents: torch.Tensor) -> tuple[torch.Tensor, list[Stats]]:
    """The prefix of one row's decode (latents (1, C, h, w), the decoder's input scale and
    dtype): (its output map, its GroupNorms' statistics in forward order)."""
    observe = _Observe()
    x = _prefix(vae, latents, observe)
    return x, [(m[0], r[0]) for m, r in observe.stats]


def decode_suffix_whole(vae: AutoencoderKL, x: torch.Tensor) -> torch.Tensor:
    """The suffix on the whole map with the stock modules: with decode_prefix, the same
    operations as `vae.decode` (bit-identical on one device)."""
    return _suffix(vae, x, _Stock())


def decode_suffix_crop(
    vae: AutoencoderKL, x: torch.Tensor, box: Box, state: DecodeState
) -> torch.Tensor:
    """The suffix on `x[..., box]` (x: the prefix's whole (1, C, h, w) map), every GroupNorm
    normalised with the template's statistics: the crop's pixels, (1, 3, box h x scale, box w x
    scale). Pixels within suffix_radius latents of an inner edge are not exact."""
    crop = x[:, :, box.y0 : box.y1, box.x0 : box.x1]
    return _suffix(vae, crop, _Replay(state.norms, state.num_prefix))


def record_prefix(vae: AutoencoderKL, latents: torch.Tensor) -> DecodeState:
    """A template's prefix statistics only (latents (1, C, h, w)): enough for `deviation`."""
    check_decoder(vae)
    _, stats = decode_prefix(vae, latents)
    return DecodeState(tuple(stats), len(stats), latents.detach().clone())


def record_decode(vae: AutoencoderKL, latents: torch.Tensor) -> tuple[torch.Tensor, DecodeState]:
    """Decode a template's latents whole (1, C, h, w) with the stock modules; returns (its image,
    (1, 3, H, W) in [-1, 1], the same as `vae.decode`'s; the statistics crop decodes replay)."""
    check_decoder(vae)
    if latents.shape[0] != 1:
        raise ValueError(f"a template decode state is one row, got {latents.shape[0]}")
    observe = _Observe()
    x = _prefix(vae, latents, observe)
    num_prefix = len(observe.stats)
    image = _suffix(vae, x, observe)
    norms = tuple((m[0], r[0]) for m, r in observe.stats)
    return image, DecodeState(norms, num_prefix, latents.detach().clone())


def deviation(template: DecodeState, prefix: list[Stats]) -> float:
    """How far a request's prefix statistics are from the template's: the largest, over the
    prefix's GroupNorms and groups, of |mean shift| in template standard deviations and
    |relative change of the standard deviation|. 0 for the template's own latents; inf when any
    statistic is not finite."""
    worst = 0.0
    for (mt, rt), (mr, rr) in zip(template.norms[: template.num_prefix], prefix, strict=True):
        both = torch.cat([((mr - mt) * rt).abs(), (rt / rr - 1).abs()])
        if not bool(torch.isfinite(both).all()):
            return math.inf
        worst = max(worst, float(both.max()))
    return worst
