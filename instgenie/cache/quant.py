"""fp8 (e4m3) cache storage with one float32 scale per token row.

A cached block output (rows, L, C) is stored as q = round_e4m3(x / s) with s = max|x_row| / 448
per token (448 = the largest finite e4m3 value), and restored as q * s in the compute dtype.
Storage per element: 1 byte + 4 / C bytes (C >= 320: < 1.02 bytes) instead of 2 for bf16/fp16, so
loads move about half the bytes. The relative error per element is at most 2^-4 of its row's
maximum (3 mantissa bits); its effect on images is measured (docs/benchmarks/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class QuantizedRows:
    """fp8 values (..., L, C) and float32 per-token scales (..., L, 1)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * 4

    def __getitem__(self, rows: slice) -> QuantizedRows:
        return QuantizedRows(self.q[rows], self.scale[rows])

    def to(self, device: torch.device, non_blocking: bool = False) -> QuantizedRows:
        return QuantizedRows(
            self.q.to(device, non_blocking=non_blocking),
            self.scale.to(device, non_blocking=non_blocking),
        )

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale).to(dtype)


def copy_rows(dst: torch.Tensor, src: torch.Tensor | QuantizedRows, non_blocking: bool) -> None:
    """dst <- src, dequantising fp8 rows (src may live on another device)."""
    if isinstance(src, QuantizedRows):
        src = src.to(dst.device, non_blocking=non_blocking).dequantize(dst.dtype)
    dst.copy_(src, non_blocking=non_blocking)


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """Per-token-row fp8 e4m3 quantisation of (..., L, C)."""
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(
        torch.finfo(torch.float32).tiny
    )
    return QuantizedRows((xf / scale).to(FP8), scale)
