"""Segmented (gathered) LoRA for mixed-adapter batches, Punica SGMV style: y += LoRA deltas.

A batch of N token rows is served by several LoRA adapters at once. The adapters' down (A) and up
(B) matrices are concatenated along the rank dim; each of S *segments* applies one adapter to a
contiguous range of rows:

    for each segment s with rank r > 0, each row n in [lo_s, hi_s):
        y[n] += scale_s * (x[n] @ a_cat[off_s : off_s + r].T) @ b_cat[:, off_s : off_s + r].T

Segments of different *slots* may cover the same rows (a request with two LoRAs has two segments
over its rows, slot 0 and slot 1): their deltas add. Two launches, no host synchronisation:

1. shrink, grid (cdiv(N, BLOCK_M),): each program loops over the S segments, and for the rows of
   its tile inside [lo, hi) writes v[rows, slot, :] = scale * x[rows] @ A_seg.T (fp32
   accumulation, then one rounding to v's dtype) into the workspace v (N, num_slots, RANK_PAD);
   columns >= r of those rows are written as 0. RANK_PAD = max(16, next_power_of_2(max_rank)).
2. expand, grid (cdiv(N, BLOCK_M), cdiv(Cout, BLOCK_N)): each program loops over the segments,
   accumulates acc += v[rows, slot, :r] @ B_seg[cols, :r].T in float32 over every segment
   covering its rows, and then y[tile] = (y[tile].float() + acc).to(dtype): one rounding per
   element, however many segments cover it. Each (row tile, col tile) has one program: no atomics.

Layout: x (N, Cin) and y (N, Cout) with unit last stride (any row stride; y may be a column slice
of a wider tensor); a_cat (Rtot, Cin), copied to unit last stride if needed; b_cat (Cout, Rtot)
is read column-major, b_cat.stride(0) == 1 (the transposed view of a (Rtot, Cout)-contiguous
tensor), and copied to that layout on every call otherwise: keep adapter weights in it. Row-major
B with rank offsets that are not multiples of 8 forces element-wise loads; column-major loads
are 16-byte vectors along Cout (H200, bf16, 16384 x 640 -> r 128 -> 5120: 221 vs 420 us).
All four tensors of one dtype (float16, bfloat16, float32). Segment tensors, each 1-D (S,),
contiguous, on x's device: seg_lo, seg_hi, seg_rank_off, seg_rank, seg_slot int32; seg_scale
float32. Units: rows (tokens), rank columns, elements.

Invariants (the caller's; not checked on the device, which would need a synchronisation):
0 <= lo <= hi <= N; 0 <= rank <= max_rank; rank_off + rank <= Rtot; 0 <= slot < num_slots;
segments of one slot with rank > 0 never share a row. An empty segment (lo == hi) or one of rank
0 does nothing. Whatever the segment tensors hold, no memory outside the tensors is touched: rows
are clamped to [0, N), rank columns to [0, min(rank, RANK_PAD)) and [0, Rtot), and segments whose
slot is out of range are skipped; results for segments that break the invariants are unspecified.

Workspace invariant: v is torch.empty (never zero-filled). The expand reads v[n, slot, :r] only
for rows n of the segment s (slot, r) itself, which the shrink wrote for that same segment; since
one slot's segments never share a row, no row of v is written twice or read unwritten.

Rows covered by no segment of rank > 0 are not written at all (bit-exact, -0.0 and NaN included);
covered rows are rewritten even where the delta is 0 (so -0.0 + 0 becomes +0.0, as in the formula).

Numerics: v is kept in x's dtype (as in Punica / S-LoRA), so both products run on the tensor
cores with exact fp16/bf16 products and fp32 accumulation; the one extra rounding is v's
(relative 2**-11 for fp16, 2**-8 for bf16, per element of v). Against an fp32 v this made the
expand 1.15x to 2x faster on an H200 (v is re-read once per column tile). fp16 v can overflow
where |scale * x @ A.T| > 65504. float32 inputs keep v in float32 with IEEE products
(input_precision="ieee"). Then one rounding of y.float() + delta to y's dtype (the GPU rounds to
nearest; Triton's CPU interpreter truncates float32 -> bfloat16, and its bf16 tl.dot is wrong,
so under the interpreter bf16 operands are upcast to float32 first: exact products).

CUDA graphs: the wrapper only allocates (v, and copies of a_cat/b_cat when their layout needs
one) and launches kernels; nothing is read back to the host. Call it once outside capture
per (dtype, RANK_PAD) so the kernels are compiled before capturing.

`_reference` (torch; loops over the segments on the host, checks the invariants there) is what
runs where Triton cannot.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

try:
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - older triton
    _InterpretedFunction = ()

__all__ = ["launch", "segmented_lora"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_RANK = 256
BLOCK_M = 64  # rows per program (both launches)


class _Config(NamedTuple):
    block_k: int  # Cin step of the shrink (halved when RANK_PAD > 64)
    shrink_warps: int  # (8 when RANK_PAD > 64)
    shrink_stages: int
    block_n: int  # output columns per expand program
    block_r: int  # rank step of the expand (at most RANK_PAD)


# Keyed by "inputs are float32". fp16/bf16: from sweeps on an H200 (triton 3.6, bf16; N x Cin ->
# r -> Cout of 8192 x 1280 -> 64 -> 1280, 16384 x 640 -> 128 -> 5120, 4096 x 5120 -> 32 -> 640,
# 2048 x 1280 -> 16 -> 1280); the expand ran best with 4 warps and one stage. float32 (IEEE
# products, no tensor cores) is a correctness path, not tuned.
_CONFIGS = {False: _Config(128, 4, 4, 128, 64), True: _Config(64, 4, 2, 64, 32)}


@triton.jit
def _segment(SEG_LO, SEG_HI, SEG_OFF, SEG_RANK, SEG_SLOT, s, m0, N, NUM_SLOTS,
             BLOCK_M: tl.constexpr, RANK_PAD: tl.constexpr):  # fmt: skip
    # Segment s clipped to the row tile [m0, m0 + BLOCK_M) and to [0, N); rank clipped to RANK_PAD.
    lo = tl.maximum(tl.load(SEG_LO + s), m0)
    hi = tl.minimum(tl.minimum(tl.load(SEG_HI + s), m0 + BLOCK_M), N)
    rank = tl.minimum(tl.load(SEG_RANK + s), RANK_PAD)
    off = tl.load(SEG_OFF + s)
    slot = tl.load(SEG_SLOT + s)
    active = (lo < hi) & (rank > 0) & (slot >= 0) & (slot < NUM_SLOTS)
    return lo, hi, rank, off, slot, active


@triton.jit
def _shrink_kernel(X, A, V, SEG_LO, SEG_HI, SEG_OFF, SEG_RANK, SEG_SLOT, SEG_SCALE, N, CIN, RTOT,
                   S, NUM_SLOTS, stride_xm, stride_am, stride_vm, stride_vs, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr, RANK_PAD: tl.constexpr, DOT_PREC: tl.constexpr,
                   DOT_FP32: tl.constexpr):  # fmt: skip
    # v[rows, slot, :] = scale * x[rows] @ A_seg.T for the rows of this tile in each segment.
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, RANK_PAD)
    for s in range(0, S):
        lo, hi, rank, off, slot, active = _segment(SEG_LO, SEG_HI, SEG_OFF, SEG_RANK, SEG_SLOT, s,
                                                   m0, N, NUM_SLOTS, BLOCK_M, RANK_PAD)  # fmt: skip
        if active:
            row_ok = (rows >= lo) & (rows < hi)
            a_row = off + offs_r
            r_ok = (offs_r < rank) & (a_row >= 0) & (a_row < RTOT)
            x_ptr = X + rows64[:, None] * stride_xm + offs_k[None, :]
            a_ptr = A + a_row.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
            acc = tl.zeros((BLOCK_M, RANK_PAD), dtype=tl.float32)
            for k0 in range(0, CIN, BLOCK_K):
                k_ok = (k0 + offs_k) < CIN
                xt = tl.load(x_ptr + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                at = tl.load(a_ptr + k0, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                if DOT_FP32:  # the interpreter's bf16 tl.dot is wrong; bf16 products are exact
                    xt, at = xt.to(tl.float32), at.to(tl.float32)
                acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PREC)
            acc = acc * tl.load(SEG_SCALE + s)
            v_ptr = V + rows64[:, None] * stride_vm + slot * stride_vs + offs_r[None, :]
            tl.store(v_ptr, acc.to(V.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _expand_kernel(Y, B, V, SEG_LO, SEG_HI, SEG_OFF, SEG_RANK, SEG_SLOT, N, COUT, RTOT, S,
                   NUM_SLOTS, stride_ym, stride_bn, stride_br, stride_vm, stride_vs,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   RANK_PAD: tl.constexpr, DOT_PREC: tl.constexpr,
                   DOT_FP32: tl.constexpr):  # fmt: skip
    # y[tile] = y[tile] + sum over segments of v[rows, slot, :r] @ B_seg[cols, :r].T
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < COUT
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    touched = rows < 0  # rows covered by an active segment: the only rows written back
    for s in range(0, S):
        lo, hi, rank, off, slot, active = _segment(SEG_LO, SEG_HI, SEG_OFF, SEG_RANK, SEG_SLOT, s,
                                                   m0, N, NUM_SLOTS, BLOCK_M, RANK_PAD)  # fmt: skip
        if active:
            row_ok = (rows >= lo) & (rows < hi)
            touched = touched | row_ok
            v_ptr = V + rows64[:, None] * stride_vm + slot * stride_vs + offs_r[None, :]
            b_ptr = B + cols.to(tl.int64)[:, None] * stride_bn + (off + offs_r)[None, :] * stride_br
            for r0 in range(0, rank, BLOCK_R):
                rr = r0 + offs_r
                in_rank = rr < rank
                b_col_ok = in_rank & (off + rr >= 0) & (off + rr < RTOT)
                vt = tl.load(v_ptr + r0, mask=row_ok[:, None] & in_rank[None, :], other=0.0)
                bt = tl.load(b_ptr + r0 * stride_br, mask=c_ok[:, None] & b_col_ok[None, :],
                             other=0.0)  # fmt: skip
                if DOT_FP32:
                    vt, bt = vt.to(tl.float32), bt.to(tl.float32)
                acc = tl.dot(vt, tl.trans(bt), acc, input_precision=DOT_PREC)
    mask = touched[:, None] & c_ok[None, :]
    y_ptr = Y + rows64[:, None] * stride_ym + cols[None, :]
    yt = tl.load(y_ptr, mask=mask, other=0.0)
    tl.store(y_ptr, (yt.to(tl.float32) + acc).to(yt.dtype), mask=mask)


def _interpreting() -> bool:
    return isinstance(_shrink_kernel, _InterpretedFunction)


_INTERPRETING = _interpreting()  # TRITON_INTERPRET is read when the kernels are defined


def _check_segments(N: int, rtot: int, lo, hi, off, rank, slot) -> None:
    """Host check of the caller's invariants (the reference only: needs the values on the host)."""
    by_slot: dict[int, list[tuple[int, int]]] = {}
    for i, (l, h, o, r, sl) in enumerate(zip(lo, hi, off, rank, slot, strict=True)):
        if not (0 <= l <= h <= N) or r < 0 or sl < 0 or (r > 0 and not 0 <= o <= o + r <= rtot):
            raise ValueError(f"segment {i} (lo={l}, hi={h}, rank_off={o}, rank={r}, slot={sl}) "
                             f"is out of range for N={N}, Rtot={rtot}")  # fmt: skip
        if r > 0 and h > l:
            by_slot.setdefault(sl, []).append((l, h))
    for sl, spans in by_slot.items():
        spans.sort()
        for (_, h0), (l1, _) in zip(spans, spans[1:], strict=False):
            if l1 < h0:
                raise ValueError(f"segments of slot {sl} overlap at row {l1}")


