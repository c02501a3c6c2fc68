"""Row gather-copy kernel vs its torch reference (CPU: TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from triton_kernels.row_gather import _reference, row_gather


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N, C, n", [(37, 20, 11), (64, 64, 64), (10, 300, 1), (5, 8, 0)])
def test_matches_reference_and_leaves_other_rows(dtype, N, C, n) -> None:
    g = torch.Generator().manual_seed(N * C + n)
    src = torch.randn(N, C, generator=g).to(dtype)
    idx = torch.randperm(N, generator=g)[:n].to(torch.int32)
    poison = torch.full((N, C), float("nan"), dtype=dtype)
    out = row_gather(src, idx, poison.clone())
    ref = _reference(src, idx, poison.clone())
    assert torch.equal(out.isnan(), ref.isnan())  # untouched rows stay untouched
    torch.testing.assert_close(out.nan_to_num(0), ref.nan_to_num(0), rtol=0, atol=0)


def test_strided_rows() -> None:
    big = torch.randn(12, 40)
    src, out = big[:, :24], torch.zeros(12, 40)[:, 8:32]
    idx = torch.tensor([0, 3, 11], dtype=torch.int64)
    row_gather(src, idx, out)
    torch.testing.assert_close(out[idx], src[idx])
    assert out[1].abs().sum() == 0


def test_invalid_inputs() -> None:
    a = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="equal 2-D"):
        row_gather(a, torch.tensor([0]), torch.zeros(4, 5))
    with pytest.raises(TypeError, match="dtype mismatch"):
        row_gather(a, torch.tensor([0]), a.half())
    with pytest.raises(TypeError, match="int32/int64"):
        row_gather(a, torch.tensor([0.0]), a.clone())
