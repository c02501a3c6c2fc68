"""GEGLU's gating (diffusers `GEGLU`, approximate="none") in one elementwise pass.

For p = proj(x) of shape (..., 2F), diffusers computes

    h, gate = p.chunk(2, dim=-1)
    out     = h * gelu(gate)            gelu(g) = g / 2 * (1 + erf(g / sqrt(2)))

as two strided (non-vectorised) elementwise kernels: gelu reads the gate half and writes F
values, the product reads both and writes F again — 5F element moves per row. Here one program
reads a BLOCK of h and of the gate of one row and writes out (..., F): 3F moves, contiguous.
In an SDXL UNet these two kernels were the largest elementwise cost of a step (140 launches;
docs/benchmarks/masked-step-h200.md).

Numerics: the same roundings as torch's two ops — gelu in float32, rounded to p's dtype, then the
product in float32, rounded again. gelu is 0.5 * g * (1 + erf(g / sqrt(2))) (libdevice's erf on
the GPU; the CPU interpreter has no erfc/normcdf); torch's CUDA kernel computes g * normcdf(g),
which keeps relative accuracy far into the negative tail. The two gelus differ by at most
|g| * 2**-23 in float32; after the two roundings, at SDXL shapes 2 % of fp16 (1.3 % of bf16)
outputs differ from torch's, each by at most two ulps plus |h * g| * 2**-22 (H200,
tests/engine/test_gpu_masked.py).
`geglu_reference` (torch's ops) is what runs where Triton cannot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["geglu", "geglu_reference"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK = 1024  # elements of one half-row per program: 2 KiB of fp16 read per half


@triton.jit
def _geglu_kernel(P, OUT, F_HALF, BLOCK: tl.constexpr):
    # Program (row, block): out[row, cols] = h * round(gelu(gate)), cols = block * BLOCK + ...
    # P is (rows, 2 * F_HALF) and OUT (rows, F_HALF), both row-contiguous; int64 row offsets.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F_HALF
    src = P + row * (2 * F_HALF) + cols
    h = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(src + F_HALF, mask=ok, other=0.0).to(tl.float32)
    gl = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    gl = gl.to(OUT.dtype.element_ty).to(tl.float32)  # torch rounds gelu's output first
    tl.store(OUT + row * F_HALF + cols, (h * gl).to(OUT.dtype.element_ty), mask=ok)


def geglu_reference(p: torch.Tensor) -> torch.Tensor:
    """diffusers GEGLU's gating after its projection (approximate="none")."""
    h, gate = p.chunk(2, dim=-1)
    return h * F.gelu(gate)


def geglu(p: torch.Tensor) -> torch.Tensor:
    """h * gelu(gate) for p = [h, gate] along a contiguous last dim of even size; see the doc."""
    if p.dim() < 1 or p.shape[-1] % 2:
        raise ValueError(f"last dim must be even (h and gate halves), got shape {tuple(p.shape)}")
    if p.dtype not in _DTYPES:
        raise TypeError(f"dtype {p.dtype} is not one of {_DTYPES}")
    if not p.is_contiguous():
        raise ValueError("p must be contiguous")
    f_half = p.shape[-1] // 2
    out = torch.empty(*p.shape[:-1], f_half, device=p.device, dtype=p.dtype)
    rows = p.numel() // p.shape[-1] if p.numel() else 0
    if rows == 0 or f_half == 0:
        return out
    block = min(_MAX_BLOCK, triton.next_power_of_2(f_half))
    _geglu_kernel[(rows, triton.cdiv(f_half, block))](p, out, f_half, BLOCK=block, num_warps=4)
    return out
