"""The compute margin (ModelConfig.compute_margin, decision 0050): a masked edit also computes the
tokens within that many pixels of its mask, under its own prompt, and paste-back still keeps only
the mask. Tiny models, float64, CPU; the router's numpy measurement against the worker's masks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from instgenie.cli import build_parser
from instgenie.config import ModelConfig
from instgenie.engine.costspec import cost_spec
from instgenie.engine.imageio import encode_image
from instgenie.engine.masked.tokens import dilate, pixel_mask_tensor, pooled_masks
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.errors import ValidationError
from instgenie.scheduler import estimate
from instgenie.server.commands import cmd_serve
from instgenie.server.uploads import mask_facts
from tests.conftest import make_image, png_bytes
from tests.engine.test_masked_exact import MASKS, STEPS, _close, _full, _run, fp64_pipeline


def _with_margin(family: str, margin: int) -> EditPipeline:
    """A pipeline of its own store on the shared float64 tiny model."""
    return EditPipeline(fp64_pipeline(family).family, compute_margin=margin)


def _edit(pipe: EditPipeline, seed: int = 3) -> tuple[bytes, EditRequest]:
    """A template captured with another prompt and seed (its cache is not the edit's), and an
    edit of its rect mask on it."""
    img = png_bytes(make_image(128, 128, seed=2))
    key = pipe.build_template(
        TemplateSpec(image=img, prompt="x", seed=99, num_inference_steps=STEPS)
    )
    return img, EditRequest(uid="m", image=None, template_id=key, mask=png_bytes(MASKS["rect"]),
                            prompt="a blue coat", seed=seed, num_inference_steps=STEPS)  # fmt: skip


@pytest.mark.parametrize("mask", [(0, 0), (37, 53), (64, 64)])
@pytest.mark.parametrize("margin", [0, 1, 2, 5, 16])
def test_worker_and_router_dilate_alike(mask: tuple[int, int], margin: int) -> None:
    rng = np.random.default_rng(margin * 7 + mask[0])
    h, w = mask if mask != (0, 0) else (31, 17)
    m = rng.random((h, w)) < 0.03
    m[h // 2, -1] = True  # an edge pixel: the square is clipped at the border
    worker = dilate(torch.from_numpy(m).float()[None, None], margin)[0, 0] > 0
    router = estimate.dilate(m, margin)
    assert np.array_equal(worker.numpy(), router)
    assert router.sum() >= m.sum() and (margin == 0) == (router.sum() == m.sum())


@pytest.mark.parametrize("margin", [0, 3, 8, 20])
def test_computed_tokens_are_what_the_router_prices(family: str, margin: int) -> None:
    pipe = _with_margin(family, margin)
    img, edit = _edit(pipe)
    state = pipe.preprocess(edit)
    assert state.path == "masked"
    spec = cost_spec(pipe)
    assert spec.compute_margin == margin
    strides = sorted({b.stride for b in spec.blocks})
    mask = np.asarray(MASKS["rect"]) >= 128
    ratios = estimate.token_ratios(mask, strides, margin)
    for s in strides:
        L = (128 // s) ** 2
        assert state.token_index[L].numel() == round(ratios[s] * L), (s, margin)
    # the router's measurement of the encoded mask, as the server takes it
    _, served = mask_facts(encode_image(MASKS["rect"], "png"), (128, 128), (128, 128),
                           pipe.limits, strides, margin)  # fmt: skip
    assert served == ratios
    plain = pooled_masks(pixel_mask_tensor(MASKS["rect"]), strides[0], len(strides))
    computed = sum(state.token_index[L].numel() for L in plain)
    assert (computed > sum(int(v.sum()) for v in plain.values())) == (margin > 0)


def test_a_margin_over_the_image_computes_every_token_and_equals_full(family: str) -> None:
    """Nothing is read from the (foreign) cache once the margin covers the image: the edit equals
    its own full computation; with no margin it does not."""
    pipe = _with_margin(family, 128)
    img, edit = _edit(pipe)
    masked = pipe.preprocess(edit)
    assert all(idx.numel() == L for L, idx in masked.token_index.items())
    _run(pipe, masked)
    full = _full(pipe, dataclasses.replace(edit, uid="f", image=img, template_id=None))
    _close(masked.latents, full.latents)
    plain = _with_margin(family, 0)
    _, edit0 = _edit(plain)
    zero = _run(plain, plain.preprocess(edit0))
    assert float((zero.latents - full.latents).abs().max()) > 1e-3


def test_a_margin_moves_the_edit_toward_full_and_paste_back_keeps_only_the_mask() -> None:
    family = "sdxl-inpaint"
    template = make_image(128, 128, seed=2)
    img = np.asarray(template.convert("RGB"))
    keep = np.asarray(MASKS["rect"]) < 128
    full = None
    errors = {}
    for margin in (0, 16):
        pipe = _with_margin(family, margin)
        _, edit = _edit(pipe)
        if full is None:
            full_req = dataclasses.replace(edit, uid="f", image=png_bytes(template),
                                           template_id=None)  # fmt: skip
            full = np.asarray(pipe.run([full_req])[0].image.convert("RGB"), np.float64)
        out = np.asarray(pipe.run([edit])[0].image.convert("RGB"))
        assert np.array_equal(out[keep], img[keep])  # pasted back: outside the mask = input
        errors[margin] = float(np.abs(out - full)[~keep].mean())
    assert errors[16] < errors[0], errors


def test_a_negative_margin_is_refused() -> None:
    with pytest.raises(ValueError, match="compute_margin"):
        ModelConfig(compute_margin=-1)
    # `instgenie serve --compute-margin -1`: a typed error naming the setting, before any worker
    with pytest.raises(ValidationError, match="compute_margin"):
        cmd_serve(build_parser().parse_args(["serve", "--compute-margin", "-1"]))
    with pytest.raises(ValueError, match="compute_margin"):
        _with_margin("sdxl-inpaint", -2)
    with pytest.raises(ValueError, match="margin"):
        dilate(torch.zeros(1, 1, 4, 4), -1)
