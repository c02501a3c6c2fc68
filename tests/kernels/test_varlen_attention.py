"""Tests of triton_kernels.varlen_attention against its torch reference.

``@triton.jit`` decides whether to build an interpreted function when the kernel module (and triton
itself, for its own jit library) is *imported*, so TRITON_INTERPRET must be set before triton is
imported: tests/conftest.py sets it first thing on machines without a GPU, so that by default
everything runs on the CPU under Triton's interpreter. The interpreted kernel runs on CPU tensors
and uses 16x16 tiles, so the small shapes below (lengths <= 80 tokens, H <= 2) cover several full
tiles, partial tiles and single-key requests. On a GPU machine, ``TRITON_INTERPRET=0 pytest --gpu``
compiles the kernel: the same small tests then run on CUDA tensors with the GPU tile sizes, and
``TestGpu`` adds serving shapes (it is skipped while the kernel is interpreted: far too slow).

Tolerances (atol, rtol), output vs the fp32 reference:
* fp32: 1e-4 / 1e-4 -- the interpreter's tl.dot is an fp32 numpy matmul, and on GPUs fp32 inputs
  use IEEE (not TF32) products, so only summation order differs.
* fp16: 2e-3 / 2e-3 -- P is rounded to fp16 before the PV product, plus the fp16 output rounding
  (half an ulp is 4.9e-4 relative).
* bf16: 2e-2 / 2e-2 -- same with 8 mantissa bits (half an ulp is 3.9e-3 relative).

bf16 under the interpreter: the interpreter stores bf16 as uint16 and its tl.dot multiplies those
bit patterns (results around 1e10; triton-lang/triton#11584, "not supported yet"). Loads, stores
and casts of bf16 are right, so the wrapper passes DOT_FP32=True under the interpreter and the
kernel upcasts the bf16 operands (q, k, and P after its rounding to bf16) to fp32 before each
tl.dot. bf16 x bf16 products are exact in fp32, so this differs from the GPU's bf16 tensor-core
path only in summation order; the GPU class below covers the real bf16 path. fp16 needs no
workaround (the interpreter's fp16 dot is an exact-product fp32 matmul).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_kernels import varlen_attention as va
from triton_kernels.varlen_attention import (
    _interpreting,
    _reference,
    varlen_attention,
)

# Interpreted kernel: CPU tensors. Compiled kernel (TRITON_INTERPRET=0): CUDA tensors.
DEVICE = "cpu" if _interpreting() else "cuda"
REPO = Path(__file__).resolve().parents[2]

TOLS = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = list(TOLS)

# (n_q per request, n_k per request), lengths in tokens. The interpreter's tiles are 16 x 16.
CASES = {
    "b1_all_masked": ([37], [37]),
    "b2_zero_q_and_one_key": ([0, 5], [48, 1]),
    "b3_mixed": ([16, 0, 29], [80, 7, 29]),
    "b4_nq_gt_nk": ([40, 3, 1, 9], [9, 17, 64, 9]),
    "b5_mixed": ([3, 64, 1, 0, 31], [17, 64, 1, 50, 31]),
}


def _cu(lengths: list[int], device: torch.device | str = DEVICE) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out.to(device)


def _generator(what: str) -> torch.Generator:
    """A CPU generator on a fresh seed, printed (pytest shows it on failure: reproduce with it)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"{what} seed={seed}")
    return torch.Generator().manual_seed(seed)


