"""A context region on the masked path (EditRequest.context_mask, decision 0047): its tokens are
computed with the edit's prompt and its latents evolve as the full path's do, while paste-back
keeps only the mask. Float64 tiny models: a context over the whole image is full computation
exactly; a context inside the mask changes nothing; the output outside the mask is the input."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from PIL import Image

from instgenie.engine.family import load_family
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from tests.conftest import FAMILIES, make_image, make_mask, png_bytes

SIZE, STEPS = 64, 3


@functools.cache
def _pipe(family: str) -> EditPipeline:
    return EditPipeline(load_family(f"{family}:tiny", dtype="fp64"))


def _run(pipe: EditPipeline, req: EditRequest):
    state = pipe.preprocess(req)
    while not state.is_done:
        pipe.denoise_step([state])
    return state


def _setup(family: str):
    pipe = _pipe(family)
    img = png_bytes(make_image(SIZE, SIZE, seed=3))
    key = pipe.build_template(TemplateSpec(image=img, prompt="a linen shirt", seed=2,
                                           num_inference_steps=STEPS))  # fmt: skip
    edit = EditRequest(uid="e", image=img, mask=png_bytes(make_mask(SIZE, SIZE)),
                       prompt="a red cap", seed=4, num_inference_steps=STEPS,
                       paste_back=False)  # fmt: skip
    return pipe, key, edit


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / float(b.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_context_over_the_whole_image_is_full_computation(family: str) -> None:
    pipe, key, edit = _setup(family)
    full = _run(pipe, edit)
    everything = png_bytes(Image.new("L", (SIZE, SIZE), 255))
    ctx = _run(pipe, dataclasses.replace(edit, image=None, template_id=key,
                                         context_mask=everything))  # fmt: skip
    plain = _run(pipe, dataclasses.replace(edit, image=None, template_id=key))
    assert ctx.path.value == plain.path.value == "masked" and full.path.value == "full"
    assert _rel(ctx.latents, full.latents) <= 1e-9
    # without it the unmasked rows are the template's: not the full path's result
    assert _rel(plain.latents, full.latents) > 1e-4
    pipe.store.delete(key)


@pytest.mark.parametrize("family", FAMILIES)
def test_context_tokens_are_computed_and_free_and_only_the_mask_is_pasted(family: str) -> None:
    pipe, key, edit = _setup(family)
    context = make_mask(SIZE, SIZE, box=(0.0, 0.0, 0.5, 1.0))  # the left half, across the mask
    req = dataclasses.replace(edit, image=None, template_id=key, context_mask=png_bytes(context))
    plain = pipe.preprocess(dataclasses.replace(req, context_mask=None))
    state = pipe.preprocess(req)
    for L, idx in state.token_index.items():  # coarse grids may be all masked already
        assert set(plain.token_index[L].tolist()) <= set(idx.tolist())
    top = max(state.token_index)
    assert state.token_index[top].numel() > plain.token_index[top].numel()
    assert int(state.edit_mask.sum()) > int(plain.edit_mask.sum())
    for s in (plain, state):
        s.cache_handle.close()
    # pasted back: the output outside the mask is the input, context or not
    out = pipe.run([dataclasses.replace(req, paste_back=True)])[0]
    src = np.asarray(make_image(SIZE, SIZE, seed=3).convert("RGB"))
    keep = np.asarray(make_mask(SIZE, SIZE)) < 128
    assert np.array_equal(np.asarray(out.image.convert("RGB"))[keep], src[keep])
    assert out.path.value == "masked"
    pipe.store.delete(key)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_context_inside_the_mask_changes_nothing(family: str) -> None:
    pipe, key, edit = _setup(family)
    req = dataclasses.replace(edit, image=None, template_id=key)
    inner = png_bytes(make_mask(SIZE, SIZE, box=(0.3, 0.35, 0.6, 0.7)))
    a, b = _run(pipe, req), _run(pipe, dataclasses.replace(req, context_mask=inner))
    assert torch.equal(a.latents, b.latents)
    pipe.store.delete(key)
