"""GroupNorm (+ SiLU) over NCHW (or 4-D channels_last) maps in two parallel passes.

For x (N, C, *spatial) contiguous (or (N, C, H, W) channels_last), G groups of Cg = C / G
channels, S = prod(spatial):

    y[n, c] = (x[n, c] - mean[n, g]) * rstd[n, g] * weight[c] + bias[c],  g = c // Cg
    y       = silu(y) = y * sigmoid(y)                                      if silu

mean/var over the Cg * S elements of group (n, g) (biased variance, as torch.nn.GroupNorm), in
float32; the output is rounded once to x's dtype (torch rounds the normalised value, then SiLU
rounds again: results may differ by one rounding of the output dtype).

Why: PyTorch's CUDA GroupNorm reduces each (n, g) row with one thread block (at batch 1 with CFG,
an SDXL UNet has 2 * 32 = 64 rows on 132 SMs: ~65 us per norm), and applies weight/bias with a
broadcasting, non-vectorised elementwise kernel; SiLU is a third full pass. In an SDXL step those
take ~20 % of a batch-8 masked step's kernel time (docs/benchmarks/masked-step-h200.md). Here:

1. stats: every BLOCK-element tile of a group (grid N*G x tiles) writes its count-weighted
   partial (mean, M2) — Welford/Chan form, no E[x²] - mean² cancellation;
2. apply: every tile combines its group's partials (Chan's parallel formula, in a fixed order,
   so every tile of a group sees bit-identical statistics) and writes y for its elements.

Units: elements; a group's elements are contiguous in NCHW ([Cg channels] x [S positions]); in
NHWC they are S runs of Cg channels, C apart. The output has x's memory format.
`group_norm_reference` is what runs where Triton cannot (and what the kernel is tested against).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["group_norm", "group_norm_reference"]

_BLOCK = 4096  # elements per tile: 8 KiB of fp16 per program
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _element_offsets(g, offs, group_numel, cg: tl.constexpr, num_groups, NHWC: tl.constexpr):
    # Memory offsets of elements offs (< group_numel) of group row g = n * num_groups + group.
    # NCHW: the group's elements are contiguous. NHWC (4-D channels_last): element i is channel
    # i % cg of position i // cg; a position's C channels are contiguous.
    if NHWC:
        n = g // num_groups
        grp = g % num_groups
        c_total = cg * num_groups
        return n * group_numel * num_groups + (offs // cg) * c_total + grp * cg + offs % cg
    return g * group_numel + offs


@triton.jit
def _gn_stats_kernel(X, PART, group_numel, n_tiles, num_groups, CG: tl.constexpr,
                     BLOCK: tl.constexpr, NHWC: tl.constexpr):  # fmt: skip
    g = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    offs = t * BLOCK + tl.arange(0, BLOCK)
    ok = offs < group_numel
    addr = _element_offsets(g, offs, group_numel, CG, num_groups, NHWC)
    x = tl.load(X + addr, mask=ok, other=0.0).to(tl.float32)
    cnt = tl.minimum(group_numel - t * BLOCK, BLOCK).to(tl.float32)
    mean = tl.sum(x, 0) / cnt
    d = tl.where(ok, x - mean, 0.0)
    m2 = tl.sum(d * d, 0)
    base = PART + (g * n_tiles + t) * 2
    tl.store(base, mean)
    tl.store(base + 1, m2)


@triton.jit
def _gn_apply_kernel(X, Y, PART, W, B, group_numel, n_tiles, spatial, num_groups, eps,
                     CG: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr,
                     NHWC: tl.constexpr):  # fmt: skip
    g = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    # combine the group's partials: tile i holds min(BLOCK, numel - i * BLOCK) elements
    ti = tl.arange(0, TILES)
    t_ok = ti < n_tiles
    pm = tl.load(PART + (g * n_tiles + ti) * 2, mask=t_ok, other=0.0)
    pm2 = tl.load(PART + (g * n_tiles + ti) * 2 + 1, mask=t_ok, other=0.0)
    pc = tl.where(t_ok, tl.minimum(group_numel - ti * BLOCK, BLOCK), 0).to(tl.float32)
    total = group_numel * 1.0  # (not .to(): an argument equal to 1 arrives as a constexpr)
    mean = tl.sum(pc * pm, 0) / total
    dm = pm - mean
    var = (tl.sum(pm2, 0) + tl.sum(pc * dm * dm, 0)) / total
    rstd = 1.0 / tl.sqrt(var + eps)

    offs = t * BLOCK + tl.arange(0, BLOCK)
    ok = offs < group_numel
    addr = _element_offsets(g, offs, group_numel, CG, num_groups, NHWC)
    x = tl.load(X + addr, mask=ok, other=0.0).to(tl.float32)
    y = (x - mean) * rstd
    if HAS_W or HAS_B:
        if NHWC:
            c = (g % num_groups) * CG + offs % CG  # channel of each element
        else:
            c = (g % num_groups) * CG + offs // spatial
        if HAS_W:
            y = y * tl.load(W + c, mask=ok, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + c, mask=ok, other=0.0).to(tl.float32)
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(Y + addr, y.to(Y.dtype.element_ty), mask=ok)


def group_norm_reference(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    silu: bool = False,
) -> torch.Tensor:
    """torch.nn.functional.group_norm, then SiLU if asked (stock diffusers' two modules)."""
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if silu else y


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    silu: bool = False,
) -> torch.Tensor:
    """GroupNorm (+ SiLU) of a contiguous (N, C, *spatial) tensor; see the module doc."""
    if x.dim() < 2:
        raise ValueError(f"x must be (N, C, ...), got shape {tuple(x.shape)}")
    N, C = x.shape[:2]
    if num_groups <= 0 or C % num_groups:
        raise ValueError(f"{C} channels do not split into {num_groups} groups")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x dtype {x.dtype} is not one of {_DTYPES}")
    nhwc = not x.is_contiguous()
    if nhwc and not (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)):
        raise ValueError("x must be contiguous (NCHW) or 4-D channels_last (NHWC)")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.shape != (C,) or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous ({C},) tensor")
    y = torch.empty_like(x)  # same memory format as x
    spatial = math.prod(x.shape[2:])
    group_numel = (C // num_groups) * spatial
    if x.numel() == 0:
        return y
    n_tiles = triton.cdiv(group_numel, _BLOCK)
    part = torch.empty(N * num_groups, n_tiles, 2, device=x.device, dtype=torch.float32)
    grid = (N * num_groups, n_tiles)
    cg = C // num_groups
    # CG (channels per group) is a compile-time constant: the NHWC address arithmetic divides by
    # it per element (multiply-shift instead of integer division).
    _gn_stats_kernel[grid](x, part, group_numel, n_tiles, num_groups, CG=cg, BLOCK=_BLOCK,
                           NHWC=nhwc, num_warps=8)  # fmt: skip
    _gn_apply_kernel[grid](
        x, y, part, weight if weight is not None else x, bias if bias is not None else x,
        group_numel, n_tiles, spatial, num_groups, float(eps), CG=cg,
        BLOCK=_BLOCK, TILES=max(2, triton.next_power_of_2(n_tiles)),
        HAS_W=weight is not None, HAS_B=bias is not None, SILU=silu, NHWC=nhwc, num_warps=8,
    )  # fmt: skip
    return y
