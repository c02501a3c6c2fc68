"""GroupNorm (+ SiLU) Triton kernel vs exact values and torch, and the module swap in diffusers
UNets/VAEs (CPU: TRITON_INTERPRET=1)."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers.models.resnet import ResnetBlock2D

from instgenie.engine.adapters.sdxl_inpaint import SDXLInpaint
from instgenie.engine.fused_norms import FusedGroupNorm, fuse_group_norms
from tests.conftest import exec_at_start, set_kernel_mode, swapped_unet_run, tiny_components
from triton_kernels.group_norm import _BLOCK, group_norm, group_norm_reference

#: one rounding of the output dtype, relative to the largest |output| (the kernel rounds once;
#: torch rounds the normalised value and then SiLU's result: that is the error being bounded)
TOL = {torch.float32: 2e-6, torch.float16: 2 * 2**-11, torch.bfloat16: 2 * 2**-8}


def _exact(x, groups, w, b, eps, silu):
    """float64 ground truth."""
    return group_norm_reference(
        x.double(), groups, None if w is None else w.double(), None if b is None else b.double(),
        eps, silu,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, groups, silu, affine",
    [
        ((2, 64, 9, 7), 32, True, True),  # several groups, one partial tile each
        ((1, 8, 33, 65), 2, False, True),  # 4 * 2145 = 8580 elements: 3 tiles, the last partial
        ((3, 16, 5), 4, True, False),  # 1-D spatial, no weight/bias
        ((2, 6, 1, 1), 3, True, True),  # 2 elements per group
        ((2, 6, 1, 1), 6, True, True),  # 1 element per group: y = bias
        ((1, 4, 2 * _BLOCK), 1, False, True),  # whole tiles only
    ],
)
def test_matches_exact_group_norm(shape, groups, silu, affine, dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    # a large common offset: variance from sums of squares would cancel catastrophically
    x = (3 * torch.randn(shape, generator=g) + 40).to(dtype)
    C = shape[1]
    w = (1 + 0.5 * torch.randn(C, generator=g)).to(dtype) if affine else None
    b = torch.randn(C, generator=g).to(dtype) if affine else None
    y = group_norm(x, groups, w, b, 1e-5, silu)
    assert y.dtype == dtype and y.shape == x.shape
    want = _exact(x, groups, w, b, 1e-5, silu)
    # one output rounding, plus float32 cancellation in x - mean: a unit of x's magnitude,
    # scaled by the largest 1/std (tiny groups of near-equal values are ill-conditioned)
    xd = x.double().reshape(shape[0], groups, -1)
    rstd = float((xd.var(-1, unbiased=False) + 1e-5).rsqrt().max())
    wmax = 1.0 if w is None else float(w.double().abs().max())
    tol = TOL[dtype] * float(want.abs().max()) + 4 * 2**-23 * float(xd.abs().max()) * rstd * wmax
    torch.testing.assert_close(y.double(), want, rtol=0, atol=tol)
    # and no worse than torch's own two modules, give or take one rounding
    torch_err = (group_norm_reference(x, groups, w, b, 1e-5, silu).double() - want).abs().max()
    assert float((y.double() - want).abs().max()) <= float(torch_err) + tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("silu", [False, True])
def test_channels_last_input(dtype, silu) -> None:
    """A 4-D channels_last tensor is normalised in its own layout: the values of its contiguous
    copy, in the same memory format."""
    g = torch.Generator().manual_seed(3)
    x = (2 * torch.randn(2, 12, 70, 9, generator=g) + 1).to(dtype)  # 3 * 630 = 1890 per group
    w, b = torch.randn(12, generator=g).to(dtype), torch.randn(12, generator=g).to(dtype)
    xl = x.to(memory_format=torch.channels_last)
    assert not xl.is_contiguous()
    y = group_norm(xl, 4, w, b, 1e-5, silu)
    assert y.is_contiguous(memory_format=torch.channels_last)
    # the same statistics up to float32 summation order (tiles hold other elements)
    want = group_norm(x, 4, w, b, 1e-5, silu)
    torch.testing.assert_close(
        y.contiguous(), want, rtol=0, atol=TOL[dtype] * float(want.abs().max())
    )


def test_statistics_per_group_are_independent() -> None:
    """Each (sample, group) is normalised with its own statistics: groups with very different
    scales and offsets in one tensor."""
    x = torch.randn(2, 4, 50, 50)
    x[0, :2] = x[0, :2] * 100 + 7
    x[1, 2:] = x[1, 2:] * 1e-2 - 3
    y = group_norm(x, 2, None, None, 1e-10)
    for n in range(2):
        for grp in range(2):
            part = y[n, 2 * grp : 2 * grp + 2].double()
            assert abs(float(part.mean())) < 1e-4
            assert abs(float(part.var(unbiased=False)) - 1) < 1e-3


def test_empty_batch() -> None:
    assert group_norm(torch.zeros(0, 4, 3, 3), 2, None, None, 1e-5).shape == (0, 4, 3, 3)


@pytest.mark.parametrize(
    "x, groups, w, err",
    [
        (torch.zeros(2, 6, 4, 4), 4, None, ValueError),  # 6 channels, 4 groups
        (torch.zeros(2, 4, 4, 4).transpose(2, 3), 2, None, ValueError),  # not contiguous
        (torch.zeros(2, 4, 4, 4, dtype=torch.int32), 2, None, TypeError),
        (torch.zeros(2, 4, 4, 4), 2, torch.ones(3), ValueError),  # weight shape
        (torch.zeros(4), 2, None, ValueError),  # no channel dim
    ],
)
def test_rejects_bad_input(x, groups, w, err) -> None:
    with pytest.raises(err):
        group_norm(x, groups, w, None, 1e-5)


# ---- the module swap ----------------------------------------------------------------------------


def _swapped(model) -> list[FusedGroupNorm]:
    return [m for m in model.modules() if isinstance(m, FusedGroupNorm)]


def test_swap_keeps_parameters_and_counts(unet_pair) -> None:
    stock, fused = unet_pair
    keys = {k: v.data_ptr() for k, v in fused.state_dict().items()}
    n = fuse_group_norms(fused)
    resnets = [m for m in fused.modules() if isinstance(m, ResnetBlock2D)]
    norms = _swapped(fused)
    # two per ResNet, one per Transformer2DModel, conv_norm_out
    transformers = sum(type(m).__name__ == "Transformer2DModel" for m in fused.modules())
    assert n == len(norms) == 2 * len(resnets) + transformers + 1
    assert {k: v.data_ptr() for k, v in fused.state_dict().items()} == keys  # same tensors
    assert all(isinstance(r.nonlinearity, torch.nn.Identity) for r in resnets)
    assert type(fused.conv_act) is torch.nn.Identity
    assert sum(isinstance(m, torch.nn.GroupNorm) and not isinstance(m, FusedGroupNorm)
               for m in fused.modules()) == 0  # fmt: skip
    assert fuse_group_norms(fused) == 0  # idempotent: nothing left to swap


def test_swap_off_is_bit_identical_to_stock(unet_pair) -> None:
    """Mode off runs torch's ops: the swapped UNet equals stock diffusers bit for bit (this also
    checks that the time embedding still goes through SiLU, via the pre-hook)."""
    got, want, calls = swapped_unet_run(unet_pair, fuse_group_norms, FusedGroupNorm, "off")
    assert torch.equal(got, want)
    assert set(calls) == {0}


def test_swap_on_runs_the_kernel_everywhere(unet_pair) -> None:
    got, want, calls = swapped_unet_run(unet_pair, fuse_group_norms, FusedGroupNorm, "on", 1)
    assert set(calls) == {1}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_vae_swap() -> None:
    vae = tiny_components(SDXLInpaint)["vae"].eval()
    fused = copy.deepcopy(vae)
    assert fuse_group_norms(fused) > 0
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        lat = vae.encode(x).latent_dist.mode()
        want = vae.decode(lat).sample
        set_kernel_mode(fused, FusedGroupNorm, "off")
        assert torch.equal(fused.decode(lat).sample, want)
        assert torch.equal(fused.encode(x).latent_dist.mode(), lat)
        set_kernel_mode(fused, FusedGroupNorm, "on")
        got = fused.decode(lat).sample
    calls = {n: m.kernel_calls for n, m in fused.decoder.named_modules()
             if isinstance(m, FusedGroupNorm)}  # fmt: skip
    # mid-block + up-block ResNets, conv_norm_out; after the mid-block attention the ResNets get
    # channels_last tensors, which the kernel reads in place
    assert len(calls) == 2 * 2 + 3 * 2 * 2 + 1
    assert all(c == 1 for c in calls.values()), calls
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_families_install_it() -> None:
    """Every UNet family's pipeline runs with the swapped modules (auto: torch ops on CPU)."""
    from tests.conftest import tiny_pipeline

    for family in ("sd2-inpaint", "sdxl-inpaint"):
        fam = tiny_pipeline(family).family
        assert _swapped(fam.unet) and _swapped(fam.vae)


def test_env_flag(monkeypatch) -> None:
    """INSTGENIE_FUSED_GROUPNORM sets ExecConfig.fused_group_norm in a config built at start."""
    monkeypatch.setenv("INSTGENIE_FUSED_GROUPNORM", " OFF ")
    assert exec_at_start().fused_group_norm == "off"
    monkeypatch.delenv("INSTGENIE_FUSED_GROUPNORM")
    assert exec_at_start().fused_group_norm == "auto"
    monkeypatch.setenv("INSTGENIE_FUSED_GROUPNORM", "fast")
    with pytest.raises(ValueError, match="INSTGENIE_FUSED_GROUPNORM"):
        exec_at_start()