def _reference(x, y, a_cat, b_cat, seg_lo, seg_hi, seg_rank_off, seg_rank, seg_slot,
               seg_scale) -> None:  # fmt: skip
    """torch: y += the segments' LoRA deltas, summed in float32 (float64 for float64 inputs) and
    added to y once; rows covered by no segment of rank > 0 are not written."""
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    N, rtot = x.shape[0], a_cat.shape[0]
    lo, hi, off, rank, slot = (t.tolist() for t in (seg_lo, seg_hi, seg_rank_off, seg_rank,
                                                   seg_slot))  # fmt: skip
    scale = seg_scale.tolist()
    _check_segments(N, rtot, lo, hi, off, rank, slot)
    delta = torch.zeros(N, y.shape[1], dtype=acc_dtype, device=y.device)
    covered = torch.zeros(N, dtype=torch.bool, device=y.device)
    for l, h, o, r, sc in zip(lo, hi, off, rank, scale, strict=True):
        if r == 0 or h == l:
            continue
        a = a_cat[o : o + r].to(acc_dtype)
        b = b_cat[:, o : o + r].to(acc_dtype)
        delta[l:h] += sc * ((x[l:h].to(acc_dtype) @ a.T) @ b.T)
        covered[l:h] = True
    y[covered] = (y[covered].to(acc_dtype) + delta[covered]).to(y.dtype)


