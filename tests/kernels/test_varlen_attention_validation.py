"""Input validation of triton_kernels.varlen_attention: each malformed argument (dtypes,
cu_seqlens shape/dtype/monotonicity/ends, too-small max_seqlen, queries without keys) raises a
clear error before any launch (CPU: the interpreted kernel; GPU: compiled, with --gpu)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_varlen_attention import DEVICE, _cu, _inputs
from triton_kernels.varlen_attention import varlen_attention


def _bad_inputs(kind: str, device: str = DEVICE):
    """Valid inputs with one defect; returns (args, kwargs) for varlen_attention."""
    n_q, n_k = [4, 6], [8, 10]
    q, k, v, cu_q, cu_k = _inputs(n_q, n_k, 2, 16, torch.float32, device)
    kw: dict = {}
    max_q, max_k = 6, 10
    if kind == "dtype_mismatch":
        k = k.half()
    elif kind == "unsupported_dtype":
        q, k, v = q.double(), k.double(), v.double()
    elif kind == "cu_int64":
        cu_q = cu_q.long()
    elif kind == "cu_length_mismatch":
        cu_k = _cu([8, 10, 0], device)
    elif kind == "cu_2d":
        cu_q = cu_q[None]
    elif kind == "non_monotonic":
        cu_q = torch.tensor([0, 11, 10], dtype=torch.int32, device=device)
    elif kind == "cu_not_from_zero":
        cu_k = cu_k + 1
    elif kind == "cu_end_mismatch":
        q = q[:9]
    elif kind == "max_seqlen_too_small":
        max_q = 5
    elif kind == "queries_without_keys":
        k, v = k[:8], v[:8]
        cu_k = _cu([8, 0], device)
    elif kind == "q_2d":
        q = q[:, 0]
    elif kind == "heads_mismatch":
        k, v = k[:, :1], v[:, :1]
    elif kind == "kv_shape_mismatch":
        v = v[:-1]
    elif kind == "head_dim_too_large":
        q, k, v = (torch.randn(t.shape[0], 1, 512, device=device) for t in (q, k, v))
    elif kind == "last_dim_strided":
        q = torch.randn(10, 2, 32, device=device)[:, :, ::2]
    elif kind == "bad_scale":
        kw["softmax_scale"] = -1.0
    elif kind == "q_index_dtype":
        kw["q_index"] = torch.arange(10, dtype=torch.int16, device=device)
    elif kind == "q_index_out_of_range":
        kw["q_index"] = torch.arange(10, device=device) + 1
    elif kind == "out_wrong_shape":
        kw["out"] = torch.empty(10, 2, 8, device=device)
    elif kind == "device_mismatch":
        cu_k = cu_k.to("meta")
    else:
        raise AssertionError(kind)
    return (q, k, v, cu_q, cu_k, max_q, max_k), kw


BAD = {
    "dtype_mismatch": (TypeError, "dtypes must match"),
    "unsupported_dtype": (TypeError, "dtype must be one of"),
    "cu_int64": (TypeError, "cu_seqlens_q must be int32"),
    "cu_length_mismatch": (ValueError, "B \\+ 1 entries"),
    "cu_2d": (ValueError, "shape \\(B \\+ 1,\\)"),
    "non_monotonic": (ValueError, "non-decreasing"),
    "cu_not_from_zero": (ValueError, "cu_seqlens_k\\[0\\] must be 0"),
    "cu_end_mismatch": (ValueError, "must equal the number of rows"),
    "max_seqlen_too_small": (ValueError, "max_seqlen is 5"),
    "queries_without_keys": (ValueError, "request 1 has 6 queries but no keys"),
    "q_2d": (ValueError, "must be 3-D"),
    "heads_mismatch": (ValueError, "same \\(heads, head_dim\\)"),
    "kv_shape_mismatch": (ValueError, "k and v shapes differ"),
    "head_dim_too_large": (ValueError, "head_dim must be in"),
    "last_dim_strided": (ValueError, "contiguous in its last dim"),
    "bad_scale": (ValueError, "softmax_scale"),
    "q_index_dtype": (TypeError, "q_index must be int32 or int64"),
    "q_index_out_of_range": (ValueError, "q_index values"),
    "out_wrong_shape": (ValueError, "out must be"),
    "device_mismatch": (ValueError, "cu_seqlens_k is on meta"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_invalid_inputs_raise(kind: str) -> None:
    # validate=True: on CUDA the value checks (monotonic, totals, bounds) are opt-in (a sync).
    args, kw = _bad_inputs(kind)
    exc, match = BAD[kind]
    with pytest.raises(exc, match=match):
        varlen_attention(*args, **kw, validate=True)


def test_default_validation_is_on_for_cpu_tensors() -> None:
    # validate=None reads cu_seqlens only when that costs no device sync: CPU tensors.
    args, _ = _bad_inputs("non_monotonic", "cpu")
    with pytest.raises(ValueError, match="non-decreasing"):
        varlen_attention(*args)


def test_validate_false_skips_value_checks() -> None:
    # validate=False is the no-sync path: value errors then go unnoticed (here max_seqlen_q=5 for
    # a request of 6 queries; one 16-row tile still covers it), shape and dtype errors do not.
    args, _ = _bad_inputs("max_seqlen_too_small")
    varlen_attention(*args, validate=False)
    args, _ = _bad_inputs("cu_int64")
    with pytest.raises(TypeError, match="int32"):
        varlen_attention(*args, validate=False)


# Realistic serving shapes: (name, heads, head_dim, tokens per request L, image tokens that can be
# masked, masked fractions per request). Flux's 512 text tokens are keys only.
