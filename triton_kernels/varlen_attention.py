"""Varlen masked-query attention: a Triton kernel and its torch reference.

Each request of a batch attends from its *masked* query tokens only, to the keys and values of
*all* its tokens (non-causal, full softmax). Requests are packed without padding, as in
flash-attn's ``flash_attn_varlen_func``.

Layout (B requests, H heads, head dimension D; every length and offset counts tokens, i.e. rows):

* ``q``: ``(total_q, H, D)``. Rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` are request i's
  ``n_q,i`` query tokens. With ``q_index`` (see below) ``q`` is instead a source ``(N_src, H, D)``.
* ``k``, ``v``: ``(total_k, H, D)``. Rows ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]`` are request i's
  ``n_k,i`` key/value tokens.
* ``cu_seqlens_q``, ``cu_seqlens_k``: int32, shape ``(B + 1,)``, on q's device.
* output: ``(total_q, H, D)`` in q's dtype; row j is query row j's attention output.
* ``q_index`` (optional, int32 or int64, shape ``(total_q,)``): query row j is ``q[q_index[j]]``,
  read through the index by the kernel (no gathered copy of q is made).

Invariants (the wrapper checks every one that does not need the values of device tensors; the
values are checked when that costs no device-to-host sync, or when ``validate=True``):

* ``cu[0] == 0``, ``cu`` non-decreasing, ``cu_seqlens_q[B] == total_q``,
  ``cu_seqlens_k[B] == total_k``.
* ``n_q,i == 0`` is allowed: that request writes nothing. ``n_k,i >= 1`` wherever ``n_q,i >= 1``.
* ``max_seqlen_q >= max_i n_q,i`` (it sizes the 3-D grid: an under-estimate leaves rows
  unwritten); ``max_seqlen_k >= max_i n_k,i`` (a bound, used for the int32 offset check; when
  ``total_k == B * max_seqlen_k`` it also tells the warp-specialized kernel that every request has
  exactly ``max_seqlen_k`` keys: requests that break this get NaN rows there, never wrong ones).
* the last dimension of q, k, v is contiguous; token and head strides are free (views of a packed
  qkv tensor work). ``1 <= D <= 256``; D is padded in registers to a power of two >= 16.
* ``0 <= q_index[j] < N_src``.
* ``softmax_scale > 0``; default ``D ** -0.5``.

Numerics: both matrix products accumulate in fp32; the softmax is online (flash-attention-2) in
fp32 with base-2 exponentials, the scale pre-multiplied by log2(e); P is rounded to v's dtype
before the PV product, as flash-attention does. fp32 inputs use IEEE fp32 products (not TF32):
fp32 is the debugging/reference path, fp16/bf16 the fast one.

Grid: ``(cdiv(max_seqlen_q, BLOCK_M), B, H)``; program (m, i, h) computes query tile m of request
i for head h and exits at once when ``m * BLOCK_M >= n_q,i``, so no host-side schedule (and no
device-to-host sync) is needed. Configurations with ``linear_grid`` (and B <= 64) instead launch
``(sum_i cdiv(n_q,i, BLOCK_M) upper bound, H)`` programs that find their (request, tile) from
cu_seqlens_q in a short scalar prologue, so almost none is idle.

Paths (see ``_Config``): K/V tiles come through pointer loads (cp.async; every GPU, every layout,
the interpreter's default), or on Hopper through TMA descriptors built on the host or in the
kernel, optionally with Triton's automatic warp specialization (one producer warp group issuing
TMA loads, two consumer warp groups of 64 query rows each). For head dim 128 in fp16/bf16 on
Hopper the default is a separate kernel written in Gluon (triton_kernels/varlen_attention_hopper.py:
FlashAttention-3's producer/consumer split with the score MMA of the next key tile overlapping
the softmax of the current one); it needs no q_index, 16-byte aligned strides and B <= 64, and
the Triton kernel runs wherever it does not apply. ``_pick_config``
(triton_kernels/varlen_attention_config.py) documents what was measured.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

try:  # Host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

from triton_kernels.varlen_attention_config import (  # noqa: E402
    _GLUON_CONSUMERS,
    _GLUON_VALIDATED,
    _MAX_LINEAR_B,
    _Config,
    _interpreting,
    _pick_config,
    _pointer_config,
    _varlen_attention_hopper_kernel,
    _varlen_attention_kernel,
)

__all__ = ["varlen_attention"]

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_MAX_GRID_YZ = 65535  # CUDA limit on grid dimensions y and z (requests, heads)


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int) -> torch.Tensor:
    """Value checks of one cu_seqlens tensor (reads it on the host); returns per-request lengths."""
    cu = cu.cpu()
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        bad = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(f"{name} must be non-decreasing; {name}[{bad + 1}] < {name}[{bad}]")
    if int(cu[-1]) != total:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} must equal the number of rows ({total})")
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest > max_seqlen:
        raise ValueError(f"a request has {longest} tokens in {name}; max_seqlen is {max_seqlen}")
    return lengths


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    q_index: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Attention of each request's query rows over its key/value rows; see the module docstring.

    Args:
        q: ``(total_q, H, D)``, or the source ``(N_src, H, D)`` of ``q_index``.
        k, v: ``(total_k, H, D)``, same dtype and device as q.
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)`` cumulative token offsets.
        max_seqlen_q, max_seqlen_k: upper bounds on any request's query/key length (tokens).
        softmax_scale: positive multiplier of the scores; default ``D ** -0.5``.
        q_index: optional int32/int64 ``(total_q,)``; query row j is ``q[q_index[j]]``.
        out: optional ``(total_q, H, D)`` buffer of q's dtype (last dim contiguous) to write into.
        validate: check the *values* of cu_seqlens (and q_index): ``None`` does so only when they
            are not on a CUDA device (no device-to-host sync), ``True`` always, ``False`` never.

    Returns:
        ``(total_q, H, D)`` tensor in q's dtype (``out`` if given).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(cu_seqlens_k, torch.Tensor):
        raise TypeError(f"cu_seqlens_k must be a torch.Tensor, got {type(cu_seqlens_k).__name__}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be 3-D (tokens, heads, head_dim); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"q and k must have the same (heads, head_dim); got {tuple(q.shape[1:])} vs "
            f"{tuple(k.shape[1:])}"
        )
    n_heads, head_dim = q.shape[1], q.shape[2]
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {_MAX_HEAD_DIM}], got {head_dim}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q dtype must be one of {_DTYPES}, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v dtypes must match; got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must have shape (B + 1,), got {tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both have B + 1 entries; got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    if q_index is not None:
        if not isinstance(q_index, torch.Tensor):
            raise TypeError(f"q_index must be a torch.Tensor, got {type(q_index).__name__}")
        if q_index.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"q_index must be int32 or int64, got {q_index.dtype}")
        if q_index.dim() != 1:
            raise ValueError(f"q_index must be 1-D (total_q,), got {tuple(q_index.shape)}")
        q_index = q_index.contiguous()
        total_q = q_index.shape[0]
    else:
        total_q = q.shape[0]
    total_k = k.shape[0]
    device = q.device
    named = {"k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    if q_index is not None:
        named["q_index"] = q_index
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] > 0 and t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; strides {t.stride()}")
    for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise ValueError(f"{name} must be a non-negative int, got {val!r}")
    scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    if out is None:
        out = torch.empty((total_q, n_heads, head_dim), dtype=q.dtype, device=device)
    else:
        if out.shape != (total_q, n_heads, head_dim) or out.dtype != q.dtype:
            raise ValueError(
                f"out must be {(total_q, n_heads, head_dim)} {q.dtype}, got "
                f"{tuple(out.shape)} {out.dtype}"
            )
        if total_q > 0 and out.stride(2) != 1:
            raise ValueError(f"out must be contiguous in its last dim; strides {out.stride()}")
    n_req = cu_seqlens_q.shape[0] - 1
    if total_q > 0 and (max_seqlen_q == 0 or n_req == 0):
        raise ValueError(f"{total_q} query rows but max_seqlen_q={max_seqlen_q}, B={n_req}")
    if total_q > 0 and total_k == 0:
        raise ValueError(f"{total_q} query rows attend to no key rows (total_k == 0)")
    if max(n_req, n_heads) > _MAX_GRID_YZ:
        raise ValueError(f"B={n_req} and H={n_heads} must each be <= {_MAX_GRID_YZ}")
    if max_seqlen_k * max(k.stride(0), v.stride(0), 1) >= 2**31:
        raise ValueError("max_seqlen_k * token stride of k/v must be < 2**31 (int32 offsets)")

    if validate is None:
        validate = device.type != "cuda"
    if validate:
        len_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q)
        len_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)
        starved = (len_q > 0) & (len_k == 0)
        if bool(starved.any()):
            i = int(torch.nonzero(starved)[0])
            raise ValueError(f"request {i} has {int(len_q[i])} queries but no keys")
        if q_index is not None and total_q > 0:
            lo, hi = int(q_index.min()), int(q_index.max())
            if lo < 0 or hi >= q.shape[0]:
                raise ValueError(f"q_index values must be in [0, {q.shape[0]}), got [{lo}, {hi}]")

    if total_q == 0:
        return out
    if device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"tensors are on {device}: the kernel needs CUDA tensors, or TRITON_INTERPRET=1 set "
            "before triton_kernels.varlen_attention is imported"
        )

    block_d = max(16, triton.next_power_of_2(head_dim))
    cfg = _pick_config(block_d, q.dtype)
    if cfg.gluon:
        if _gluon_ok(q, k, v, q_index, head_dim, n_req):
            _launch_gluon(cfg, q, k, v, out, cu_seqlens_q, cu_seqlens_k, scale, n_req, total_q)
            return out
        cfg = _pick_config(block_d, q.dtype, gluon=False)
    if cfg.kv_desc and not _tma_ok(cfg, q, k, v, q_index, head_dim, block_d):
        cfg = _pointer_config(block_d, q.dtype)
    if cfg.kv_desc == 1:
        # 2-D views (total_k, H * D): rows are tokens, head h is columns [h * D, (h + 1) * D).
        k_arg = TensorDescriptor(
            k, [total_k, n_heads * head_dim], [k.stride(0), 1], [cfg.block_n, block_d]
        )
        v_arg = TensorDescriptor(
            v, [total_k, n_heads * head_dim], [v.stride(0), 1], [cfg.block_n, block_d]
        )
    else:
        k_arg, v_arg = k, v
    if cfg.kv_desc == 2 or cfg.warp_spec:
        _ensure_allocator()
    linear = cfg.linear_grid and n_req <= _MAX_LINEAR_B
    # Every request has exactly max_seqlen_k keys when they add up to B * max_seqlen_k (each has
    # at most max_seqlen_k): then no key tile is partial if BLOCK_N divides max_seqlen_k.
    even_n = total_k == n_req * max_seqlen_k and max_seqlen_k % cfg.block_n == 0
    if linear:
        # Request-major grid over every request's query tiles (no idle programs but < B).
        grid = (_linear_grid_size(total_q, n_req, cfg.block_m), n_heads)
    else:
        grid = (triton.cdiv(max_seqlen_q, cfg.block_m), n_req, n_heads)
    _varlen_attention_kernel[grid](
        q,
        k_arg,
        v_arg,
        out,
        q_index if q_index is not None else cu_seqlens_q,  # unused placeholder pointer
        cu_seqlens_q,
        cu_seqlens_k,
        scale * _LOG2E,
        n_req,
        *_token_and_head_strides(q, k, v, out),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        HAS_Q_INDEX=q_index is not None,
        # The interpreter multiplies bf16 bit patterns in tl.dot (it stores bf16 as uint16):
        # upcast the operands there. On GPUs bf16 goes to the tensor cores as is.
        DOT_FP32=_interpreting() and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_B=max(1, triton.next_power_of_2(n_req)) if linear else 1,
        LINEAR_GRID=linear,
        KV_DESC=cfg.kv_desc,
        WARP_SPEC=cfg.warp_spec,
        PTR_INC=cfg.ptr_inc,
        EVEN_N=even_n and cfg.warp_spec and cfg.even_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _token_and_head_strides(*tensors: torch.Tensor) -> list[int]:
    """(stride(0), stride(1)) of each (tokens, H, D) tensor, flattened: the kernels' order."""
    return [st for t in tensors for st in (t.stride(0), t.stride(1))]


