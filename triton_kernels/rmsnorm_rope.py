"""Fused per-head RMSNorm + rotary embedding + row scatter (Flux queries and keys).

For rows i < N of x (N, H, D) and every head h:

    y   = rmsnorm(x[i, h, :]) * weight                 torch.nn.RMSNorm or diffusers' RMSNorm
    out[dst[i], h, :] = rope(y, cos[pos[i]], sin[pos[i]])   diffusers apply_rotary_emb, use_real,
                                                       pairs (2j, 2j + 1) rotated together

Stock diffusers runs this as ~13 separate elementwise passes with float32 temporaries (RMSNorm's
upcast, RoPE's unbind/stack/float, then a torch.cat into the joint sequence); in a masked Flux
step the keys of every image token go through it, which made elementwise work ~45 % of a
batch-8 masked step (docs/benchmarks/masked-step-h200.md). Here it is one read of x and one
write of out, straight into its place in the joint key buffer.

Rounding follows the module being replaced: x * rsqrt(mean(x²) + eps) * weight in float32,
rounded once to x's dtype (torch.nn.RMSNorm, which Flux's attention uses); or, with
`diffusers_rounding`, diffusers' RMSNorm: the normalised value rounded to a 16-bit weight's dtype
before the weight multiplies it. The rotation is in float32, rounded to out's dtype. Only the
order of float32 operations may differ (fused multiply-add; 1/sqrt for rsqrt).

Layout: x (N, H, D) and out (M, H, D) with the last dim contiguous, any token/head strides;
cos/sin (P, D) float32 contiguous; pos, dst int32/int64 (N,) with 0 <= pos < P, 0 <= dst < M;
dst=None writes row i to out row i. D even, <= 256. Units: rows (tokens) and elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rmsnorm_rope", "rmsnorm_rope_reference"]


@triton.jit
def _rmsnorm_rope_kernel(X, W, COS, SIN, POS, DST, OUT, n, eps,
                         stride_xn, stride_xh, stride_on, stride_oh,
                         D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                         HAS_DST: tl.constexpr, ROUND_FIRST: tl.constexpr):  # fmt: skip
    pid_t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n
    col_ok = cols < D
    ok = row_ok[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)
    x_ptr = X + r64[:, None] * stride_xn + h * stride_xh
    x = tl.load(x_ptr + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    # the rotation partner of element 2j is 2j + 1 and vice versa (a second, cached load)
    xp = tl.load(x_ptr + (cols ^ 1)[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0)[None, :]
    wp = tl.load(W + (cols ^ 1), mask=col_ok, other=0.0)[None, :]
    y = x * rstd[:, None]
    yp = xp * rstd[:, None]
    if ROUND_FIRST:
        # diffusers: (x * rstd).to(weight dtype) * weight in the weight's dtype. The product of
        # two 16-bit floats is exact in float32, so multiplying there and rounding once gives the
        # same result (and the interpreter cannot multiply bf16 values)
        y = y.to(W.dtype.element_ty).to(tl.float32)
        yp = yp.to(W.dtype.element_ty).to(tl.float32)
        y = (y * w.to(tl.float32)).to(W.dtype.element_ty).to(tl.float32)
        yp = (yp * wp.to(tl.float32)).to(W.dtype.element_ty).to(tl.float32)
    else:
        y = y * w.to(tl.float32)
        yp = yp * wp.to(tl.float32)
    # rounded to x's dtype before the rotation (diffusers' RMSNorm returns x's dtype)
    y = y.to(OUT.dtype.element_ty).to(tl.float32)
    yp = yp.to(OUT.dtype.element_ty).to(tl.float32)
    p = tl.load(POS + rows, mask=row_ok, other=0).to(tl.int64)
    c = tl.load(COS + p[:, None] * D + cols[None, :], mask=ok, other=0.0)
    s = tl.load(SIN + p[:, None] * D + cols[None, :], mask=ok, other=0.0)
    sign = tl.where((cols % 2) == 0, -1.0, 1.0)
    o = y * c + (sign[None, :] * yp) * s
    if HAS_DST:
        d = tl.load(DST + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        d = r64
    tl.store(OUT + d[:, None] * stride_on + h * stride_oh + cols[None, :],
             o.to(OUT.dtype.element_ty), mask=ok)  # fmt: skip


def rmsnorm_rope_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    out: torch.Tensor,
    dst: torch.Tensor | None = None,
    diffusers_rounding: bool = False,
) -> torch.Tensor:
    """torch.nn.RMSNorm (or diffusers' RMSNorm) followed by apply_rotary_emb (use_real)."""
    var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(var + eps)
    if diffusers_rounding and weight.dtype in (torch.float16, torch.bfloat16):
        y = y.to(weight.dtype)
    y = (y * weight).to(x.dtype)
    p = pos.to(torch.int64)
    c, s = cos[p][:, None], sin[p][:, None]
    real, imag = y.reshape(*y.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    o = (y.float() * c + rotated.float() * s).to(out.dtype)
    if dst is None:
        out[: x.shape[0]] = o
    else:
        out[dst.to(torch.int64)] = o
    return out


def rmsnorm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    out: torch.Tensor,
    dst: torch.Tensor | None = None,
    diffusers_rounding: bool = False,
) -> torch.Tensor:
    """out[dst[i]] = rope(rmsnorm(x[i]) * weight, pos[i]) for every head; see the module doc."""
    if x.dim() != 3 or out.dim() != 3 or x.shape[1:] != out.shape[1:]:
        raise ValueError(f"x (N, H, D) and out (M, H, D) must agree; got {x.shape}, {out.shape}")
    N, H, D = x.shape
    if D % 2 or D > 256:
        raise ValueError(f"head dim must be even and <= 256, got {D}")
    if x.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("the last dimension of x and out must be contiguous")
    if out.dtype != x.dtype:
        raise TypeError(f"out dtype {out.dtype} differs from x dtype {x.dtype}")
    if weight is None or weight.shape != (D,):
        raise ValueError(f"weight must have shape ({D},)")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != D or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 (P, {D}) table")
    for name, t in (("pos", pos), ("dst", dst)):
        if t is None:
            continue
        if t.dim() != 1 or t.shape[0] != N or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32/int64 ({N},) tensor")
    if dst is None and out.shape[0] < N:
        raise ValueError(f"out has {out.shape[0]} rows, x has {N}")
    if N == 0:
        return out
    BLOCK_T = 16
    BLOCK_D = max(16, triton.next_power_of_2(D))
    grid = (triton.cdiv(N, BLOCK_T), H)
    _rmsnorm_rope_kernel[grid](
        x, weight, cos, sin, pos, dst if dst is not None else pos, out, N, float(eps),
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        D=D, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, HAS_DST=dst is not None,
        ROUND_FIRST=diffusers_rounding and weight.dtype in (torch.float16, torch.bfloat16),
    )  # fmt: skip
    return out
