"""Replay exactness of mask-aware execution (tiny models, float64, CPU).

The cache of a template is exact for a request with the template's own inputs; then computing
only the masked tokens and taking every other row from the cache must reproduce full computation
for any mask (any token subset), and a mask of ratio 1.0 must equal full computation whatever the
cache holds. Tolerance: |diff| <= 1e-9 * max|latent| in float64 (subset matmuls may round
differently from full ones in the last bits; observed differences are 0 on this CPU).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from instgenie.config import ExecConfig
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest, RequestState
from instgenie.engine.templates import TemplateSpec
from tests.conftest import make_image, make_mask, planned_step, png_bytes

STEPS = 4
RTOL = 1e-9


@functools.cache
def fp64_pipeline(family: str, sparse_convs: str = "auto") -> EditPipeline:
    """Sparse convs on (UNet families: ResNets and samplers masked too, their invariants are
    the transformer blocks'); test_replay_equals_full also runs attention-only masking."""
    return EditPipeline.load(f"{family}:tiny", dtype="fp64",
                             execution=ExecConfig(sparse_convs=sparse_convs))  # fmt: skip


def _masks() -> dict[str, Image.Image]:
    ellipse = Image.new("L", (128, 128), 0)
    ImageDraw.Draw(ellipse).ellipse([30, 50, 90, 100], fill=255)
    two = make_mask(128, 128, (0.05, 0.05, 0.25, 0.2))
    ImageDraw.Draw(two).rectangle([90, 96, 120, 127], fill=255)
    pixel = Image.new("L", (128, 128), 0)
    pixel.putpixel((77, 33), 255)
    return {
        "rect": make_mask(128, 128, (0.2, 0.3, 0.5, 0.6)),
        "ellipse": ellipse,
        "two-regions": two,
        "one-pixel": pixel,
        "full": Image.new("L", (128, 128), 255),
    }


MASKS = _masks()


def _run(pipe: EditPipeline, state: RequestState) -> RequestState:
    while not state.is_done:
        pipe.denoise_step([state])
    return state


def _full(pipe: EditPipeline, req: EditRequest) -> RequestState:
    return _run(pipe, pipe.preprocess(req))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    tol = RTOL * float(b.abs().max())
    diff = float((a - b).abs().max())
    assert diff <= tol, f"max |diff| {diff:.3e} > {tol:.3e}"


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_replay_equals_full(family: str, mask_name: str) -> None:
    _replay_equals_full(fp64_pipeline(family), mask_name)


@pytest.mark.parametrize("mask_name", ["ellipse", "full"])
def test_replay_equals_full_attention_only(mask_name: str) -> None:
    pipe = fp64_pipeline("sdxl-inpaint", "off")
    assert pipe.family.masked.convs is None
    _replay_equals_full(pipe, mask_name)


def _replay_equals_full(pipe: EditPipeline, mask_name: str) -> None:
    img, mask = png_bytes(make_image(128, 128, seed=1)), png_bytes(MASKS[mask_name])
    common = dict(prompt="a red felt hat", seed=5, num_inference_steps=STEPS)
    key = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
    edit = EditRequest(uid="e", image=None, template_id=key, mask=mask, paste_back=False, **common)
    masked = pipe.preprocess(edit)
    assert masked.path == "masked" and masked.notes.cache == "hit"
    _run(pipe, masked)
    ctx = pipe.family.masked.last_context
    assert sorted(ctx.masked_blocks) == list(range(pipe.family.masked.num_blocks))
    full = _full(pipe, EditRequest(uid="f", image=img, mask=mask, paste_back=False, **common))
    assert full.path == "full"
    _close(masked.latents, full.latents)
    a, b = pipe.postprocess([masked, full])
    assert np.abs(np.asarray(a.image, np.int16) - np.asarray(b.image, np.int16)).max() <= 1


def test_ratio_one_equals_full_with_any_cache(family: str) -> None:
    pipe = fp64_pipeline(family)
    img = png_bytes(make_image(128, 128, seed=2))
    # the cache holds another prompt, seed and an all-keep mask: at ratio 1.0 it must not matter
    key = pipe.build_template(
        TemplateSpec(image=img, prompt="x", seed=99, num_inference_steps=STEPS)
    )
    full_mask = png_bytes(MASKS["full"])
    common = dict(mask=full_mask, prompt="a blue coat", seed=3, num_inference_steps=STEPS)
    masked = _run(
        pipe, pipe.preprocess(EditRequest(uid="m", image=None, template_id=key, **common))
    )
    assert masked.path == "masked"
    full = _full(pipe, EditRequest(uid="f", image=img, **common))
    _close(masked.latents, full.latents)


def test_foreign_cache_changes_a_partial_edit() -> None:
    """The cache really feeds the unmasked rows: a partial-mask edit on a template captured with
    other inputs differs from the edit's own full computation."""
    pipe = fp64_pipeline("sdxl-inpaint")
    img = png_bytes(make_image(128, 128, seed=2))
    key = pipe.build_template(
        TemplateSpec(image=img, prompt="x", seed=99, num_inference_steps=STEPS)
    )
    common = dict(mask=png_bytes(MASKS["rect"]), prompt="a blue coat", seed=3,
                  num_inference_steps=STEPS)  # fmt: skip
    masked = _run(
        pipe, pipe.preprocess(EditRequest(uid="m", image=None, template_id=key, **common))
    )
    full = _full(pipe, EditRequest(uid="f", image=img, **common))
    assert float((masked.latents - full.latents).abs().max()) > 1e-3


def test_masked_request_batched_with_others_at_other_steps(family: str) -> None:
    pipe = fp64_pipeline(family)
    imgs = [png_bytes(make_image(128, 128, seed=s)) for s in (4, 5)]
    masks = [png_bytes(MASKS["rect"]), png_bytes(MASKS["ellipse"])]
    specs = [dict(prompt="a hat", seed=1), dict(prompt="shoes", seed=2)]
    keys = [
        pipe.build_template(TemplateSpec(image=i, mask=m, num_inference_steps=STEPS, **sp))
        for i, m, sp in zip(imgs, masks, specs, strict=True)
    ]
    reqs = [
        # masked on template 0 (replay), masked on template 1 with a different seed/prompt,
        # and a full request on an unregistered image with 3 steps
        EditRequest(uid="a", image=None, template_id=keys[0], mask=masks[0],
                    num_inference_steps=STEPS, **specs[0]),
        EditRequest(uid="b", image=None, template_id=keys[1], mask=masks[1], prompt="boots",
                    seed=8, num_inference_steps=STEPS),
        EditRequest(uid="c", image=png_bytes(make_image(128, 128, seed=6)), mask=masks[0],
                    prompt="a scarf", seed=4, num_inference_steps=3),
    ]  # fmt: skip
    solo = {r.uid: _full(pipe, r) for r in reqs}
    states = {r.uid: pipe.preprocess(r) for r in reqs}
    joins = {"a": 0, "b": 1, "c": 2}
    step = 0
    while not all(s.is_done for s in states.values()):
        batch = [s for u, s in states.items() if step >= joins[u] and not s.is_done]
        pipe.denoise_step(batch)
        step += 1
    assert [s.path for s in states.values()] == ["masked", "masked", "full"]
    for uid, s in states.items():
        _close(s.latents, solo[uid].latents)


def test_compute_all_switch_keeps_replay_exact_and_is_used() -> None:
    pipe = fp64_pipeline("sdxl-inpaint")
    ex = pipe.family.masked
    img, mask = png_bytes(make_image(128, 128, seed=7)), png_bytes(MASKS["rect"])
    common = dict(prompt="a scarf", seed=11, num_inference_steps=STEPS)
    key = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
    edit = EditRequest(uid="e", image=None, template_id=key, mask=mask, **common)
    full = _full(pipe, EditRequest(uid="f", image=img, mask=mask, **common))
    compute_all = frozenset(range(0, ex.num_blocks, 2))
    masked = pipe.preprocess(edit)
    while not masked.is_done:
        planned_step(pipe, [masked], compute_all=compute_all)
        assert set(ex.last_context.masked_blocks).isdisjoint(compute_all)
        assert len(set(ex.last_context.masked_blocks)) == ex.num_blocks - len(compute_all)
    _close(masked.latents, full.latents)


def test_path_selection_miss_then_capture_then_hit() -> None:
    pipe = fp64_pipeline("flux-fill")
    img, mask = png_bytes(make_image(128, 128, seed=8)), png_bytes(MASKS["rect"])
    key = pipe.register_template(TemplateSpec(image=img, prompt="t", num_inference_steps=STEPS))
    edit = EditRequest(uid="e", image=None, template_id=key, mask=mask, prompt="p",
                       num_inference_steps=STEPS)  # fmt: skip
    # no cache yet: the edit runs full while the template's capture runs in the same batch
    first = pipe.run([edit])[0]
    assert (first.path, first.cache) == ("full", "miss")
    assert pipe.store.status(key) == "ready"
    second = pipe.run([edit])[0]
    assert (second.path, second.cache) == ("masked", "hit")
    # a different step schedule cannot read this cache
    other = EditRequest(uid="o", image=None, template_id=key, mask=mask, prompt="p",
                        num_inference_steps=STEPS + 1)  # fmt: skip
    assert pipe.preprocess(other).path == "full"


def test_capture_is_complete_and_abort_leaves_nothing() -> None:
    pipe = fp64_pipeline("sd2-inpaint")
    img = png_bytes(make_image(128, 128, seed=9))
    key = pipe.build_template(TemplateSpec(image=img, prompt="c", num_inference_steps=2))
    meta = pipe.store.meta(key)
    assert len(meta.block_shapes) == pipe.family.masked.num_cached_blocks
    assert meta.num_steps == 2 and meta.num_rows == 2 and meta.nbytes > 0
    key2 = pipe.register_template(TemplateSpec(image=img, prompt="d", num_inference_steps=2))
    state = pipe.capture_state(key2)
    pipe.denoise_step([state])
    assert pipe.store.status(key2) == "building"
    state.writer.abort()
    assert pipe.store.status(key2) == "absent"


def test_capture_batched_behind_another_request_is_exact(family: str) -> None:
    """A capture that runs behind another request (rows from `start` > 0, joining at a later
    step) records its own rows: replaying the template's inputs on that cache equals full."""
    pipe = fp64_pipeline(family)
    img, mask = png_bytes(make_image(128, 128, seed=12)), png_bytes(MASKS["ellipse"])
    common = dict(prompt="a wool hat", seed=6, num_inference_steps=STEPS)
    key = pipe.register_template(TemplateSpec(image=img, mask=mask, **common))
    other = pipe.preprocess(
        EditRequest(uid="o", image=png_bytes(make_image(128, 128, seed=13)), mask=mask,
                    prompt="gloves", seed=2, num_inference_steps=STEPS + 2)
    )  # fmt: skip
    pipe.denoise_step([other])  # the capture joins one step later, behind it
    capture = pipe.capture_state(key)
    assert capture is not None
    while not capture.is_done:
        pipe.denoise_step([other, capture])
        assert pipe.family.masked.last_context.requests[1].start == other.num_rows
    assert pipe.store.status(key) == "ready"
    edit = EditRequest(uid="e", image=None, template_id=key, mask=mask, **common)
    masked = _run(pipe, pipe.preprocess(edit))
    assert masked.path == "masked"
    full = _full(pipe, EditRequest(uid="f", image=img, mask=mask, **common))
    _close(masked.latents, full.latents)


def test_latents_outside_the_edit_follow_the_template() -> None:
    """After every step, a masked edit's latents outside its edit region are the template's
    latents of that step (the cache's trajectory), whatever the edit's prompt and seed."""
    pipe = fp64_pipeline("sdxl-inpaint")
    img = png_bytes(make_image(128, 128, seed=14))
    key = pipe.build_template(TemplateSpec(image=img, prompt="x", seed=9, num_inference_steps=4))
    edit = EditRequest(uid="e", image=None, template_id=key, mask=png_bytes(MASKS["rect"]),
                       prompt="a green scarf", seed=21, num_inference_steps=4)  # fmt: skip
    state = pipe.preprocess(edit)
    assert state.path == "masked"
    keep = ~state.edit_mask.expand_as(state.latents)
    assert keep.any() and not keep.all()
    handle = pipe.store.open(key)  # the edit's own handle is closed when it finishes
    try:
        while not state.is_done:
            pipe.denoise_step([state])
            template = handle.latents(state.step_index - 1).to(state.latents.dtype)
            assert torch.equal(state.latents[keep], template[keep])
            assert not torch.equal(state.latents[~keep], template[~keep])
    finally:
        handle.close()


@pytest.mark.parametrize("family", ["sdxl-inpaint", "sd2-inpaint"])
def test_cfg_template_serves_an_edit_without_guidance_its_cond_row(family: str) -> None:
    """A template captured with CFG (rows: uncond, cond) serves an edit without guidance its
    conditional row. At the first step both templates' latents are the same noise, so that edit
    on a CFG template must equal the same edit on a template captured without guidance (inside
    the edit region; outside it follows each template's own trajectory)."""
    pipe = fp64_pipeline(family)
    img = png_bytes(make_image(128, 128, seed=15))
    spec = dict(image=img, prompt="a chair", seed=4, num_inference_steps=STEPS)
    with_cfg = pipe.build_template(TemplateSpec(guidance_scale=5.0, **spec))
    no_cfg = pipe.build_template(TemplateSpec(guidance_scale=1.0, **spec))
    assert pipe.store.meta(with_cfg).num_rows == 2 and pipe.store.meta(no_cfg).num_rows == 1
    firsts = []
    for key in (with_cfg, no_cfg):
        edit = EditRequest(uid="e", image=None, template_id=key, mask=png_bytes(MASKS["rect"]),
                           prompt="a lamp", seed=8, guidance_scale=1.0,
                           num_inference_steps=STEPS)  # fmt: skip
        state = pipe.preprocess(edit)
        assert state.path == "masked" and state.num_rows == 1
        pipe.denoise_step([state])
        firsts.append(state.latents[state.edit_mask.expand_as(state.latents)])
    _close(firsts[0], firsts[1])
