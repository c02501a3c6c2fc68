"""Conv-bias Triton kernel vs torch's add_, and the Conv2d swap in diffusers UNets/VAEs (CPU:
TRITON_INTERPRET=1)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from instgenie.engine.adapters.sdxl_inpaint import SDXLInpaint
from instgenie.engine.fused_conv import BiasKernelConv2d, fuse_conv_bias
from tests.conftest import exec_at_start, swapped_unet_run, tiny_components
from triton_kernels.bias_add import (
    _MAX_BLOCK,
    add_channel_bias_,
    add_channel_bias_reference,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        (2, 3, 5, 7),  # one partial tile per plane
        (1, 4, 3 * _MAX_BLOCK // 64, 64 + 1),  # several tiles per plane, the last partial
        (3, 2, 8),  # 1-D spatial
        (2, 5, 1, 1),  # one element per plane
    ],
)
def test_matches_torch_add(shape, dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    y = (10 * torch.randn(shape, generator=g)).to(dtype)
    _check_bias_add(y, (10 * torch.randn(shape[1], generator=g)).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        (2, 3, 5, 7),  # one tile
        (1, 300, 4, 5),  # two channel tiles, the second partial
        (3, 64, 9, 9),  # several row tiles, the last partial
    ],
)
def test_channels_last_matches_torch_add(shape, dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    y = (10 * torch.randn(shape, generator=g)).to(dtype).to(memory_format=torch.channels_last)
    assert not y.is_contiguous()
    _check_bias_add(y, (10 * torch.randn(shape[1], generator=g)).to(dtype))


def _check_bias_add(y: torch.Tensor, b: torch.Tensor) -> None:
    dtype = y.dtype
    want = add_channel_bias_reference(y.clone(), b)
    got = y.clone()
    assert add_channel_bias_(got, b) is got
    if dtype == torch.bfloat16:
        # Triton's CPU interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest and
        # is bit-identical there: tests/engine/test_gpu_masked.py): at most one ulp
        ulp = 2**-7 * want.float().abs().clamp_min(2**-126)
        assert bool(((got.float() - want.float()).abs() <= ulp).all())
    else:
        assert torch.equal(got, want)  # one float32 add, one rounding: exactly torch's


def test_in_place_and_empty() -> None:
    y = torch.zeros(2, 3, 4, 4)
    out = add_channel_bias_(y, torch.tensor([1.0, 2.0, 3.0]))
    assert out.data_ptr() == y.data_ptr() and float(y[1, 2, 3, 3]) == 3.0
    assert add_channel_bias_(torch.zeros(0, 3, 4, 4), torch.ones(3)).shape == (0, 3, 4, 4)


@pytest.mark.parametrize(
    "y, b, err",
    [
        (torch.zeros(2, 3, 4, 4), torch.zeros(4), ValueError),  # bias shape
        (torch.zeros(2, 3, 4, 4).transpose(2, 3), torch.zeros(3), ValueError),  # not contiguous
        (torch.zeros(2, 3, 4, 4), torch.zeros(3, dtype=torch.float16), TypeError),  # dtypes
        (torch.zeros(3), torch.zeros(3), ValueError),  # no channel dim
    ],
)
def test_rejects_bad_input(y, b, err) -> None:
    with pytest.raises(err):
        add_channel_bias_(y, b)


# ---- the module swap ----------------------------------------------------------------------------


def _swapped(model) -> list[BiasKernelConv2d]:
    return [m for m in model.modules() if isinstance(m, BiasKernelConv2d)]


def test_swap_keeps_parameters_and_counts(unet_pair) -> None:
    stock, fused = unet_pair
    keys = {k: v.data_ptr() for k, v in fused.state_dict().items()}
    biased = sum(type(m) is nn.Conv2d and m.bias is not None for m in fused.modules())
    assert biased > 0
    assert fuse_conv_bias(fused) == biased == len(_swapped(fused))
    assert {k: v.data_ptr() for k, v in fused.state_dict().items()} == keys  # same tensors
    assert fuse_conv_bias(fused) == 0  # idempotent
    for a, b in zip(stock.modules(), fused.modules(), strict=True):
        if isinstance(a, nn.Conv2d):  # same geometry
            assert (a.stride, a.padding, a.kernel_size, a.groups) == (
                b.stride, b.padding, b.kernel_size, b.groups
            )  # fmt: skip


def test_swap_off_is_bit_identical_to_stock(unet_pair) -> None:
    got, want, calls = swapped_unet_run(unet_pair, fuse_conv_bias, BiasKernelConv2d, "off")
    assert torch.equal(got, want)
    assert set(calls) == {0}


def test_swap_on_runs_the_kernel_everywhere(unet_pair) -> None:
    got, want, calls = swapped_unet_run(unet_pair, fuse_conv_bias, BiasKernelConv2d, "on", 1)
    assert set(calls) == {1}
    # CPU convolutions add the bias inside the GEMM (one rounding fewer): float32 noise only
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_vae_swap_and_channels_last() -> None:
    vae = tiny_components(SDXLInpaint)["vae"].eval()
    fused = copy.deepcopy(vae)
    assert fuse_conv_bias(fused, "on") > 0
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        lat = vae.encode(x).latent_dist.mode()
        want = vae.decode(lat).sample
        got = fused.decode(lat).sample
        conv = fused.decoder.conv_in
        calls = conv.kernel_calls
        nhwc = conv(lat.to(memory_format=torch.channels_last))  # the channels_last kernel
        assert conv.kernel_calls == calls + 1
        assert nhwc.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(nhwc, vae.decoder.conv_in(lat), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_families_install_it() -> None:
    from tests.conftest import tiny_pipeline

    for family in ("sd2-inpaint", "sdxl-inpaint", "flux-fill"):
        fam = tiny_pipeline(family).family
        assert _swapped(fam.vae)
        if family != "flux-fill":  # Flux's transformer has no convolutions
            assert _swapped(fam.unet)


def test_env_flag(monkeypatch) -> None:
    """INSTGENIE_FUSED_CONV_BIAS sets ExecConfig.fused_conv_bias in a config built at start."""
    monkeypatch.setenv("INSTGENIE_FUSED_CONV_BIAS", "OFF")
    assert exec_at_start().fused_conv_bias == "off"
    monkeypatch.delenv("INSTGENIE_FUSED_CONV_BIAS")
    assert exec_at_start().fused_conv_bias == "auto"
    monkeypatch.setenv("INSTGENIE_FUSED_CONV_BIAS", "yes")
    with pytest.raises(ValueError, match="INSTGENIE_FUSED_CONV_BIAS"):
        exec_at_start()
