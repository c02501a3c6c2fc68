"""GEGLU gating Triton kernel vs torch, and the module swap in diffusers UNets (CPU:
TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.activations import GEGLU

from instgenie.engine.fused_geglu import FusedGEGLU, fuse_geglu
from tests.conftest import exec_at_start, swapped_unet_run
from triton_kernels.geglu import _MAX_BLOCK, geglu, geglu_reference

#: relative to the largest |output|: the output rounding (half an ulp), plus erf's last float32
#: ulp, which can flip the rounding of gelu (the float32 bound also covers 1 + erf(x)'s
#: cancellation for large negative gates, where gelu is ~0). bfloat16: Triton's CPU interpreter
#: truncates float32 -> bfloat16 (the GPU rounds to nearest): up to one ulp per rounding, two
#: roundings.
TOL = {torch.float32: 1e-6, torch.float16: 2**-11, torch.bfloat16: 2 * 2**-7}


def _exact(p: torch.Tensor) -> torch.Tensor:
    """float64 ground truth with torch's two roundings: gelu to p's dtype, then the product."""
    h, gate = p.double().chunk(2, dim=-1)
    gl = torch.nn.functional.gelu(gate).to(p.dtype).double()
    return h * gl


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        (3, 7, 2 * 37),  # 3-D, one partial block per row
        (5, 2 * (2 * _MAX_BLOCK + 300)),  # three blocks per row, the last partial
        (2, 2 * _MAX_BLOCK),  # whole blocks only
        (4, 2),  # one element per half
    ],
)
def test_matches_torch(shape, dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    p = (4 * torch.randn(shape, generator=g)).to(dtype)  # gates far into both gelu tails
    out = geglu(p)
    assert out.dtype == dtype and out.shape == (*shape[:-1], shape[-1] // 2)
    want = _exact(p)
    scale = float(want.abs().max())
    err = float((out.double() - want).abs().max())
    assert err <= TOL[dtype] * scale, (err, scale)
    # and against torch's own ops (what runs without the kernel)
    ref = geglu_reference(p).double()
    assert float((out.double() - ref).abs().max()) <= 2 * TOL[dtype] * scale


def test_halves_are_not_swapped() -> None:
    """h multiplies gelu(gate), not the other way round: with h = 1, out = gelu(gate)."""
    gate = torch.linspace(-3, 3, 16)
    p = torch.cat([torch.ones(16), gate]).reshape(1, 32)
    torch.testing.assert_close(geglu(p)[0], torch.nn.functional.gelu(gate), rtol=1e-6, atol=1e-6)


def test_empty() -> None:
    assert geglu(torch.zeros(0, 8)).shape == (0, 4)
    assert geglu(torch.zeros(3, 0)).shape == (3, 0)


@pytest.mark.parametrize(
    "p, err",
    [
        (torch.zeros(2, 5), ValueError),  # odd last dim
        (torch.zeros(8, 4).t(), ValueError),  # not contiguous
        (torch.zeros(2, 4, dtype=torch.int32), TypeError),
    ],
)
def test_rejects_bad_input(p, err) -> None:
    with pytest.raises(err):
        geglu(p)


# ---- the module swap ----------------------------------------------------------------------------


def _swapped(model) -> list[FusedGEGLU]:
    return [m for m in model.modules() if isinstance(m, FusedGEGLU)]


def test_swap_keeps_parameters_and_counts(unet_pair) -> None:
    stock, fused = unet_pair
    keys = {k: v.data_ptr() for k, v in fused.state_dict().items()}
    n_geglu = sum(type(m) is GEGLU for m in fused.modules())
    blocks = sum(type(m).__name__ == "BasicTransformerBlock" for m in fused.modules())
    assert n_geglu == blocks > 0  # one per feed-forward
    assert fuse_geglu(fused) == n_geglu == len(_swapped(fused))
    assert {k: v.data_ptr() for k, v in fused.state_dict().items()} == keys  # same tensors
    assert not any(type(m) is GEGLU for m in fused.modules())
    assert fuse_geglu(fused) == 0  # idempotent


def test_swap_off_is_bit_identical_to_stock(unet_pair) -> None:
    got, want, calls = swapped_unet_run(unet_pair, fuse_geglu, FusedGEGLU, "off")
    assert torch.equal(got, want)
    assert set(calls) == {0}


def test_swap_on_runs_the_kernel_everywhere(unet_pair) -> None:
    got, want, calls = swapped_unet_run(unet_pair, fuse_geglu, FusedGEGLU, "on", 1)
    assert set(calls) == {1}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_non_contiguous_projection_falls_back() -> None:
    """A projection output the kernel cannot read (here: a transposed Linear output, by a
    forward hook) runs torch's ops instead of failing."""
    geglu_mod = FusedGEGLU(GEGLU(6, 4), mode="on")
    geglu_mod.proj.register_forward_hook(lambda m, a, out: out.transpose(0, 1).contiguous().t())
    x = torch.randn(5, 6)
    with torch.no_grad():
        p = geglu_mod.proj(x)
        assert not p.is_contiguous()
        out = geglu_mod(x)
    assert geglu_mod.kernel_calls == 0
    torch.testing.assert_close(out, geglu_reference(p))


def test_families_install_it() -> None:
    """The UNet families' backbones carry the swapped module (auto: torch ops on CPU)."""
    from tests.conftest import tiny_pipeline

    for family in ("sd2-inpaint", "sdxl-inpaint"):
        assert _swapped(tiny_pipeline(family).family.unet)


def test_env_flag(monkeypatch) -> None:
    """INSTGENIE_FUSED_GEGLU sets ExecConfig.fused_geglu in a config built at start."""
    monkeypatch.setenv("INSTGENIE_FUSED_GEGLU", " Off")
    assert exec_at_start().fused_geglu == "off"
    monkeypatch.delenv("INSTGENIE_FUSED_GEGLU")
    assert exec_at_start().fused_geglu == "auto"
    monkeypatch.setenv("INSTGENIE_FUSED_GEGLU", "1")
    with pytest.raises(ValueError, match="INSTGENIE_FUSED_GEGLU"):
        exec_at_start()
