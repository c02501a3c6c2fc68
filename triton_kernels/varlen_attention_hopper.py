"""Hopper (sm_90) varlen masked-query attention in Gluon, FlashAttention-3 style.

Same contract as the Triton kernel in triton_kernels/varlen_attention_kernel.py (layout,
invariants and numerics in triton_kernels/varlen_attention.py, which dispatches here); this
file holds only device code. Scope: head dim 128, fp16/bf16, Triton 3.6's Gluon API.

Structure of one program (a CTA; query tile t of request i, head h; 2 * BLOCK_M query rows):

* a producer partition (1 warp) issues TMA loads: the query tile once, then key and value
  tiles of BLOCK_N rows into a ring of STAGES shared-memory slots. Descriptors are built in the
  kernel over this request and head only, so rows past n_q / n_k read as zeros.
* two consumer partitions (one warp group each, BLOCK_M query rows each) run the online
  softmax with warp-group MMAs (wgmma). Intra-warp-group overlap (FA3 §3.2): the score MMA of
  key tile j is issued before the PV MMA of tile j - 1, and the softmax of tile j runs while
  that PV MMA is in flight; P goes to the PV MMA from registers (no shared-memory round trip).
* Slots are handed back through "empty" mbarriers (count 2: both consumers arrive once per
  use); "ready" mbarriers complete when the TMA bytes land.

Invariants: BLOCK_N == HEAD_DIM == 128 (the score and output accumulators share one MMA
layout, so row statistics need no layout conversion); the last, partial key tile is masked
with -inf, so with n_k >= 1 every row has a finite max. A request with queries but no keys (an
input the wrapper rejects only when validating) gets NaN rows instead of a pipeline that would
wait forever for key tiles. Numerics as the Triton kernel: fp32 accumulation, base-2 online
softmax with the scale pre-multiplied by log2(e), P rounded to the input dtype before the PV
product.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from triton_kernels.varlen_attention_kernel import _linear_tile

# TMA global-to-shared copy: renamed async_load (and the old name made an error) after 3.6.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

CONSUMERS = gl.constexpr(2)  # consumer warp groups per program; each owns BLOCK_M query rows


# Program t of the request-major linear grid -> (request, query tile): the Triton kernel's scalar
# prologue, compiled as Gluon from the same source (a Gluon kernel cannot call a @triton.jit
# function; under TRITON_INTERPRET `.fn` is still the plain Python function).
_program_tile = gluon.jit(_linear_tile.fn)


@gluon.jit
def _request_desc(X, start, n, head, stride_n, stride_h, bufs, HEAD_DIM: gl.constexpr,
                  BLOCK: gl.constexpr):  # fmt: skip
    # TMA descriptor over rows [start, start + n) of head `head` of X (tokens, H, D): (n, D),
    # rows past n read as zeros; tiles of BLOCK rows in the shared layout of `bufs`.
    return tma.make_tensor_descriptor(
        X + start.to(gl.int64) * stride_n + head * stride_h,
        shape=[n, HEAD_DIM],
        strides=[stride_n, 1],
        block_shape=[BLOCK, HEAD_DIM],
        layout=bufs.type.layout,
    )


@gluon.jit
def _producer(
    args, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    (Q, K, V, O, q_smem, k_bufs, v_bufs, bars, q_row, q_end, k_start, n_k, rows_left, head,
     qk_scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on,
     stride_oh) = args  # fmt: skip
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    dtype: gl.constexpr = Q.dtype.element_ty
    q_desc = tma.make_tensor_descriptor(
        Q + head * stride_qh,
        shape=[q_end, HEAD_DIM],
        strides=[stride_qn, 1],
        block_shape=[BLOCK_M, HEAD_DIM],
        layout=q_smem.type.layout,
    )
    k_desc = _request_desc(K, k_start, n_k, head, stride_kn, stride_kh, k_bufs, HEAD_DIM, BLOCK_N)
    v_desc = _request_desc(V, k_start, n_k, head, stride_vn, stride_vh, v_bufs, HEAD_DIM, BLOCK_N)
    tile_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
    mbarrier.expect(q_bar.index(0), CONSUMERS * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8)
    for c in gl.static_range(CONSUMERS):
        _tma_load(q_desc, [q_row + c * BLOCK_M, 0], q_bar.index(0), q_smem.index(c))
    n_tiles = gl.cdiv(n_k, BLOCK_N)
    for j in range(n_tiles):
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), tile_bytes)
        _tma_load(k_desc, [j * BLOCK_N, 0], k_ready.index(s), k_bufs.index(s))
        mbarrier.wait(v_empty.index(s), phase ^ 1)
        mbarrier.expect(v_ready.index(s), tile_bytes)
        _tma_load(v_desc, [j * BLOCK_N, 0], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _softmax_update(s, m_i, l_i, cols, n_valid, qk_scale, MASK: gl.constexpr):
    # Online-softmax update for one score tile s (BLOCK_M, BLOCK_N), scores in natural units:
    # returns (p, alpha, m_new, l_new) with m in log2 units (scores * qk_scale). MASK: columns
    # >= n_valid (keys past n_k, zero-filled by TMA) get -inf scores.
    if MASK:
        s = gl.where((cols < n_valid)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _consumer_step(
    j, q, zero_s, acc, p, m_i, l_i, cols, n_k, qk_scale, k_bufs, v_bufs, k_ready, k_empty,
    v_ready, v_empty, p_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    MASK: gl.constexpr,
):  # fmt: skip
    # Key tile j >= 1: issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; the softmax of S_j runs
    # while the PV MMA is in flight. acc holds O rescaled up to tile j - 1.
    s_k = j % STAGES
    jv = j - 1
    s_v = jv % STAGES
    p16 = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
    mbarrier.wait(k_ready.index(s_k), (j // STAGES) & 1)
    mbarrier.wait(v_ready.index(s_v), (jv // STAGES) & 1)
    s = warpgroup_mma(q, k_bufs.index(s_k).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    acc = warpgroup_mma(p16, v_bufs.index(s_v), acc, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    mbarrier.arrive(k_empty.index(s_k), count=1)
    p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, cols, n_k - j * BLOCK_N, qk_scale, MASK)
    acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
    mbarrier.arrive(v_empty.index(s_v), count=1)
    acc = acc * alpha[:, None]
    return acc, p, m_i, l_i


@gluon.jit
def _consumer(
    args, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, WG: gl.constexpr,
):  # fmt: skip
    (Q, K, V, O, q_smem, k_bufs, v_bufs, bars, q_row, q_end, k_start, n_k, rows_left, head,
     qk_scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on,
     stride_oh) = args  # fmt: skip
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    q = q_smem.index(WG)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    n_tiles = gl.cdiv(n_k, BLOCK_N)

    mbarrier.wait(q_bar.index(0), 0)
    # Key tile 0 (masked: it may be the last, partial one).
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(0), count=1)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, mma))
    p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, cols, n_k, qk_scale, True)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, mma)
    for j in range(1, n_tiles - 1):
        acc, p, m_i, l_i = _consumer_step(
            j, q, zero_s, acc, p, m_i, l_i, cols, n_k, qk_scale, k_bufs, v_bufs, k_ready,
            k_empty, v_ready, v_empty, p_layout, BLOCK_N, STAGES, False,
        )  # fmt: skip
    if n_tiles > 1:
        acc, p, m_i, l_i = _consumer_step(
            n_tiles - 1, q, zero_s, acc, p, m_i, l_i, cols, n_k, qk_scale, k_bufs, v_bufs,
            k_ready, k_empty, v_ready, v_empty, p_layout, BLOCK_N, STAGES, True,
        )  # fmt: skip
    # PV of the last key tile.
    jl = n_tiles - 1
    s_v = jl % STAGES
    p16 = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
    mbarrier.wait(v_ready.index(s_v), (jl // STAGES) & 1)
    acc = warpgroup_mma(p16, v_bufs.index(s_v), acc, is_async=True)
    acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
    mbarrier.arrive(v_empty.index(s_v), count=1)

    # l_i >= 1 (the row max contributes exp2(0) = 1).
    out = (acc / l_i[:, None]).to(O.dtype.element_ty)
    _store_rows(O, out, q_row, WG * BLOCK_M, rows_left, head, stride_on, stride_oh)


@gluon.jit
def _store_rows(O, out, q_row, first, rows_left, head, stride_on, stride_oh):
    # Rows [first, first + ROWS) of this program's tile (out: (ROWS, D), O's dtype) to packed
    # output rows q_row + first + ..., only those < rows_left (the request's remaining rows);
    # coalesced 16-byte stores from a blocked layout of the caller's 4 warps.
    ROWS: gl.constexpr = out.shape[0]
    HEAD_DIM: gl.constexpr = out.shape[1]
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    out = gl.convert_layout(out, store_layout)
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, store_layout)) + first
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
    ptrs = O + head * stride_oh + (q_row + r).to(gl.int64)[:, None] * stride_on + d[None, :]
    gl.store(ptrs, out, mask=(r < rows_left)[:, None])


@gluon.jit
def _consumer_default(
    args,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    _consumer(args, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, 0)


@gluon.jit
def _consumer_worker(
    args,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    _consumer(args, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, 1)


@gluon.jit
def _varlen_attention_hopper_kernel(
    Q, K, V, O, CU_Q, CU_K, qk_scale, n_req,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, BLOCK_B: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):  # fmt: skip
    gl.static_assert(BLOCK_N == HEAD_DIM)
    req, tile = _program_tile(CU_Q, n_req, CONSUMERS * BLOCK_M, BLOCK_B)
    head = gl.program_id(1).to(gl.int64)
    q_start = gl.load(CU_Q + req)
    n_q = gl.load(CU_Q + req + 1) - q_start
    k_start = gl.load(CU_K + req)
    n_k = gl.load(CU_K + req + 1) - k_start
    tile_row = tile * (CONSUMERS * BLOCK_M)
    if (tile_row < n_q) & (n_k <= 0):
        # Queries without keys break the wrapper's invariant (checked only with validate=True
        # on CUDA): their rows get NaN. The pipeline below would wait forever for key tiles.
        nan_rows = gl.full(
            [CONSUMERS * BLOCK_M, HEAD_DIM], float("nan"), O.dtype.element_ty,
            gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]),
        )  # fmt: skip
        _store_rows(O, nan_rows, q_start + tile_row, 0, n_q - tile_row, head, stride_on, stride_oh)
    elif tile_row < n_q:
        dtype: gl.constexpr = Q.dtype.element_ty
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth, rank=2
        )
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_DIM], smem_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], bar_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        mbarrier.init(q_bar.index(0), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(k_empty.index(s), count=CONSUMERS)
            mbarrier.init(v_empty.index(s), count=CONSUMERS)
        bars = (q_bar, k_ready, k_empty, v_ready, v_empty)
        # Runtime arguments of every partition; q_start + tile_row is the packed row of this
        # program's first query, rows_left = n_q - tile_row its request's rows from there on.
        args = (
            Q, K, V, O, q_smem, k_bufs, v_bufs, bars, q_start + tile_row, q_start + n_q,
            k_start, n_k, n_q - tile_row, head, qk_scale, stride_qn, stride_qh, stride_kn,
            stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
        )  # fmt: skip
        # (Constexprs go into each partition's argument tuple literally: inside a tuple held
        # in a variable they would become runtime scalars.)
        gl.warp_specialize(
            [
                (_consumer_default, (args, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
                (_consumer_worker, (args, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
                (_producer, (args, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )
