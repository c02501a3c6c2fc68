"""Launch configurations of the varlen attention kernels and the heuristic that picks one.

Used by triton_kernels/varlen_attention.py (the wrapper; layout, invariants and numerics are in
its docstring). Which kernel and tile a launch gets, and what was measured to choose them, lives
here: the Triton kernel (triton_kernels/varlen_attention_kernel.py) in its pointer, TMA and
warp-specialized forms, and for head dim 128 on Hopper the Gluon kernel
(triton_kernels/varlen_attention_hopper.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

try:  # The interpreter replaces @triton.jit functions when TRITON_INTERPRET=1 at import time.
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - triton builds without the interpreter
    _InterpretedFunction = ()

from triton_kernels.varlen_attention_kernel import _varlen_attention_kernel  # noqa: E402

try:  # Gluon (Triton's lower-level API): the Hopper kernel; its API moves between releases.
    from triton_kernels.varlen_attention_hopper import CONSUMERS as _GLUON_CONSUMERS
    from triton_kernels.varlen_attention_hopper import _varlen_attention_hopper_kernel
except Exception:  # ImportError, or an API this file does not match  # pragma: no cover
    _varlen_attention_hopper_kernel = None
    _GLUON_CONSUMERS = 2

_MAX_LINEAR_B = 64  # up to this many requests the grid is request-major over query tiles
# Triton's Hopper warp specialization was validated (GPU tests, H200) with triton 3.6 only; it
# miscompiled this kernel there with num_stages >= 3, so other versions fall back to pointers.
_WARP_SPEC_VALIDATED = triton.__version__.startswith("3.6.")
# The Gluon Hopper kernel (triton_kernels/varlen_attention_hopper.py) was written against and
# GPU-tested with triton 3.6's Gluon API.
_GLUON_VALIDATED = _WARP_SPEC_VALIDATED and _varlen_attention_hopper_kernel is not None


@dataclass(frozen=True)
class _Config:
    """Tile shape (in tokens) and launch parameters of one kernel launch.

    ``kv_desc``: how K/V tiles are fetched: 0 pointer loads (cp.async), 1 host-built TMA
    descriptors over (total_k, H * D), 2 TMA descriptors built in the kernel per request and head.
    ``warp_spec``: Hopper warp specialization (Triton's automatic producer/consumer split; needs
    ``kv_desc == 2``); ``num_warps`` then counts the warps of one consumer group.
    ``ptr_inc``: pointer path with loop-carried K/V pointers. ``linear_grid``: request-major
    grid over query tiles (varlen_attention.py docstring; B <= 64). ``even_n``: let a
    warp-specialized launch drop the key mask when the host can tell that every request has
    max_seqlen_k keys, a multiple of ``block_n``. ``gluon``: the Gluon Hopper kernel
    (FlashAttention-3 structure; D = 128, fp16/bf16, block_n = 128, ``block_m`` query rows per
    program split over two consumer warp groups of ``num_warps`` = 4 warps, ``num_stages`` K/V
    shared-memory slots; linear grid).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    kv_desc: int = 0
    warp_spec: bool = False
    ptr_inc: bool = False
    linear_grid: bool = False
    even_n: bool = True
    gluon: bool = False


def _interpreting() -> bool:
    return isinstance(_varlen_attention_kernel, _InterpretedFunction)


def _pointer_config(block_d: int, dtype: torch.dtype) -> _Config:
    """Pointer-load configuration: every GPU, every layout, q_index gathers."""
    if _interpreting():
        # Small tiles: several query and key tiles (full and partial) at test sizes, fast on CPU.
        return _Config(16, 16, 1, 1)
    if dtype == torch.float32:  # IEEE fp32 products: a correctness path, not tuned
        return _Config(64, 32, 4, 2) if block_d <= 128 else _Config(32, 32, 4, 1)
    # Chosen with bench/bench_varlen_attention.py --sweep on an H200 (sm_90, triton 3.6, fp16 and
    # bf16, SDXL/Flux batches): D=64: 64x64/4 warps/3 stages beat 128x64 by 5-20%; D=128:
    # 128x64/8/3 was best or within 3% of best. D=256 is untuned (compiles, tested for accuracy).
    if block_d <= 64:
        return _Config(64, 64, 4, 3)
    if block_d <= 128:
        return _Config(128, 64, 8, 3)
    return _Config(64, 32, 4, 2)


def _pick_config(block_d: int, dtype: torch.dtype, gluon: bool = True) -> _Config:
    """Heuristic by padded head dim and dtype (no autotuning: no first-call tuning stall).

    The wrapper falls back to ``_pointer_config`` where a TMA configuration does not apply (not
    Hopper, fp32, D not a power of two, unaligned strides, q_index gathers for warp_spec).

    Measured with ``bench/bench_varlen_attention.py --sweep --pick`` on an H200 (sm_90, triton
    3.6, torch 2.11; geometric-mean ms over flux H24 D128 L4608 mixed4/full2 x fp16/bf16):

    * D=128: warp-specialized 128x128, 4 warps per consumer group, 2 stages, in-kernel TMA
      descriptors, linear grid, no key mask when every request has max_seqlen_k keys (EVEN_N):
      0.864 ms, against 0.941 for the pointer kernel 128x64/8/3 (the previous default) and 0.944
      for the same warp-specialized kernel masking keys in every iteration (the mask costs ~22%
      of the consumer's loop instructions). Others, all slower than the pointer kernel or within
      noise of it: warp-specialized 128x64/4/2 0.929 (EVEN_N) / 0.970 (masked); TMA without warp
      specialization 0.99-1.07; pointer 128x128/8/3 0.950; loop-carried pointers 0.969.
      Warp specialization with num_stages 3 or 4 gave wrong results (Triton 3.6 compiler), so it
      is used with triton 3.6 only (GPU-tested there) and 2 stages. The Flux batches were then
      2-7% slower than cuDNN's per-request loop on mixed4/full2 (490-540 against 525-565
      TFLOP/s), tied on mixed8 and won by 13-15% on ten8/twenty4 (now the Gluon kernel's
      fallback).
    * D=64: the pointer kernel 64x64/4/3 stays best (0.086-0.088 ms geomean over sdxl
      mixed4/full2, H10 L4096 and H20 L1024): in-kernel TMA 0.092, 128x64/8/3 0.093,
      warp-specialized 128x128/4/2 0.119.
    * D=128, later: the Gluon kernel (``gluon``; 128 query rows per program in two consumer warp
      groups, 128-key tiles, 2 K/V slots) beat the warp-specialized Triton kernel by 10-14% on
      every Flux composition (mixed4 0.69-0.76 ms against 0.79-0.84; full2 0.77-0.83 against
      0.87-0.92) and the cuDNN per-request loop on the mixed batches
      (docs/benchmarks/varlen-attention-h200.md). FA3's inter-warp-group ping-pong (each consumer
      issues its MMAs only after the other's) made it 3-8% slower and was dropped.

    ``gluon=False`` gives the best Triton-kernel configuration (the fallback of the Gluon one).
    """
    if _interpreting() or dtype not in (torch.float16, torch.bfloat16) or block_d != 128:
        return _pointer_config(block_d, dtype)
    if gluon and _GLUON_VALIDATED:
        return _Config(128, 128, 4, 2, linear_grid=True, gluon=True)
    if _WARP_SPEC_VALIDATED:
        return _Config(128, 128, 4, 2, kv_desc=2, warp_spec=True, linear_grid=True)
    return _pointer_config(block_d, dtype)
