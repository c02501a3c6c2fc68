"""Row gather-copy: out[idx[j], :] = src[idx[j], :] for the listed rows only.

Used to move only the *unmasked* token rows of a cached block from host memory to the GPU: on
CUDA, `src` may be page-locked host memory registered with CUDA (cudaHostRegister / pin_memory),
which is mapped into the device's unified address space, so the kernel reads it over PCIe
directly (zero-copy) and writes each row to its place in the device staging buffer. Rows absent
from `idx` are left untouched.

Layout: src and out are (N, C) with the last dim contiguous and equal row strides in elements;
idx is int32/int64 (n,) with 0 <= idx[j] < N. Units: rows (tokens) and elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_gather_kernel(SRC, OUT, IDX, n, C, stride_src, stride_out, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok = offs_r < n
    rows = tl.load(IDX + offs_r, mask=r_ok, other=0).to(tl.int64)
    mask = r_ok[:, None] & (offs_c[None, :] < C)
    vals = tl.load(SRC + rows[:, None] * stride_src + offs_c[None, :], mask=mask)
    tl.store(OUT + rows[:, None] * stride_out + offs_c[None, :], vals, mask=mask)


class _HostPointer:
    """Presents a page-locked host tensor to Triton as a device pointer (unified addressing)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self._t.data_ptr()


def _reference(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out[idx.to(torch.int64)] = src[idx.to(torch.int64)].to(out.device)
    return out


def row_gather(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[idx] = src[idx] row-wise; src may be pinned host memory when out is on CUDA."""
    if src.dim() != 2 or out.dim() != 2 or src.shape != out.shape:
        raise ValueError(f"src and out must be equal 2-D (N, C); got {src.shape}, {out.shape}")
    if src.dtype != out.dtype:
        raise TypeError(f"dtype mismatch: {src.dtype} vs {out.dtype}")
    if src.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("the last dimension of src and out must be contiguous")
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise TypeError("idx must be a 1-D int32/int64 tensor")
    if out.device.type == "cuda" and src.device.type == "cpu" and not src.is_pinned():
        raise ValueError("a host src must be page-locked (pinned or cudaHostRegister'ed)")
    n, C = idx.numel(), src.shape[1]
    if n == 0:
        return out
    src_arg = _HostPointer(src) if src.device != out.device else src
    BLOCK_R, BLOCK_C = 16, min(1024, triton.next_power_of_2(C))
    grid = (triton.cdiv(n, BLOCK_R), triton.cdiv(C, BLOCK_C))
    _row_gather_kernel[grid](src_arg, out, idx, n, C, src.stride(0), out.stride(0),
                             BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)  # fmt: skip
    return out
