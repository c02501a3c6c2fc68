"""Weights loaded from a model directory, moved into memory the process owns.

diffusers and transformers load safetensors files zero-copy on CPU: every parameter is a view
into a private (copy-on-write) memory map of its file, at the file's byte offset. Such a weight
(1) is aligned only to its element size (4 bytes for float32), where torch's CPU allocator
aligns to 64 bytes, so BLAS/oneDNN may take other (alignment-dependent) code paths than for the
same weights built in memory, and (2) still reads the file: a page not yet copied shows later
writes to the file (a model directory rewritten in place changes a serving process's weights).

Invariant after `own_cpu_weights(module)`: every CPU parameter and buffer of `module` lives in
its own 64-byte aligned allocation, contiguous, with the same values, dtype and shape; tied
parameters stay tied (the Parameter objects are kept, only their storage is replaced).
"""

from __future__ import annotations

import torch

ALIGNMENT = 64  # bytes: c10's CPU allocator alignment


@torch.no_grad()
def own_cpu_weights(module: torch.nn.Module) -> int:
    """Copy every CPU parameter and buffer of `module` into a fresh allocation (one tensor at a
    time: peak memory is the largest tensor, the map's pages are released as they go). Returns
    the number of tensors copied."""
    copied = 0
    seen: set[int] = set()
    for t in (*module.parameters(), *module.buffers()):
        if id(t) in seen or t.device.type != "cpu":
            continue
        seen.add(id(t))
        t.data = t.data.clone(memory_format=torch.contiguous_format)
        copied += 1
    return copied


def is_owned_layout(t: torch.Tensor) -> bool:
    """True if `t` starts on an ALIGNMENT boundary and is contiguous (own_cpu_weights' layout)."""
    return t.data_ptr() % ALIGNMENT == 0 and t.is_contiguous()
