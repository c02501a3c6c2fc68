"""Sparse-conv tiles: gather + GroupNorm with given statistics + SiLU + zero padding, one pass.

    out[p, c] = valid[p] * act(x[idx[p], c] * scale[r, c] + shift[r, c]),  r = tile_row[p // P]

x (N, C) token-major rows of a map (fp16/bf16/fp32; a channels_last map viewed as rows); idx
(M,) int64 rows of x, or None for idx[p] = p; valid (M,) bool (False: a position outside the
image, the convolution's zero padding); tile_row (n,) int64 batch row of each tile, M = n * P
positions, P per tile; scale, shift (R, C) float32: the GroupNorm of row r with its statistics
and the norm's affine folded in (scale = rstd * weight, shift = bias - mean * scale; anything
added per row and channel before the norm, like a ResNet's time embedding, folds into shift);
act = SiLU when `silu`. out (M, C) in x's dtype, computed in float32 (as torch's GroupNorm
kernels do). The sparse ResNet forward (engine/masked/sparse_convs.py) otherwise runs gather,
dtype casts, the affine, SiLU and the mask as separate passes over the tiles.
`tile_norm_reference` is the torch form (the CPU path, and the kernel's test oracle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["tile_norm", "tile_norm_reference"]

_BLOCK_P = 32  # positions per program
_BLOCK_C = 128  # channels per program


@triton.jit
def _tile_norm_kernel(X, IDX, VALID, TROW, SCALE, SHIFT, OUT, M, C, P,
                      HAS_IDX: tl.constexpr, SILU: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    pm, cm = p < M, c < C
    src = tl.load(IDX + p, mask=pm, other=0).to(tl.int64) if HAS_IDX else p
    ok = tl.load(VALID + p, mask=pm, other=0) != 0
    r = tl.load(TROW + p // P, mask=pm, other=0).to(tl.int64)
    m2 = pm[:, None] & cm[None, :]
    x = tl.load(X + src[:, None] * C + c[None, :], mask=m2 & ok[:, None], other=0.0)
    sc = tl.load(SCALE + r[:, None] * C + c[None, :], mask=m2, other=0.0)
    sh = tl.load(SHIFT + r[:, None] * C + c[None, :], mask=m2, other=0.0)
    y = x.to(tl.float32) * sc + sh
    if SILU:
        y = y * tl.sigmoid(y)
    y = tl.where(ok[:, None], y, 0.0)
    tl.store(OUT + p[:, None] * C + c[None, :], y.to(OUT.dtype.element_ty), mask=m2)


def tile_norm_reference(
    x: torch.Tensor, idx: torch.Tensor | None, valid: torch.Tensor, tile_row: torch.Tensor,
    positions: int, scale: torch.Tensor, shift: torch.Tensor, silu: bool,
) -> torch.Tensor:  # fmt: skip
    g = x if idx is None else x.index_select(0, idx)
    r = tile_row.repeat_interleave(positions)
    y = torch.addcmul(shift.index_select(0, r), g.to(scale.dtype), scale.index_select(0, r))
    if silu:
        y = F.silu(y)
    return (y * valid[:, None]).to(x.dtype)


def tile_norm(
    x: torch.Tensor, idx: torch.Tensor | None, valid: torch.Tensor, tile_row: torch.Tensor,
    positions: int, scale: torch.Tensor, shift: torch.Tensor, silu: bool,
) -> torch.Tensor:  # fmt: skip
    """See the module doc; `positions` = P."""
    M = valid.numel() if idx is None else idx.numel()
    C = x.shape[1]
    if x.dim() != 2 or x.stride(1) != 1 or x.stride(0) != C:
        raise ValueError(f"x must be contiguous (N, C) rows, got {tuple(x.shape)} {x.stride()}")
    if valid.shape != (M,) or tile_row.numel() * positions != M:
        raise ValueError(f"{M} positions, valid {tuple(valid.shape)}, {tile_row.numel()} tiles "
                         f"of {positions}")  # fmt: skip
    if scale.dtype != torch.float32 or shift.dtype != torch.float32:
        raise TypeError("scale and shift must be float32")
    R = scale.shape[0]
    if scale.shape != (R, C) or shift.shape != (R, C):
        raise ValueError(f"scale/shift must be ({R}, {C})")
    out = torch.empty((M, C), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    grid = (triton.cdiv(M, _BLOCK_P), triton.cdiv(C, _BLOCK_C))
    _tile_norm_kernel[grid](
        x, idx if idx is not None else valid, valid.contiguous(), tile_row, scale.contiguous(),
        shift.contiguous(), out, M, C, positions, HAS_IDX=idx is not None, SILU=silu,
        BLOCK_P=_BLOCK_P, BLOCK_C=_BLOCK_C, num_warps=4,
    )  # fmt: skip
    return out