def _perm(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.randperm(n, generator=_generator("randperm")).to(device)


def _inputs(
    n_q: list[int],
    n_k: list[int],
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = DEVICE,
    gen: torch.Generator | None = None,
    q_spread: float = 2.0,
):
    """Fresh random (never zero) q, k, v; q_spread > 1 widens scores so the row max moves."""
    gen = gen or _generator("_inputs")

    def rand(rows: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(rows, heads, head_dim, generator=gen) * scale
        return x.to(device=device, dtype=dtype)

    q = rand(sum(n_q), q_spread)
    k, v = rand(sum(n_k)), rand(sum(n_k))
    return q, k, v, _cu(n_q, device), _cu(n_k, device)


def _run(q, k, v, cu_q, cu_k, n_q, n_k, **kw) -> torch.Tensor:
    return varlen_attention(q, k, v, cu_q, cu_k, max(n_q, default=0), max(n_k, default=0), **kw)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("head_dim", [16, 32, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(case: str, head_dim: int, dtype: torch.dtype) -> None:
    n_q, n_k = CASES[case]
    heads = 2 if head_dim < 64 else 1
    q, k, v, cu_q, cu_k = _inputs(n_q, n_k, heads, head_dim, dtype)
    # NaN-poisoned output buffer: any row the kernel fails to write stays NaN and fails.
    out = torch.full((sum(n_q), heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    got = _run(q, k, v, cu_q, cu_k, n_q, n_k, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, _reference(q, k, v, cu_q, cu_k), **TOLS[dtype])


@pytest.mark.parametrize("head_dim", [8, 24, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_head_dim_padding(head_dim: int, dtype: torch.dtype) -> None:
    n_q, n_k = [7, 0, 20], [23, 4, 35]
    q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 2, head_dim, dtype)
    got = _run(q, k, v, cu_q, cu_k, n_q, n_k)
    torch.testing.assert_close(got, _reference(q, k, v, cu_q, cu_k), **TOLS[dtype])


def test_softmax_scale_and_loose_max_seqlen() -> None:
    n_q, n_k = [12, 33], [45, 33]
    q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 2, 32, torch.float32)
    # max_seqlen_* are upper bounds: programs past a request's tiles exit without writing.
    got = varlen_attention(q, k, v, cu_q, cu_k, 70, 90, softmax_scale=0.37)
    ref = _reference(q, k, v, cu_q, cu_k, softmax_scale=0.37)
    torch.testing.assert_close(got, ref, **TOLS[torch.float32])


def test_strided_views_of_packed_qkv() -> None:
    # q, k, v as views of one (tokens, 3, H, D) tensor: token stride 3*H*D, head stride D.
    n = [21, 0, 40]
    qkv = torch.randn(sum(n), 3, 2, 32, device=DEVICE)
    q, k, v = qkv.unbind(1)
    cu = _cu(n)
    got = _run(q, k, v, cu, cu, n, n)
    torch.testing.assert_close(got, _reference(q, k, v, cu, cu), **TOLS[torch.float32])


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_index_gather(index_dtype: torch.dtype, dtype: torch.dtype) -> None:
    # Source: all L tokens of each request; queries: a random masked subset (unsorted).
    n_k = [30, 50, 19]
    n_q = [9, 50, 0]
    heads, head_dim = 2, 32
    src, k, v, _, cu_k = _inputs(n_k, n_k, heads, head_dim, dtype)
    starts = _cu(n_k).tolist()
    picks = [starts[i] + _perm(n_k[i])[: n_q[i]] for i in range(len(n_k))]
    index = torch.cat(picks).to(device=DEVICE, dtype=index_dtype)
    cu_q = _cu(n_q)
    got = _run(src, k, v, cu_q, cu_k, n_q, n_k, q_index=index)
    ref = _reference(src[index.long()], k, v, cu_q, cu_k)
    torch.testing.assert_close(got, ref, **TOLS[dtype])


# Non-default configurations (see _Config): TMA host descriptors, in-kernel descriptors, warp
# specialization, the request-major linear grid and loop-carried pointers, at interpreter tile
# sizes or GPU ones. Fields: block_m, block_n, num_warps, num_stages, kv_desc, warp_spec,
# ptr_inc, linear_grid.
CONFIGS = {
    "host_desc": (16, 16, 1, 1, 1) if DEVICE == "cpu" else (128, 64, 8, 3, 1),
    "device_desc": (16, 16, 1, 1, 2) if DEVICE == "cpu" else (128, 64, 8, 3, 2),
    "warp_spec": (16, 16, 1, 1, 2, True) if DEVICE == "cpu" else (128, 64, 4, 2, 2, True),
    "warp_spec_linear": (32, 16, 1, 1, 2, True, False, True)
    if DEVICE == "cpu"
    else (128, 128, 4, 2, 2, True, False, True),
    "pointer_linear_inc": (16, 16, 1, 1, 0, False, True, True)
    if DEVICE == "cpu"
    else (64, 64, 4, 3, 0, False, True, True),
}


@pytest.mark.parametrize("case", ["b2_zero_q_and_one_key", "b3_mixed", "b5_mixed"])
@pytest.mark.parametrize("tile", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_configs_match_reference(
    case: str, tile: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The TMA paths need a power-of-two D and 16-byte aligned rows: D=32, fp16/bf16.
    cfg = va._Config(*CONFIGS[tile])
    monkeypatch.setattr(va, "_pick_config", lambda block_d, dtype: cfg)
    n_q, n_k = CASES[case]
    q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 2, 32, dtype)
    assert not cfg.kv_desc or va._tma_ok(cfg, q, k, v, None, 32, 32) or DEVICE == "cuda"
    out = torch.full((sum(n_q), 2, 32), float("nan"), dtype=dtype, device=DEVICE)
    got = _run(q, k, v, cu_q, cu_k, n_q, n_k, out=out)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, _reference(q, k, v, cu_q, cu_k), **TOLS[dtype])
    # A q_index gather has no TMA form: warp-specialized configs fall back to pointer loads.
    index = _perm(sum(n_q), DEVICE)
    got = _run(q, k, v, cu_q, cu_k, n_q, n_k, q_index=index)
    torch.testing.assert_close(got, _reference(q[index], k, v, cu_q, cu_k), **TOLS[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_warp_spec_even_keys(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every request has max_seqlen_k keys, a multiple of BLOCK_N: the warp-specialized loop runs
    # without the key mask (EVEN_N).
    cfg = va._Config(*CONFIGS["warp_spec_linear"])
    monkeypatch.setattr(va, "_pick_config", lambda block_d, dtype: cfg)
    n_q, n_k = [5, 0, 20, 1], [4 * cfg.block_n] * 4
    q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 2, 32, dtype)
    got = _run(q, k, v, cu_q, cu_k, n_q, n_k)
    torch.testing.assert_close(got, _reference(q, k, v, cu_q, cu_k), **TOLS[dtype])


def test_warp_spec_even_keys_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    # total_k == B * max_seqlen_k although max_seqlen_k under-estimates request 2 (validate=False):
    # requests whose n_k is not a multiple of BLOCK_N get NaN rows instead of wrong values.
    cfg = va._Config(*CONFIGS["warp_spec_linear"])
    monkeypatch.setattr(va, "_pick_config", lambda block_d, dtype: cfg)
    bn = cfg.block_n
    n_q, n_k = [3, 4, 2], [bn // 2, bn, 3 * bn // 2]
    q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 2, 32, torch.float16)
    got = varlen_attention(q, k, v, cu_q, cu_k, 4, bn, validate=False)
    assert torch.isnan(got[:3]).all() and torch.isnan(got[7:]).all()
    ref = _reference(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(got[3:7], ref[3:7], **TOLS[torch.float16])


def test_no_queries_returns_empty_without_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"kernel launched with grid {grid} for zero queries")

    monkeypatch.setattr(va, "_varlen_attention_kernel", NoLaunch())
    q, k, v, cu_q, cu_k = _inputs([0, 0], [5, 9], 2, 16, torch.float32)
    got = _run(q, k, v, cu_q, cu_k, [0, 0], [5, 9])
    assert got.shape == (0, 2, 16)


def test_reference_matches_sdpa_in_float64() -> None:
    # The reference computes in fp32 whatever the input dtype: compare at fp32 accuracy.
    n_q, n_k = [5, 0, 11], [8, 3, 11]
    q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 2, 16, torch.float64, "cpu")
    ref = _reference(q, k, v, cu_q, cu_k)
    for i in (0, 2):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        sd = torch.nn.functional.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        ).transpose(0, 1)
        torch.testing.assert_close(ref[qs:qe], sd, atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError, match="no keys"):
        _reference(q[:5], k[:0], v[:0], _cu([5], "cpu"), _cu([0], "cpu"))


GPU_CASES = [
    ("sdxl_4096_mixed", 10, 64, 4096, 4096, [0.05, 0.2, 0.5, 1.0]),
    ("sdxl_1024_mixed8", 20, 64, 1024, 1024, [0.05, 0.05, 0.9, 0.3, 0.15, 0.6, 0.2, 1.0]),
    ("flux_4608_mixed", 24, 128, 4608, 4096, [0.05, 0.2, 0.5, 1.0]),
    ("flux_4608_zero_and_full", 24, 128, 4608, 4096, [0.0, 1.0]),
]


def _require_gluon() -> None:
    if torch.cuda.get_device_capability()[0] != 9 or not va._GLUON_VALIDATED:
        pytest.skip("the Gluon kernel runs on sm_90 with triton 3.6")


def _check_queries_without_keys() -> None:
    """Run by TestGpu in a child process: n_k = 0 for a request that has queries."""
    n_q, n_k = [70, 300, 5], [200, 0, 129]
    q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 2, 128, torch.float16, "cuda")
    assert va._gluon_ok(q, k, v, None, 128, len(n_q))
    got = _run(q, k, v, cu_q, cu_k, n_q, n_k, validate=False)
    torch.cuda.synchronize()
    assert torch.isnan(got[70:370]).all()
    keep = torch.cat([torch.arange(70), torch.arange(370, 375)]).to("cuda")
    ref = _reference(q[keep], k, v, _cu([70, 0, 5], "cuda"), cu_k)
    torch.testing.assert_close(got[keep], ref, **TOLS[torch.float16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(_interpreting(), reason="kernel is interpreted: set TRITON_INTERPRET=0")
class TestGpu:
    """Compiled kernel at serving shapes (run with --gpu on a CUDA machine, TRITON_INTERPRET=0)."""

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
    def test_serving_shapes(self, case, dtype: torch.dtype) -> None:
        _, heads, head_dim, seq, maskable, fracs = case
        n_q = [round(f * maskable) for f in fracs]
        n_k = [seq] * len(fracs)
        q, k, v, cu_q, cu_k = _inputs(n_q, n_k, heads, head_dim, dtype, "cuda", q_spread=1.0)
        out = torch.full((sum(n_q), heads, head_dim), float("nan"), dtype=dtype, device="cuda")
        got = _run(q, k, v, cu_q, cu_k, n_q, n_k, out=out)
        torch.cuda.synchronize()
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, _reference(q, k, v, cu_q, cu_k), **TOLS[dtype])

    @pytest.mark.parametrize("head_dim", [16, 32, 40, 64, 96, 128, 256])
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_odd_lengths_all_head_dims(self, head_dim: int, dtype: torch.dtype) -> None:
        n_q, n_k = [1, 0, 129, 300, 77], [1, 5, 200, 300, 1000]
        q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 3, head_dim, dtype, "cuda")
        got = _run(q, k, v, cu_q, cu_k, n_q, n_k, validate=True)
        torch.testing.assert_close(got, _reference(q, k, v, cu_q, cu_k), **TOLS[dtype])

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
    def test_q_index_gather(self, dtype: torch.dtype) -> None:
        heads, head_dim, seq, fracs = 24, 128, 4608, [0.3, 0.05, 1.0]
        n_k = [seq] * len(fracs)
        n_q = [round(f * 4096) for f in fracs]
        src, k, v, _, cu_k = _inputs(n_k, n_k, heads, head_dim, dtype, "cuda", q_spread=1.0)
        index = torch.cat(
            [i * seq + _perm(4096)[:nq].sort().values for i, nq in enumerate(n_q)]
        ).to("cuda")
        cu_q = _cu(n_q, "cuda")
        got = _run(src, k, v, cu_q, cu_k, n_q, n_k, q_index=index)
        ref = _reference(src[index], k, v, cu_q, cu_k)
        torch.testing.assert_close(got, ref, **TOLS[dtype])

    @pytest.mark.parametrize("packed_qkv", [False, True], ids=["separate", "packed_qkv"])
    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
    def test_gluon_kernel_odd_lengths(self, dtype: torch.dtype, packed_qkv: bool) -> None:
        """Head dim 128 on Hopper runs the Gluon kernel: partial and single-key tiles, requests
        without queries, more queries than keys, 40 requests of different key counts; q, k, v
        separate or views of one packed qkv tensor (token stride 3 * H * D)."""
        _require_gluon()
        assert va._pick_config(128, dtype).gluon
        cases = [
            ([0, 129, 0, 7], [5, 200, 1, 128]),
            ([127, 128, 129, 255, 256, 257], [257, 1, 64, 384, 127, 500]),
            ([5000], [130]),
            ([37] * 40, [1000 + 3 * i for i in range(40)]),
        ]
        for n_q, n_k in cases:
            q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 3, 128, dtype, "cuda")
            if packed_qkv:
                qkv = torch.zeros(max(sum(n_q), sum(n_k)), 3, 3, 128, dtype=dtype, device="cuda")
                qkv[: sum(n_q), 0], qkv[: sum(n_k), 1], qkv[: sum(n_k), 2] = q, k, v
                q, k, v = qkv[: sum(n_q), 0], qkv[: sum(n_k), 1], qkv[: sum(n_k), 2]
            assert va._gluon_ok(q, k, v, None, 128, len(n_q))
            out = torch.full((sum(n_q), 3, 128), float("nan"), dtype=dtype, device="cuda")
            got = _run(q, k, v, cu_q, cu_k, n_q, n_k, out=out)
            torch.testing.assert_close(got, _reference(q, k, v, cu_q, cu_k), **TOLS[dtype])

    def test_gluon_kernel_queries_without_keys(self) -> None:
        """Bad input past the unchecked invariant (validate=False): a request with queries but
        no keys gets NaN rows — no hang waiting for key tiles — and the others are right. Run in
        a child process: a kernel that hangs must fail this test, not stall the session."""
        _require_gluon()
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        code = "import test_varlen_attention as t; t._check_queries_without_keys()"
        try:
            done = subprocess.run(
                [sys.executable, "-c", code],
                cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=150,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail("the kernel did not finish within 150 s on a request without keys (hang)")
        assert done.returncode == 0, done.stdout + done.stderr

    def test_gluon_kernel_in_cuda_graph(self) -> None:
        """The engine replays masked steps from CUDA graphs: a captured launch (its in-kernel
        TMA descriptors live in scratch memory from the capture's pool) must follow new input
        values on replay."""
        _require_gluon()
        n_q, n_k = [231, 0, 922, 4096], [4608, 4608, 4608, 4608]
        q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 24, 128, torch.bfloat16, "cuda", q_spread=1.0)
        _run(q, k, v, cu_q, cu_k, n_q, n_k)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _run(q, k, v, cu_q, cu_k, n_q, n_k)
        for _ in range(2):
            q2, k2, v2, _, _ = _inputs(n_q, n_k, 24, 128, torch.bfloat16, "cuda", q_spread=1.0)
            q.copy_(q2), k.copy_(k2), v.copy_(v2)
            graph.replay()
            torch.cuda.synchronize()
            ref = _reference(q, k, v, cu_q, cu_k)
            torch.testing.assert_close(out, ref, **TOLS[torch.bfloat16])

    def test_gluon_kernel_falls_back(self) -> None:
        """Where the Gluon kernel does not apply (more than 64 requests, unaligned strides) the
        Triton kernel gives the right result."""
        _require_gluon()
        n_q, n_k = [3] * 70, [20] * 70
        q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 2, 128, torch.float16, "cuda")
        assert not va._gluon_ok(q, k, v, None, 128, 70)
        ref = _reference(q, k, v, cu_q, cu_k)
        torch.testing.assert_close(_run(q, k, v, cu_q, cu_k, n_q, n_k), ref, **TOLS[torch.float16])
        n_q, n_k = [5] * 20, [150] * 20
        q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 2, 128, torch.float16, "cuda")
        wide = torch.zeros(sum(n_k), 2, 129, dtype=torch.float16, device="cuda")
        wide[..., :128] = k
        k_odd = wide[..., :128]  # head stride 129 elements: not 16-byte aligned
        assert va._gluon_ok(q, k, v, None, 128, 20)
        assert not va._gluon_ok(q, k_odd, v, None, 128, 20)
        got = _run(q, k_odd, v, cu_q, cu_k, n_q, n_k)
        torch.testing.assert_close(got, _reference(q, k, v, cu_q, cu_k), **TOLS[torch.float16])

    def test_validate_true_checks_cuda_values(self) -> None:
        q, k, v, _, cu_k = _inputs([4, 6], [8, 10], 2, 64, torch.float16, "cuda")
        cu_q = torch.tensor([0, 11, 10], dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match="non-decreasing"):
            varlen_attention(q, k, v, cu_q, cu_k, 11, 10, validate=True)