def segmented_lora(x: torch.Tensor, y: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor,
                   seg_lo: torch.Tensor, seg_hi: torch.Tensor, seg_rank_off: torch.Tensor,
                   seg_rank: torch.Tensor, seg_slot: torch.Tensor, seg_scale: torch.Tensor, *,
                   max_rank: int, num_slots: int) -> None:  # fmt: skip
    """y += each segment's scale * x[lo:hi] @ A.T @ B.T, in place; see the module doc."""
    if x.dim() != 2 or y.dim() != 2 or a_cat.dim() != 2 or b_cat.dim() != 2:
        raise ValueError("x, y, a_cat and b_cat must be 2-D")
    N, cin = x.shape
    cout, rtot = y.shape[1], a_cat.shape[0]
    if y.shape[0] != N or a_cat.shape[1] != cin or tuple(b_cat.shape) != (cout, rtot):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, y {tuple(y.shape)}, a_cat "
                         f"{tuple(a_cat.shape)}, b_cat {tuple(b_cat.shape)}; want x (N, Cin), y "
                         "(N, Cout), a_cat (Rtot, Cin), b_cat (Cout, Rtot)")  # fmt: skip
    if x.dtype not in _DTYPES:
        raise TypeError(f"dtype {x.dtype} is not one of {_DTYPES}")
    if not (y.dtype == a_cat.dtype == b_cat.dtype == x.dtype):
        raise TypeError(f"dtype mismatch: x {x.dtype}, y {y.dtype}, a_cat {a_cat.dtype}, b_cat "
                        f"{b_cat.dtype}")  # fmt: skip
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("the last dimension of x and y must be contiguous")
    segs = (seg_lo, seg_hi, seg_rank_off, seg_rank, seg_slot, seg_scale)
    S = seg_lo.shape[0] if seg_lo.dim() == 1 else -1
    if any(t.dim() != 1 or t.shape[0] != S or not t.is_contiguous() for t in segs):
        raise ValueError("segment tensors must be contiguous 1-D tensors of one length")
    if any(t.dtype != torch.int32 for t in segs[:5]) or seg_scale.dtype != torch.float32:
        raise TypeError("seg_lo/hi/rank_off/rank/slot must be int32 and seg_scale float32")
    if any(t.device != x.device for t in (y, a_cat, b_cat, *segs)):
        raise ValueError(f"every tensor must be on x's device ({x.device})")
    if not 1 <= max_rank <= _MAX_RANK:
        raise ValueError(f"max_rank must be in [1, {_MAX_RANK}], got {max_rank}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if a_cat.stride(1) != 1:
        a_cat = a_cat.contiguous()
    if b_cat.stride(0) != 1:  # column-major: vector loads of B whatever the rank offsets
        b_cat = b_cat.t().contiguous().t()
    launch(x, y, a_cat, b_cat, *segs, max_rank=max_rank, num_slots=num_slots)


def launch(x: torch.Tensor, y: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor,
           seg_lo: torch.Tensor, seg_hi: torch.Tensor, seg_rank_off: torch.Tensor,
           seg_rank: torch.Tensor, seg_slot: torch.Tensor, seg_scale: torch.Tensor, *,
           max_rank: int, num_slots: int) -> None:  # fmt: skip
    """segmented_lora without its checks, for a caller that holds every one of them (LoraBatch
    builds its tensors in these layouts and dtypes once, and the config bounds the rank): a
    forward hook runs this for every adapted layer of every step, and the checks cost as much
    host time as the two launches. a_cat must have unit last stride and b_cat unit first stride
    (column-major)."""
    N, cin = x.shape
    cout, rtot = y.shape[1], a_cat.shape[0]
    S = seg_lo.shape[0]
    if N == 0 or S == 0 or cout == 0 or rtot == 0:
        return
    fp32 = x.dtype == torch.float32
    rank_pad = max(16, 1 << (max_rank - 1).bit_length())  # next power of two (plain ints)
    cfg = _CONFIGS[fp32]
    big_rank = rank_pad > 64
    prec = "ieee" if fp32 else "tf32"  # tf32 is unused: fp16/bf16 operands
    dot_fp32 = _INTERPRETING and x.dtype == torch.bfloat16
    v = torch.empty(N, num_slots, rank_pad, dtype=x.dtype, device=x.device)
    seg = (seg_lo, seg_hi, seg_rank_off, seg_rank, seg_slot)
    m_tiles = -(-N // BLOCK_M)
    if cin > 0:
        _shrink_kernel[(m_tiles,)](x, a_cat, v, *seg, seg_scale, N, cin, rtot, S, num_slots,
                                   x.stride(0), a_cat.stride(0), v.stride(0), v.stride(1),
                                   BLOCK_M=BLOCK_M, BLOCK_K=cfg.block_k // (1 + big_rank),
                                   RANK_PAD=rank_pad, DOT_PREC=prec, DOT_FP32=dot_fp32,
                                   num_warps=8 if big_rank else cfg.shrink_warps,
                                   num_stages=cfg.shrink_stages)  # fmt: skip
    else:  # x @ A.T of an empty inner dim is 0 (the deltas are 0, covered rows still rewritten)
        v.zero_()
    _expand_kernel[(m_tiles, -(-cout // cfg.block_n))](
        y, b_cat, v, *seg, N, cout, rtot, S, num_slots, y.stride(0), b_cat.stride(0),
        b_cat.stride(1), v.stride(0), v.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n,
        BLOCK_R=min(rank_pad, cfg.block_r), RANK_PAD=rank_pad, DOT_PREC=prec, DOT_FP32=dot_fp32,
        num_warps=4, num_stages=1)  # fmt: skip
