"""Copy one step's slice of a per-block cache stack, the step index read on the device.

    out[...] = src[step[0], ...]          src (S, *shape), out (*shape), step (1,) int64 device

The CUDA-graph form of a masked step (engine/graphs.py) reads each request's cached rows of a
block from the store's (steps, rows, L, C) stack at a step index held in a device tensor, so one
captured graph serves every step. `torch.index_select` does that with its generic small-index
kernel (one index selecting a multi-MB slice): ~1/3 of the copy bandwidth, 561 launches and
5.4 ms of a batch-8 SDXL step on an H200 (bench/profile_step.py), and the reason a graphed masked
Flux step was 1-2 % slower than the eager one, which copies with known steps. This kernel reads
the step once per program and moves the slice in contiguous, vectorisable blocks.

Layout: the slice src[s] and out must each be contiguous (any stride between steps); src and out
of one dtype on one device; 0 <= step < S is the caller's invariant (not checked on the device:
reading it would synchronise). Units: elements. `copy_step_reference` is the torch op it replaces.

`copy_rows_indirect` is the bucketed graphs' form (engine/bucket_graphs.py, decision 0051): a
graph captured at start serves any composition of its bucket, so the cached rows' addresses
cannot be baked into it. Each batch row r names its source in device tables instead:

    out[r] = *(base[r] + (steps[r] * stride[r] + i) * itemsize)   for i < out[r].numel()
    (a row whose base is 0 is left as it is: it computes every token)

base: the address of the row's slice at step 0 (`tensor.data_ptr()`), stride: elements between
steps; the owner of the tables keeps every source alive while they name it (BoundRows).
`copy_rows_indirect_reference` is the same copy from the tensors themselves.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["copy_rows_indirect", "copy_rows_indirect_reference", "copy_step", "copy_step_reference"]

_BLOCK = 8192  # elements per program (16 KiB of fp16)


@triton.jit
def _copy_step_kernel(SRC, STEP, OUT, numel, stride_step, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    s = tl.load(STEP).to(tl.int64)
    vals = tl.load(SRC + s * stride_step + offs, mask=ok)
    tl.store(OUT + offs, vals, mask=ok)


def copy_step_reference(src: torch.Tensor, step: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    torch.index_select(src, 0, step, out=out.unsqueeze(0))
    return out


def copy_step(src: torch.Tensor, step: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = src[step[0]] with the step read on the device; see the module doc."""
    if src.dim() < 1 or src.shape[1:] != out.shape:
        raise ValueError(f"src (S, *shape) and out (*shape) disagree: {src.shape}, {out.shape}")
    if src.dtype != out.dtype or src.device != out.device:
        raise TypeError(f"src and out differ: {src.dtype}/{src.device} vs {out.dtype}/{out.device}")
    if step.shape != (1,) or step.dtype != torch.int64 or step.device != src.device:
        raise ValueError("step must be a (1,) int64 tensor on src's device")
    if not out.is_contiguous() or (src.shape[0] and not src[0].is_contiguous()):
        raise ValueError("each step's slice of src, and out, must be contiguous")
    numel = math.prod(out.shape)
    if numel == 0:
        return out
    grid = (triton.cdiv(numel, _BLOCK),)
    _copy_step_kernel[grid](src, step, out, numel, src.stride(0), BLOCK=_BLOCK, num_warps=8)
    return out


@triton.jit
def _copy_rows_indirect_kernel(BASE, STRIDE, STEPS, OUT, numel, out_stride, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    base = tl.load(BASE + r)
    if base != 0:
        s = tl.load(STEPS + r)
        stride = tl.load(STRIDE + r)
        src = base.to(tl.pointer_type(OUT.dtype.element_ty))
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        vals = tl.load(src + s * stride + offs, mask=ok)
        tl.store(OUT + r * out_stride + offs, vals, mask=ok)


def copy_rows_indirect_reference(
    sources: list[torch.Tensor | None], steps: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out[r] = sources[r][steps[r]] for every row with a source ((S, *shape) each)."""
    for r, src in enumerate(sources):
        if src is not None:
            torch.index_select(src, 0, steps[r : r + 1], out=out[r : r + 1])
    return out


def copy_rows_indirect(
    base: torch.Tensor, stride: torch.Tensor, steps: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out[r] = row r's source at steps[r] (see the module doc); base, stride, steps (R,) int64
    on out's device, out (R, *shape) with each out[r] contiguous (rows may be strided: the image
    part of a joint key sequence), every source of out's dtype."""
    R = out.shape[0] if out.dim() else 0
    for name, t in (("base", base), ("stride", stride), ("steps", steps)):
        if t.shape != (R,) or t.dtype != torch.int64 or t.device != out.device:
            raise ValueError(f"{name} must be a ({R},) int64 tensor on {out.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if R and not out[0].is_contiguous():
        raise ValueError("each row of out must be contiguous")
    numel = math.prod(out.shape[1:])
    if numel == 0 or R == 0:
        return out
    grid = (triton.cdiv(numel, _BLOCK), R)
    _copy_rows_indirect_kernel[grid](base, stride, steps, out, numel, out.stride(0),
                                     BLOCK=_BLOCK, num_warps=8)  # fmt: skip
    return out
