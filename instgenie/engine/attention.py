"""Varlen masked-query attention with selectable backends, as one torch custom op.

Request i of a packed batch attends from its n_q,i query rows (its masked tokens) to its n_k,i
key/value rows (all its tokens): q (total_q, H, D), k/v (total_k, H, D), int32 offsets
cu_seqlens_q/k (B + 1,). Backends:

- "triton": triton_kernels/varlen_attention.py (default on CUDA);
- "flash":  flash-attn's flash_attn_varlen_func, where installed (fp16/bf16, CUDA);
- "sdpa":   a per-request loop over torch's scaled_dot_product_attention (any device; default on
            CPU and wherever Triton is unavailable).

Registering the op gives every backend one FLOP formula, so `torch.utils.flop_counter.
FlopCounterMode` counts masked attention exactly, Triton included. The op is entered only while
a Python dispatch mode (such as the FLOP counter) is active: plain eager calls go straight to the
backend, because the custom-op machinery costs tens of microseconds per call, which at 140 calls
per SDXL step is a visible share of a launch-bound batch-1 step.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import register_flop_formula

from instgenie.config import ATTENTION_BACKENDS as BACKENDS  # ExecConfig.attention_backend


@functools.cache
def _triton_available() -> bool:
    try:
        import triton_kernels.varlen_attention  # noqa: F401
    except Exception:  # triton missing or broken: fall back to SDPA
        return False
    return True


def _triton_interpreting() -> bool:
    from triton_kernels.varlen_attention import _interpreting

    return _interpreting()


@functools.cache
def _flash_fn():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend that `name` selects on `device` (never "auto")."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "sdpa"
    if name == "triton" and not _triton_available():
        raise RuntimeError("attention backend 'triton' requested but triton is unavailable")
    if name == "triton" and device.type != "cuda" and not _triton_interpreting():
        raise RuntimeError(
            f"attention backend 'triton' on {device.type} needs TRITON_INTERPRET=1 set before "
            "triton is imported (the compiled kernel runs on CUDA only)"
        )
    if name == "flash" and _flash_fn() is None:
        raise RuntimeError("attention backend 'flash' requested but flash-attn is not installed")
    return name


def _sdpa_loop(q, k, v, cu_q: list[int], cu_k: list[int], scale: float) -> torch.Tensor:
    out = q.new_empty(q.shape)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        # (n, H, D) -> (1, H, n, D)
        qi = q[q0:q1].transpose(0, 1).unsqueeze(0)
        ki = k[k0:k1].transpose(0, 1).unsqueeze(0)
        vi = v[k0:k1].transpose(0, 1).unsqueeze(0)
        oi = F.scaled_dot_product_attention(qi, ki, vi, scale=scale)
        out[q0:q1] = oi.squeeze(0).transpose(0, 1)
    return out


def _run_backend(q, k, v, cu_q, cu_k, max_q, max_k, scale, backend) -> torch.Tensor:
    if backend == "triton":
        from triton_kernels.varlen_attention import varlen_attention

        return varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale)
    if backend == "flash":
        return _flash_fn()(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale)
    return _sdpa_loop(q, k, v, cu_q.tolist(), cu_k.tolist(), scale)


@torch.library.custom_op("instgenie::varlen_attention", mutates_args=())
def varlen_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    backend: str,
) -> torch.Tensor:
    return _run_backend(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, backend
    )


@varlen_attention_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, backend):
    return q.new_empty(q.shape)


@register_flop_formula(torch.ops.instgenie.varlen_attention, get_raw=True)
def _varlen_flops(q, k, v, cu_q, cu_k, *args, **kwargs) -> int:
    """QK^T and PV: 2 matmuls of sum_i n_q,i * n_k,i * H * D multiply-adds, 2 FLOPs each."""
    heads, dim = q.shape[1], q.shape[2]
    nq = cu_q.diff().to(torch.int64)
    nk = cu_k.diff().to(torch.int64)
    return int(4 * heads * dim * (nq * nk).sum().item())


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    backend: str | None = None,
) -> torch.Tensor:
    """Dispatch to the selected backend (None = "auto"; the masked executor passes its
    ExecConfig.attention_backend)."""
    chosen = resolve_backend(backend or "auto", q.device)
    if chosen == "flash" and q.dtype not in (torch.float16, torch.bfloat16):
        chosen = "sdpa"  # flash-attn has no fp32/fp64 path
    if chosen == "triton" and q.dtype == torch.float64:
        chosen = "sdpa"  # the kernel supports fp32/fp16/bf16
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    if _get_current_dispatch_mode() is None:
        return _run_backend(*args, float(scale), chosen)
    return varlen_attention_op(*args, float(scale), chosen)