def _linear_grid_size(total_q: int, n_req: int, block_m: int) -> int:
    """Programs of a request-major linear grid: an upper bound on sum_i cdiv(n_q,i, block_m)
    (each request wastes at most block_m - 1 rows of its last tile)."""
    return (total_q + n_req * (block_m - 1)) // block_m


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    """sm_90 (H100/H200); asked on every call, so cached per device."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _gluon_ok(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor | None,
    head_dim: int,
    n_req: int,
) -> bool:
    """Whether the Gluon Hopper kernel applies (else the Triton kernel runs)."""
    if not _GLUON_VALIDATED or _interpreting() or q_index is not None:
        return False
    if head_dim != 128 or q.dtype not in (torch.float16, torch.bfloat16) or n_req > _MAX_LINEAR_B:
        return False
    if not _is_hopper(q.device):
        return False
    for t in (q, k, v):  # TMA: 16-byte aligned base and row/head strides
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
        if (t.stride(1) * t.element_size()) % 16:
            return False
    return True


def _launch_gluon(
    cfg: _Config,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    n_req: int,
    total_q: int,
) -> None:
    _ensure_allocator()  # the kernel builds its TMA descriptors in device memory
    # Request-major linear grid over every request's query tiles of block_m rows (an upper
    # bound; programs past the last tile do nothing), by heads.
    grid = (_linear_grid_size(total_q, n_req, cfg.block_m), q.shape[1])
    _varlen_attention_hopper_kernel[grid](
        q,
        k,
        v,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        scale * _LOG2E,
        n_req,
        *_token_and_head_strides(q, k, v, out),
        HEAD_DIM=q.shape[2],
        BLOCK_M=cfg.block_m // _GLUON_CONSUMERS,
        BLOCK_N=cfg.block_n,
        STAGES=cfg.num_stages,
        BLOCK_B=max(1, triton.next_power_of_2(n_req)),
        CONSUMER_REGS=240,
        num_warps=cfg.num_warps,
        # 3 warp groups (2 consumers, the 1-warp producer's group) x 128 threads x 168 = 64512
        # registers of the SM's 65536; setmaxnreg then gives each consumer 240, the producer 24.
        maxnreg=168,
    )


def _tma_ok(
    cfg: _Config,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor | None,
    head_dim: int,
    block_d: int,
) -> bool:
    """Whether a TMA configuration applies: Hopper, 16-bit, D a power of two, 16-byte aligned."""
    if q.dtype not in (torch.float16, torch.bfloat16) or head_dim != block_d:
        return False
    if not _interpreting():
        # Validated on Hopper only (sm_90; Blackwell lowers warp specialization differently).
        if not _is_hopper(q.device):
            return False
    tensors = (q, k, v) if cfg.warp_spec else (k, v)
    if cfg.warp_spec and q_index is not None:  # a gather has no TMA form on Hopper
        return False
    for t in tensors:
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
        if (t.stride(1) * t.element_size()) % 16:
            return False
        if cfg.kv_desc == 1 and t is not q and t.stride(1) != head_dim:
            return False
    return True


def _ensure_allocator() -> None:
    """In-kernel TMA descriptors need global scratch memory from a Triton allocator."""
    if not hasattr(triton, "set_allocator"):  # pragma: no cover - older triton
        return
    try:
        from triton.runtime import _allocation

        current = _allocation._allocator.get()
        if not isinstance(current, _allocation.NullAllocator):
            return  # the application set one: use it
    except (ImportError, AttributeError):  # pragma: no cover - internals moved
        pass
    triton.set_allocator(_torch_allocator)


def _torch_allocator(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Plain torch, one request at a time, scores/softmax/PV in fp32; output in q's dtype."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert len(cq) == len(ck), "cu_seqlens_q and cu_seqlens_k must have the same length"
    assert cq[0] == 0 and cq[-1] == q.shape[0], "cu_seqlens_q must span q's rows"
    out = torch.empty_like(q)
    for i in range(len(cq) - 1):
        qs, qe, ks, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if qe == qs:
            continue
        assert ke > ks, f"request {i} has {qe - qs} queries but no keys"
        qi = q[qs:qe].float().transpose(0, 1)  # (H, n_q, D)
        ki = k[ks:ke].float().transpose(0, 1)
        vi = v[ks:ke].float().transpose(0, 1)
        p = torch.softmax(torch.matmul(qi, ki.transpose(1, 2)) * scale, dim=-1)
        out[qs:qe] = torch.matmul(p, vi).transpose(0, 1).to(q.dtype)
    return out
