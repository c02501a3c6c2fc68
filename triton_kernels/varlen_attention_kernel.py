"""The Triton kernel of varlen masked-query attention and its jit helpers.

The host wrapper, its checks, the launch configuration and the torch reference are in
triton_kernels/varlen_attention.py (the module to import); see its docstring for layout,
invariants and numerics. This file holds only device code.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _softmax_step(acc, l_i, m_i, qk, qk_scale):
    # Online-softmax update for one tile of scores qk (BLOCK_M, BLOCK_N): returns the tile's
    # unnormalized probabilities p and the updated (acc, l_i, m_i). m_i is the running row max
    # in log2 units (scores * qk_scale), l_i the running row sum of p. qk_scale > 0, so
    # max(qk) * qk_scale == max(qk * qk_scale); every row of every tile has at least one finite
    # score (a partial tile holds >= 1 key), so the new max is finite.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, acc, l_i, m_new


@triton.jit
def _attn_tile(
    acc,
    l_i,
    m_i,
    q,
    k_ptrs,
    v_ptrs,
    offs_n,
    n_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One BLOCK_N tile of keys offs_n of the current request, at k_ptrs/v_ptrs (BLOCK_N,
    # BLOCK_D). MASK_N is True only for the last, partial tile (offs_n reaches past n_k); its
    # missing keys get -inf scores.
    offs_d = tl.arange(0, BLOCK_D)
    if MASK_N:
        kv_mask = (offs_n[:, None] < n_k) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if DOT_FP32:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASK_N:
        qk = tl.where(offs_n[None, :] < n_k, qk, float("-inf"))
    p, acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, qk_scale)
    p = p.to(v_ptrs.dtype.element_ty)
    if DOT_FP32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attn_tile_desc(
    acc,
    l_i,
    m_i,
    q,
    k_desc,
    v_desc,
    row,
    col,
    start_n,
    n_k,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASK_N: tl.constexpr,
    ZERO_V_TAIL: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # The same update as _attn_tile, with K/V tiles fetched by the Hopper tensor-memory
    # accelerator (TMA) through descriptors: rows [row, row + BLOCK_N), columns [col, col + D).
    # K is consumed transposed straight from shared memory (no register transpose).
    k = k_desc.load([row, col]).T
    if DOT_FP32:
        k = k.to(tl.float32)
    qk = tl.dot(q, k)
    if MASK_N:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        qk = tl.where(offs_n[None, :] < n_k, qk, float("-inf"))
    p, acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, qk_scale)
    v = v_desc.load([row, col])
    if MASK_N and ZERO_V_TAIL:
        # A descriptor over all requests reads the next request's rows past n_k: zero them so
        # that 0 * (inf or nan) cannot reach acc (their p is 0 already).
        v = tl.where(offs_n[:, None] < n_k, v, 0.0)
    p = p.to(v.dtype)
    if DOT_FP32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = tl.dot(p, v, acc)
    return acc, l_i, m_i


@triton.jit
def _linear_tile(CU_Q, n_req, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    # Program t of a grid over all requests' query tiles in order (request-major): returns
    # (request, query tile of that request). Programs past the last tile get the last request
    # and a tile index past its queries (they write nothing). Scalar code, unrolled over
    # BLOCK_B >= n_req requests (Triton 3.6's Hopper warp specialization rejects tensor code
    # here).
    t = tl.program_id(0)
    req = 0
    first = 0
    end = 0
    lo = 0
    for i in tl.static_range(BLOCK_B):
        # Independent loads (no `other=lo`): one memory round trip for the whole prologue.
        hi = tl.load(CU_Q + (i + 1), mask=i < n_req, other=0)
        hi = tl.where(i < n_req, hi, lo)
        end += (hi - lo + BLOCK_M - 1) // BLOCK_M
        before = (end <= t) & (i < n_req - 1)  # request i ends at or before tile t
        req += before.to(tl.int32)
        first = tl.where(before, end, first)
        lo = hi
    return req, t - first


@triton.jit
def _varlen_attention_kernel(
    Q,
    K,
    V,
    O,
    Q_INDEX,
    CU_Q,
    CU_K,
    qk_scale,
    n_req,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_on,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_Q_INDEX: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr,
    LINEAR_GRID: tl.constexpr,
    KV_DESC: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    PTR_INC: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    if LINEAR_GRID:
        req, pid_m = _linear_tile(CU_Q, n_req, BLOCK_M, BLOCK_B)
        head_i32 = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        req = tl.program_id(1)
        head_i32 = tl.program_id(2)
    head = head_i32.to(tl.int64)
    q_start = tl.load(CU_Q + req)
    n_q = tl.load(CU_Q + req + 1) - q_start
    if not WARP_SPEC:
        # (Triton 3.6's Hopper warp specialization rejects an early return: WARP_SPEC programs
        # without queries run a loop of zero iterations instead.)
        if pid_m * BLOCK_M >= n_q:
            return
    k_start = tl.load(CU_K + req)
    n_k = tl.load(CU_K + req + 1) - k_start

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < n_q
    # Packed query/output row of each tile row; int64 because row * stride may pass 2**31.
    rows = (q_start + offs_m).to(tl.int64)
    if WARP_SPEC:
        # Rows past this request's queries read as zeros (their outputs are not stored).
        q_desc = tl.make_tensor_descriptor(
            Q + head * stride_qh,
            shape=[tl.maximum(q_start + n_q, 1), HEAD_DIM],
            strides=[stride_qn, 1],
            block_shape=[BLOCK_M, BLOCK_D],
        )
        q = q_desc.load([q_start + pid_m * BLOCK_M, 0])
    else:
        if HAS_Q_INDEX:
            src_rows = tl.load(Q_INDEX + rows, mask=m_valid, other=0).to(tl.int64)
        else:
            src_rows = rows
        q_ptrs = Q + head * stride_qh + src_rows[:, None] * stride_qn + offs_d[None, :]
        q = tl.load(q_ptrs, mask=m_valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n_full = (n_k // BLOCK_N) * BLOCK_N
    if KV_DESC == 0:
        # Request bases in int64; offsets inside a request stay int32 (the wrapper checks
        # max_seqlen_k * stride < 2**31).
        k_base = K + k_start.to(tl.int64) * stride_kn + head * stride_kh
        v_base = V + k_start.to(tl.int64) * stride_vn + head * stride_vh
        offs_n = tl.arange(0, BLOCK_N)
        if PTR_INC:
            # Loop-carried tile pointers, advanced by one tile per iteration.
            k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
            v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
            for start_n in range(0, n_full, BLOCK_N):
                acc, l_i, m_i = _attn_tile(
                    acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n + offs_n, n_k, qk_scale,
                    HEAD_DIM, BLOCK_D, False, DOT_FP32, DOT_PRECISION,
                )  # fmt: skip
                k_ptrs += BLOCK_N * stride_kn
                v_ptrs += BLOCK_N * stride_vn
        else:
            for start_n in range(0, n_full, BLOCK_N):
                acc, l_i, m_i = _attn_tile(
                    acc, l_i, m_i, q,
                    k_base + (start_n + offs_n)[:, None] * stride_kn + offs_d[None, :],
                    v_base + (start_n + offs_n)[:, None] * stride_vn + offs_d[None, :],
                    start_n + offs_n, n_k, qk_scale,
                    HEAD_DIM, BLOCK_D, False, DOT_FP32, DOT_PRECISION,
                )  # fmt: skip
        if n_full < n_k:
            acc, l_i, m_i = _attn_tile(
                acc, l_i, m_i, q,
                k_base + (n_full + offs_n)[:, None] * stride_kn + offs_d[None, :],
                v_base + (n_full + offs_n)[:, None] * stride_vn + offs_d[None, :],
                n_full + offs_n, n_k, qk_scale,
                HEAD_DIM, BLOCK_D, True, DOT_FP32, DOT_PRECISION,
            )  # fmt: skip
    else:
        if KV_DESC == 1:
            # Host descriptors over (total_k, H * D): request i's keys start at row k_start,
            # head h at column h * D.
            k_desc = K
            v_desc = V
            row0 = k_start
            col = head_i32 * HEAD_DIM
        else:
            # Device descriptors over this request and head only: (n_k, D); rows past n_k
            # are zero-filled by the TMA unit. (max(., 1): a descriptor has no empty dims; a
            # request without keys has no queries and loads nothing.)
            k_desc = tl.make_tensor_descriptor(
                K + k_start.to(tl.int64) * stride_kn + head * stride_kh,
                shape=[tl.maximum(n_k, 1), HEAD_DIM],
                strides=[stride_kn, 1],
                block_shape=[BLOCK_N, BLOCK_D],
            )
            v_desc = tl.make_tensor_descriptor(
                V + k_start.to(tl.int64) * stride_vn + head * stride_vh,
                shape=[tl.maximum(n_k, 1), HEAD_DIM],
                strides=[stride_vn, 1],
                block_shape=[BLOCK_N, BLOCK_D],
            )
            row0 = 0
            col = 0
        if WARP_SPEC:
            # One loop over every key tile, with the key mask in every iteration unless every
            # request's n_k is a multiple of BLOCK_N (EVEN_N, known to the host): Triton 3.6's
            # Hopper warp specialization drops a separate tail tile, and an `if` in the loop
            # disables it.
            n_loop = tl.where(pid_m * BLOCK_M < n_q, n_k, 0)
            for start_n in tl.range(0, n_loop, BLOCK_N, warp_specialize=True):
                acc, l_i, m_i = _attn_tile_desc(
                    acc, l_i, m_i, q, k_desc, v_desc, row0 + start_n, col, start_n, n_k,
                    qk_scale, BLOCK_N, not EVEN_N, False, DOT_FP32,
                )  # fmt: skip
            if EVEN_N:
                # The host inferred EVEN_N from total_k == B * max_seqlen_k: a request whose n_k
                # breaks that (max_seqlen_k under-estimated) gets NaN rows, not wrong numbers.
                acc = tl.where(n_k % BLOCK_N == 0, acc, float("nan"))
        else:
            for start_n in tl.range(0, n_full, BLOCK_N):
                acc, l_i, m_i = _attn_tile_desc(
                    acc, l_i, m_i, q, k_desc, v_desc, row0 + start_n, col, start_n, n_k,
                    qk_scale, BLOCK_N, False, False, DOT_FP32,
                )  # fmt: skip
            if n_full < n_k:
                acc, l_i, m_i = _attn_tile_desc(
                    acc, l_i, m_i, q, k_desc, v_desc, row0 + n_full, col, n_full, n_k, qk_scale,
                    BLOCK_N, True, KV_DESC == 1, DOT_FP32,
                )  # fmt: skip
    # l_i >= 1 for every row: the row max contributes exp2(0) = 1 (programs without queries in
    # WARP_SPEC mode keep l_i = 0 and store nothing).
    if WARP_SPEC:
        l_i = tl.where(l_i > 0, l_i, 1.0)
    acc = acc / l_i[:, None]
    o_ptrs = O + head * stride_oh + rows[:, None] * stride_on + offs_d[None, :]
    tl.store(
        o_ptrs,
        acc.to(O.dtype.element_ty),
        mask=m_valid[:, None] & (offs_d[None, :] < HEAD_DIM),
    )
