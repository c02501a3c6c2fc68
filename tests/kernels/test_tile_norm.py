"""Sparse-conv tile kernel (triton_kernels/tile_norm.py) against its torch reference (CPU:
TRITON_INTERPRET=1), and a sparse ResNet forward through the kernel against the stock one."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.resnet import ResnetBlock2D

from instgenie.engine.fused_norms import fuse_group_norms
from instgenie.engine.masked import sparse_convs as sc
from instgenie.engine.masked.tiles import build_tiles
from triton_kernels.tile_norm import _BLOCK_C, _BLOCK_P, tile_norm, tile_norm_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gathered", [True, False])
@pytest.mark.parametrize("silu", [True, False])
def test_matches_reference(dtype: torch.dtype, gathered: bool, silu: bool) -> None:
    g = torch.Generator().manual_seed(int(gathered) + 2 * int(silu))
    C, R, P, n = _BLOCK_C + 24, 3, 36, 5  # C and M = n * P not multiples of the blocks
    assert (n * P) % _BLOCK_P
    x = (torch.randn(200, C, generator=g) * 4 + 2).to(dtype)
    idx = torch.randint(0, 200, (n * P,), generator=g) if gathered else None
    if not gathered:
        x = x[: n * P].contiguous()
    valid = torch.rand(n * P, generator=g) > 0.3  # invalid: zero padding
    tile_row = torch.randint(0, R, (n,), generator=g)
    scale, shift = torch.rand(R, C, generator=g) + 0.1, torch.randn(R, C, generator=g)
    got = tile_norm(x, idx, valid, tile_row, P, scale, shift, silu)
    want = tile_norm_reference(x, idx, valid, tile_row, P, scale, shift, silu)
    assert got.dtype == dtype and got.shape == (n * P, C)
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_rejects_bad_layouts() -> None:
    x = torch.randn(8, 4)
    ok = (torch.ones(4, dtype=torch.bool), torch.zeros(1, dtype=torch.int64), 4,
          torch.ones(1, 4), torch.zeros(1, 4), True)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous"):
        tile_norm(x.t().contiguous().t(), None, *ok)
    with pytest.raises(TypeError, match="float32"):
        tile_norm(x, None, *ok[:3], ok[3].double(), ok[4], True)
    with pytest.raises(ValueError, match="positions"):
        tile_norm(x, None, ok[0], ok[1], 3, *ok[3:])


@pytest.mark.parametrize("hw", [(16, 16), (11, 9)])
def test_sparse_resnet_through_the_kernel(hw: tuple[int, int]) -> None:
    """The ResNet's tile forward with the kernel (fused GroupNorm switch "on") equals the stock
    forward at the masked tokens within float32 rounding (borders and odd sizes included)."""
    torch.manual_seed(0)
    block = ResnetBlock2D(in_channels=8, out_channels=16, temb_channels=6, groups=4)
    fuse_group_norms(block, mode="on")
    x, temb = torch.randn(2, 8, *hw), torch.randn(2, 6)
    x = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        y, stats = sc.resnet_dense(block, x, temb)
        L = hw[0] * hw[1]
        ts = build_tiles("resnet", hw, [(0, torch.arange(0, L, 3)), (1, torch.tensor([0, L - 1]))])
        calls = block.norm1.kernel_calls
        tiles = sc.resnet_tiles(block, x, temb, ts, stats)
    out = torch.zeros(2 * L, 16)
    sc.scatter_tiles(out, tiles, ts)
    want = y.permute(0, 2, 3, 1).reshape(-1, 16)
    torch.testing.assert_close(out[ts.dst], want[ts.dst], rtol=1e-4, atol=1e-4)
    assert sc._tile_norm(block.norm1, x).__name__ == "tile_norm" and calls > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_tile_norm_compiled(dtype: torch.dtype) -> None:
    """The compiled sparse-conv tile kernel against its torch reference at an SDXL level-0
    shape (320 channels, 8x8 tiles with a 2-wide halo)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    C, R, P, n = 320, 2, 144, 300
    x = (torch.randn(2 * 128 * 128, C, generator=g, device="cuda") * 3 + 1).to(dtype)
    idx = torch.randint(0, x.shape[0], (n * P,), generator=g, device="cuda")
    valid = torch.rand(n * P, generator=g, device="cuda") > 0.1
    rows = torch.randint(0, R, (n,), generator=g, device="cuda")
    scale = torch.rand(R, C, generator=g, device="cuda") + 0.1
    shift = torch.randn(R, C, generator=g, device="cuda")
    for silu in (True, False):
        got = tile_norm(x, idx, valid, rows, P, scale, shift, silu)
        want = tile_norm_reference(x, idx, valid, rows, P, scale, shift, silu)
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
