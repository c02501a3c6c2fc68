"""Fused RMSNorm + RoPE + scatter kernel vs its torch reference and vs diffusers' own modules
(CPU: TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

from triton_kernels.rmsnorm_rope import rmsnorm_rope, rmsnorm_rope_reference

#: tolerance relative to the largest output: float32 1e-5 (operation order); 16-bit two units of
#: the output dtype — the kernel's float32 1/sqrt may differ from torch.rsqrt in the last bit,
#: which can flip the rounding of the normalised value to 16 bits (one unit), and the rotation
#: adds two such values
ULP = {torch.float32: 1e-5, torch.float16: 2 * 2**-10, torch.bfloat16: 2 * 2**-7}


def _tables(P: int, D: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.rand(P, D // 2, generator=g) * 6.28
    return angle.cos().repeat_interleave(2, 1), angle.sin().repeat_interleave(2, 1)


@pytest.mark.parametrize("style", ["torch", "diffusers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N, H, D, scatter", [(37, 3, 16, True), (16, 2, 128, False),
                                              (5, 1, 24, True), (0, 2, 16, True)])  # fmt: skip
def test_matches_the_modules(style, dtype, N, H, D, scatter) -> None:
    """torch.nn.RMSNorm (Flux's attention) or diffusers' RMSNorm, then diffusers' RoPE."""
    g = torch.Generator().manual_seed(N * H + D)
    x = (3 * torch.randn(N, H, D, generator=g)).to(dtype)
    diffusers = style == "diffusers"
    norm = (DiffusersRMSNorm(D, eps=1e-6) if diffusers else torch.nn.RMSNorm(D, eps=1e-6)).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=g))
    cos, sin = _tables(50, D, g)
    pos = torch.randint(0, 50, (N,), generator=g)
    M = N + 7
    dst = torch.randperm(M, generator=g)[:N] if scatter else None
    out = torch.full((M, H, D), float("nan"), dtype=dtype)
    rmsnorm_rope(x, norm.weight.detach(), norm.eps, cos, sin, pos, out, dst, diffusers)
    rows = dst if scatter else torch.arange(N)
    if N == 0:
        assert out.isnan().all()
        return
    # diffusers: RMSNorm, then apply_rotary_emb with the rows' own table entries
    with torch.no_grad():
        want = apply_rotary_emb(norm(x)[None], (cos[pos], sin[pos]), sequence_dim=1)[0]
    tol = ULP[dtype] * float(want.abs().max())
    torch.testing.assert_close(out[rows].float(), want.float(), rtol=0, atol=tol)
    untouched = torch.ones(M, dtype=torch.bool)
    untouched[rows] = False
    assert out[untouched].isnan().all()  # rows not listed in dst stay untouched
    ref = rmsnorm_rope_reference(x, norm.weight.detach(), norm.eps, cos, sin, pos,
                                 torch.zeros_like(out), dst, diffusers)  # fmt: skip
    torch.testing.assert_close(ref[rows], want, rtol=0, atol=0)


def test_strided_views() -> None:
    """x a head slice of a wider projection, out the key part of a joint sequence buffer."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(10, 4, 32, generator=g)
    x = wide[:, 1:3]  # (10, 2, 32), strided heads
    joint = torch.zeros(2, 9, 2, 32)  # (rows, text 4 + image 5, H, D)
    out = joint.view(18, 2, 32)
    dst = torch.tensor([4, 5, 6, 7, 8, 13, 14, 15, 16, 17])
    w = torch.rand(32, generator=g) + 0.5
    cos, sin = _tables(9, 32, g)
    pos = torch.tensor([4, 5, 6, 7, 8] * 2)
    rmsnorm_rope(x, w, 1e-6, cos, sin, pos, out, dst)
    want = rmsnorm_rope_reference(
        x.contiguous(), w, 1e-6, cos, sin, pos, torch.zeros(18, 2, 32), dst
    )
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    assert joint[:, :4].abs().sum() == 0


def test_invalid_inputs() -> None:
    x, out = torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)
    cos = sin = torch.zeros(3, 8)
    pos, w = torch.zeros(4, dtype=torch.int64), torch.ones(8)
    with pytest.raises(ValueError, match="must agree"):
        rmsnorm_rope(x, w, 1e-6, cos, sin, pos, torch.zeros(4, 2, 6))
    with pytest.raises(ValueError, match="even"):
        rmsnorm_rope(torch.zeros(4, 2, 7), torch.ones(7), 1e-6, cos, sin, pos, torch.zeros(4, 2, 7))
    with pytest.raises(TypeError, match="dtype"):
        rmsnorm_rope(x, w, 1e-6, cos, sin, pos, out.half())
    with pytest.raises(ValueError, match="float32"):
        rmsnorm_rope(x, w, 1e-6, cos.half(), sin, pos, out)
    with pytest.raises(ValueError, match="pos must be"):
        rmsnorm_rope(x, w, 1e-6, cos, sin, pos[:3], out)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_rope(x, torch.ones(4), 1e-6, cos, sin, pos, out)


@pytest.mark.parametrize("mask_box", [(0.2, 0.3, 0.6, 0.7), (0.0, 0.0, 1.0, 1.0)])
def test_masked_flux_step_with_fused_norm_rope(mask_box, monkeypatch) -> None:
    """The masked Flux blocks with the fused kernel (interpreted here) equal the torch ops."""
    from instgenie.engine.masked import flux_blocks
    from instgenie.engine.pipeline import EditPipeline
    from instgenie.engine.request import EditRequest
    from instgenie.engine.templates import TemplateSpec
    from tests.conftest import make_image, make_mask, png_bytes

    pipe = EditPipeline.load("flux-fill:tiny")
    img = png_bytes(make_image(128, 128, seed=1))
    key = pipe.build_template(TemplateSpec(image=img, prompt="a coat", num_inference_steps=2))
    mask = png_bytes(make_mask(128, 128, mask_box))
    req = EditRequest(uid="e", image=None, template_id=key, prompt="a scarf", seed=3, mask=mask,
                      num_inference_steps=2)  # fmt: skip
    calls = []

    def counting(*args):
        calls.append(args[0].shape)
        return rmsnorm_rope(*args)

    monkeypatch.setattr(flux_blocks, "_fused_kernel", lambda: counting)
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(flux_blocks, "FUSED_ROPE", mode)
        state = pipe.preprocess(req)
        assert state.path == "masked"
        while not state.is_done:
            pipe.denoise_step([state])
        out[mode] = state.latents
    ex = pipe.family.masked
    dual = sum(1 for b in ex.blocks if b.kind == "flux_dual")
    assert len(calls) == 2 * (4 * dual + 2 * (ex.num_blocks - dual))  # q, k of each block, 2 steps
    scale = float(out["off"].abs().max())
    assert float((out["on"] - out["off"]).abs().max()) <= 1e-5 * scale
