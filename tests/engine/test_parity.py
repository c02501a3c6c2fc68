"""The split pipeline reproduces the matching diffusers pipeline's image for the same seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instgenie.engine.request import EditRequest
from tests.conftest import make_image, make_mask, png_bytes, tiny_pipeline


def reference_image(family: str, req: EditRequest, image, mask):
    """Run diffusers' own pipeline __call__ over the same modules (fresh scheduler)."""
    pipe = tiny_pipeline(family).family.pipe
    comps = dict(pipe.components)
    comps["scheduler"] = type(pipe.scheduler).from_config(pipe.scheduler.config)
    extra = {}
    if family == "flux-fill":
        extra["max_sequence_length"] = tiny_pipeline(family).family.text_len
    else:
        extra["negative_prompt"] = req.negative_prompt
    kwargs = {k: v for k, v in type(tiny_pipeline(family).family).pipeline_kwargs.items()
              if k not in comps}  # fmt: skip
    ref_pipe = type(pipe)(**comps, **kwargs)
    ref_pipe.set_progress_bar_config(disable=True)
    out = ref_pipe(
        prompt=req.prompt,
        image=image,
        mask_image=mask,
        height=image.size[1],
        width=image.size[0],
        num_inference_steps=req.num_inference_steps,
        guidance_scale=req.guidance_scale,
        strength=req.strength,
        generator=torch.Generator("cpu").manual_seed(req.seed),
        output_type="np",
        **extra,
    )
    return out.images[0]


@pytest.mark.parametrize("strength", [1.0, 0.75])
def test_matches_diffusers(family: str, strength: float) -> None:
    image, mask = make_image(128, 96, seed=3), make_mask(128, 96)
    guidance = 30.0 if family == "flux-fill" else 6.0
    req = EditRequest(
        uid="p",
        image=png_bytes(image),
        mask=png_bytes(mask),
        prompt="a red silk dress, studio photo",
        negative_prompt=None if family == "flux-fill" else "blurry",
        seed=1234,
        num_inference_steps=6,
        guidance_scale=guidance,
        strength=strength,
        paste_back=False,
    )
    ours = np.asarray(tiny_pipeline(family).run([req])[0].image).astype(np.int16)
    ref = (reference_image(family, req, image, mask) * 255).round().astype(np.int16)
    assert ours.shape == ref.shape
    # within 1/255 per pixel (the u8 rounding of identical floats can differ by one level)
    assert np.abs(ours - ref).max() <= 1, np.abs(ours - ref).max()
