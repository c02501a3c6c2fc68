"""In-place per-channel bias add on a convolution output, NCHW- or channels_last-contiguous.

On CUDA, PyTorch runs a biased Conv2d as cuDNN's convolution without bias, then
`out.add_(bias.reshape(1, C, 1, 1))`. The broadcast operand makes that add a strided
(non-vectorised) elementwise kernel: in an SDXL UNet step its 62 launches moved ~1 TB/s
(docs/benchmarks/masked-step-h200.md). Here program (n * C + c, tile) adds the scalar bias[c] to
BLOCK contiguous elements of plane (n, c): plain vector loads and stores. A channels_last output
is memory of shape (N * H * W, C), row-major: program (row tile, channel tile) loads its
BLOCK_C biases once and adds them to BLOCK_R rows.

Numerics: y + bias in float32, rounded once to y's dtype — what torch's add_ does, so the result
is bit-identical to torch's biased convolution on CUDA. `add_channel_bias_reference` is what runs
where Triton cannot.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["add_channel_bias_", "add_channel_bias_reference"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK = 4096  # elements per program: 8 KiB of fp16
_MAX_BLOCK_C = 256  # channels per program of the channels_last kernel


@triton.jit
def _bias_add_kernel(Y, BIAS, C, PLANE, BLOCK: tl.constexpr):
    # Y is (N, C, PLANE) contiguous; program (plane p = n * C + c, tile t): elements
    # [t * BLOCK, (t + 1) * BLOCK) of plane p get bias[c]. int64 plane offsets.
    p = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < PLANE
    b = tl.load(BIAS + p % C).to(tl.float32)
    ptrs = Y + p * PLANE + offs
    y = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + b).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _bias_add_rows_kernel(Y, BIAS, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # Y is (R, C) row-major (a channels_last map, R = N * H * W); program (i, j) adds
    # bias[j * BLOCK_C:][:BLOCK_C] to rows [i * BLOCK_R, (i + 1) * BLOCK_R). int64 row offsets.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    b = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
    ok = (rows < R)[:, None] & col_ok[None, :]
    ptrs = Y + rows[:, None] * C + cols[None, :]
    y = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + b[None, :]).to(Y.dtype.element_ty), mask=ok)


def add_channel_bias_reference(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y += bias along dim 1 (torch's broadcasting add_); returns y."""
    return y.add_(bias.reshape(1, -1, *([1] * (y.dim() - 2))))


def add_channel_bias_(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y[:, c] += bias[c] in place for a contiguous (N, C, *spatial) y, or a 4-D channels_last
    one; returns y."""
    if y.dim() < 2:
        raise ValueError(f"y must be (N, C, ...), got shape {tuple(y.shape)}")
    C = y.shape[1]
    if bias.shape != (C,) or not bias.is_contiguous():
        raise ValueError(f"bias must be a contiguous ({C},) tensor, got {tuple(bias.shape)}")
    if y.dtype not in _DTYPES or bias.dtype != y.dtype:
        raise TypeError(f"y and bias must share a dtype in {_DTYPES}: {y.dtype}, {bias.dtype}")
    if y.numel() == 0:
        return y
    if not y.is_contiguous():
        if y.dim() == 4 and y.is_contiguous(memory_format=torch.channels_last):
            rows = y.numel() // C
            block_c = min(_MAX_BLOCK_C, triton.next_power_of_2(C))
            block_r = max(1, _MAX_BLOCK // block_c)
            grid = (triton.cdiv(rows, block_r), triton.cdiv(C, block_c))
            _bias_add_rows_kernel[grid](y, bias, rows, C, BLOCK_R=block_r, BLOCK_C=block_c,
                                        num_warps=8)  # fmt: skip
            return y
        raise ValueError("y must be contiguous (NCHW) or 4-D channels_last")
    plane = math.prod(y.shape[2:])
    block = min(_MAX_BLOCK, triton.next_power_of_2(plane))
    grid = (y.shape[0] * C, triton.cdiv(plane, block))
    _bias_add_kernel[grid](y, bias, C, plane, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return y
