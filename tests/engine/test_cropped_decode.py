"""Cropped VAE decode (engine/cropped_decode.py, engine/crop_forward.py, decision 0044).

(a) The split decoder is the stock one: its whole-map paths are bit-identical to `vae.decode`,
and on a template replay (the template's own latents) the crop path with the crop = the whole
map equals the whole decode to < 1e-10 in float64 (tiny models).
(b) On the reference models, for real masked edits (masks of ratio 0.05-0.3, one on the image's
border) and latents between the template's and the edit's, what the cropped path returns is
>= 40 dB PSNR inside the mask from the whole-image decode: the crop where the guard lets it run
(a replay, an edit that barely moves the decoder's statistics), the whole rest where it does
not (the real edits: a recolour moves them by far more than MAX_DEVIATION).
(c) The decision (crop / guarded / whole) follows the switch, the template hit, paste_back and
the crop's size; the template latents reach post-processing through the state wire; a
pipeline's pasted-back output with the crop is within that PSNR of its output without.
(d) The LRU of decoder statistics stays within its byte bound.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from instgenie.config import ExecConfig
from instgenie.engine import crop_forward as cf
from instgenie.engine.cropped_decode import CROP, GUARDED, MAX_DEVIATION, WHOLE, crop_box
from instgenie.engine.decode_states import DecodeStateCache
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.quality import region_psnr
from instgenie.engine.request import EditRequest, RequestState
from instgenie.engine.templates import TemplateSpec
from instgenie.reference import evaluate
from instgenie.worker.state_wire import from_parts, to_parts
from tests.conftest import make_image, make_mask, png_bytes

PSNR_BOUND = 40.0


@functools.cache
def pipeline(model: str, mode: str = "auto", dtype: str = "auto") -> EditPipeline:
    return EditPipeline.load(model, dtype=dtype, execution=ExecConfig(cropped_decode=mode))


def _edit(pipe: EditPipeline, image: bytes, mask: Image.Image, prompt: str, *, seed: int,
          template_prompt: str, template_mask: bytes | None = None, steps: int = 3,
          **fields) -> RequestState:  # fmt: skip
    """A finished masked edit of the template (image, template_prompt, seed 0, template_mask),
    not decoded."""
    spec = TemplateSpec(image=image, prompt=template_prompt, seed=0, num_inference_steps=steps,
                        mask=template_mask)  # fmt: skip
    key = pipe.build_template(spec)
    req = EditRequest(uid=f"e{seed}", image=None, template_id=key, mask=png_bytes(mask),
                      prompt=prompt, seed=seed, num_inference_steps=steps, **fields)  # fmt: skip
    state = pipe.preprocess(req)
    assert state.path == "masked", state.notes.fallback_reason
    while not state.is_done:
        pipe.denoise_step([state])
    return state


def _replay(pipe: EditPipeline, mask: Image.Image, **fields) -> RequestState:
    """The template's own prompt, seed and mask: latents equal to the template's (up to the
    rounding of computing masked tokens alone)."""
    img = png_bytes(make_image(128, 128, seed=1))
    return _edit(pipe, img, mask, "a red felt hat", seed=0, template_prompt="a red felt hat",
                 template_mask=png_bytes(mask), **fields)  # fmt: skip


def _whole(pipe: EditPipeline, state: RequestState) -> Image.Image:
    """The whole-image decode of `state`'s latents (the path every non-cached edit takes)."""
    return pipe.decode_latents([dataclasses.replace(state, cache_key=None)])[0]


def _decoder_input(pipe: EditPipeline, state: RequestState, latents: torch.Tensor) -> torch.Tensor:
    fam, vae = pipe.family, pipe.family.vae
    if state.size is not None:  # flux: packed tokens
        latents = fam.pipe._unpack_latents(latents, *state.size, fam.pipe.vae_scale_factor)
        return latents / vae.config.scaling_factor + vae.config.shift_factor
    return latents / vae.config.scaling_factor


def _decided(pipe: EditPipeline, state: RequestState) -> tuple[Image.Image, str]:
    """The pipeline's decode of `state` and what the cropped path decided for it."""
    img = pipe.decode_latents([state])[0]
    return img, pipe.family.cropped.last[state.uid]


# ---- (a) exactness -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_whole_paths_are_the_stock_decode_and_a_whole_crop_replay_is_exact(family: str) -> None:
    pipe = pipeline(f"{family}:tiny", "on", "fp64")
    state = _replay(pipe, Image.new("L", (128, 128), 255))  # the whole image: crop = map
    state.latents = state.template_latents.clone()  # a replay by construction
    fam, vae = pipe.family, pipe.family.vae
    z = _decoder_input(pipe, state, state.latents)
    with torch.inference_mode():
        stock = vae.decode(z, return_dict=False)[0]
        image, template = cf.record_decode(vae, z)
        x, prefix = cf.decode_prefix(vae, z)
        assert torch.equal(image, stock) and torch.equal(cf.decode_suffix_whole(vae, x), stock)
        assert cf.deviation(template, prefix) == 0.0
        box = crop_box(state, tuple(z.shape[-2:]), fam.pipe.vae_scale_factor, fam.cropped.margin)
        assert box.is_whole
        crop = cf.decode_suffix_crop(vae, x, box, template)
    assert float((crop - stock).abs().max()) < 1e-10
    img, decision = _decided(pipe, state)
    assert decision == CROP
    assert np.array_equal(np.asarray(img), np.asarray(_whole(pipe, state)))


def test_unsupported_decoders_decode_whole() -> None:
    pipe = pipeline("sdxl-inpaint:tiny", "on")
    vae = pipe.family.vae
    vae.enable_tiling()
    try:
        with pytest.raises(cf.UnsupportedDecoder):
            cf.check_decoder(vae)
    finally:
        vae.disable_tiling()
    cf.check_decoder(vae)


# ---- (b) quality on the reference models ------------------------------------------------------
def _ref_masks(size: int) -> dict[str, np.ndarray]:
    """ratio ~0.05 (interior), ~0.17 (a garment), 0.25 (on the left and bottom borders)."""
    small = np.zeros((size, size), bool)
    small[size // 4 : size // 4 + 57, size // 2 : size // 2 + 57] = True
    border = np.zeros((size, size), bool)
    border[size // 2 :, : size // 2] = True
    return {"small": small, "garment": evaluate.cases(1)[0].mask, "border": border}


@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_the_decode_stays_within_40db_of_the_whole_decode_in_the_mask(family: str) -> None:
    pipe = pipeline(f"{family}:ref")
    case = evaluate.cases(1)[0]
    seen = set()
    for name, mask in _ref_masks(case.image.shape[0]).items():
        assert 0.04 < mask.mean() < 0.3, name
        state = _edit(pipe, evaluate.png(case.image), Image.fromarray(mask.astype(np.uint8) * 255),
                      case.prompt, seed=3, template_prompt=case.caption,
                      paste_back=True)  # fmt: skip
        template, edited = state.template_latents, state.latents
        assert float((edited - template).abs().max()) > 0.1  # the edit changed the mask
        for lam in (0.0, 0.01, 1.0):  # replay, a barely different edit, the edit
            blend = dataclasses.replace(state, uid=f"{name}{lam}",
                                        latents=template + lam * (edited - template))  # fmt: skip
            img, decision = _decided(pipe, blend)
            psnr = region_psnr(img, _whole(pipe, blend), mask)
            assert psnr >= PSNR_BOUND, (name, lam, decision, psnr)
            seen.add(decision)
            if lam < 1.0:
                assert decision == CROP, (name, lam)
    assert seen == {CROP, GUARDED}  # both branches ran: real recolours are guarded


def test_the_guard_reads_the_prefix_statistics() -> None:
    """A shift of the latents inside the mask moves the prefix statistics past the guard."""
    pipe = pipeline("sdxl-inpaint:tiny", "on")
    state = _replay(pipe, make_mask(128, 128, (0.3, 0.3, 0.6, 0.6)))
    vae = pipe.family.vae
    # two standard deviations of the latents added inside the edit mask
    state.latents = state.template_latents + 2 * state.template_latents.std() * state.edit_mask
    with torch.inference_mode():
        _, template = cf.record_decode(vae, _decoder_input(pipe, state, state.template_latents))
        _, prefix = cf.decode_prefix(vae, _decoder_input(pipe, state, state.latents))
    assert cf.deviation(template, prefix) > MAX_DEVIATION
    img, decision = _decided(pipe, state)
    assert decision == GUARDED
    assert np.array_equal(np.asarray(img), np.asarray(_whole(pipe, state)))


def test_non_finite_statistics_never_pass_the_guard() -> None:
    template = cf.DecodeState(((torch.zeros(2), torch.ones(2)),), 1, torch.zeros(1))
    assert cf.deviation(template, [(torch.zeros(2), torch.ones(2))]) == 0.0
    # mean shift 0.5 standard deviations; standard deviation halved
    assert cf.deviation(template, [(torch.full((2,), 0.5), torch.full((2,), 2.0))]) == 0.5
    assert cf.deviation(template, [(torch.tensor([0.0, math.nan]), torch.ones(2))]) == math.inf


# ---- (c) decisions and integration -------------------------------------------------------------
def test_decisions_follow_the_switch_the_hit_paste_back_and_the_crop_size() -> None:
    small, large = (0.3, 0.3, 0.5, 0.5), (0.05, 0.05, 0.95, 0.95)
    auto, on, off = (pipeline("sdxl-inpaint:tiny", m) for m in ("auto", "on", "off"))
    assert _decided(auto, _replay(auto, make_mask(128, 128, small)))[1] == CROP
    assert _decided(auto, _replay(auto, make_mask(128, 128, large)))[1] == WHOLE
    assert _decided(on, _replay(on, make_mask(128, 128, large)))[1] == CROP
    kept = _replay(auto, make_mask(128, 128, small), paste_back=False)
    assert kept.template_latents is None and _decided(auto, kept)[1] == WHOLE
    unset = _replay(off, make_mask(128, 128, small))
    assert unset.template_latents is None and _decided(off, unset)[1] == WHOLE
    full = auto.preprocess(EditRequest(uid="f", image=png_bytes(make_image(128, 128, 1)),
                                       mask=png_bytes(make_mask(128, 128, small)), prompt="x",
                                       num_inference_steps=2))  # fmt: skip
    while not full.is_done:
        auto.denoise_step([full])
    assert full.template_latents is None and _decided(auto, full)[1] == WHOLE


def test_a_crop_box_covers_the_mask_margin_and_resize_allowance() -> None:
    state = _replay(pipeline("sdxl-inpaint:tiny"), make_mask(128, 128, (0.25, 0.5, 0.5, 1.0)))
    box = crop_box(state, (32, 32), 4, 1)  # mask: x 32..63, y 64..127 pixels
    assert (box.y0, box.y1, box.x0, box.x1) == (15, 32, 7, 17)
    state.original_image = state.image.resize((64, 64))  # finish downscales by 2: 7 px more
    box = crop_box(state, (32, 32), 4, 1)
    assert (box.y0, box.y1, box.x0, box.x1) == (13, 32, 5, 19)


@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_post_processing_gets_what_the_crop_needs_through_the_state_wire(family: str) -> None:
    pipe = pipeline(f"{family}:tiny")
    state = _replay(pipe, make_mask(128, 128, (0.3, 0.2, 0.6, 0.5)))
    tensors, meta = to_parts(state, for_post=True)
    back = from_parts(tensors, meta, torch.device("cpu"))
    assert back.cache_key == state.cache_key is not None
    assert torch.equal(back.template_latents, state.template_latents)
    img, decision = _decided(pipe, back)
    assert decision == CROP
    assert np.array_equal(np.asarray(img), np.asarray(_decided(pipe, state)[0]))


@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_a_pasted_back_edit_with_the_crop_matches_the_whole_decode(family: str) -> None:
    img = png_bytes(make_image(128, 128, seed=1))
    mask = png_bytes(make_mask(128, 128, (0.55, 0.1, 0.95, 0.45)))
    common = dict(prompt="a red felt hat", seed=0, num_inference_steps=3)
    out = {}
    for mode in ("auto", "off"):  # a replay: the template's own prompt, seed and mask
        pipe = pipeline(f"{family}:tiny", mode)
        key = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
        req = EditRequest(uid=mode, image=None, template_id=key, mask=mask, **common)
        out[mode] = pipe.run([req])[0]
        decision = pipe.family.cropped.last[mode]
        assert decision == (CROP if mode == "auto" else WHOLE)
    a, b = np.asarray(out["auto"].image), np.asarray(out["off"].image)
    region = np.asarray(Image.open(io.BytesIO(mask))) > 0
    assert np.array_equal(a[~region], b[~region])  # paste-back: the original's pixels
    assert region_psnr(out["auto"].image, out["off"].image, region) >= PSNR_BOUND


# ---- (d) the LRU --------------------------------------------------------------------------------
def _state(nbytes: int, fill: float = 0.0) -> cf.DecodeState:
    latents = torch.full((nbytes // 4,), fill, dtype=torch.float32)
    return cf.DecodeState((), 0, latents)


def test_the_statistics_lru_keeps_its_byte_bound() -> None:
    cache = DecodeStateCache(1000)
    for i in range(5):
        cache.put(f"k{i}", _state(400, i))
        assert cache.bytes <= 1000
    assert list(cache._entries) == ["k3", "k4"] and cache.evictions == 3
    assert cache.get("k3", torch.full((100,), 3.0)) is not None  # k3 most recent now
    cache.put("k5", _state(400, 5))
    assert "k4" not in cache and "k3" in cache
    assert cache.get("k3", torch.full((100,), 9.0)) is None and "k3" not in cache  # stale
    cache.put("big", _state(1200))
    assert "big" not in cache and cache.bytes == 400
    nothing = DecodeStateCache(0)
    nothing.put("k", _state(4))
    assert len(nothing) == 0 and nothing.bytes == 0
    with pytest.raises(ValueError):
        DecodeStateCache(-1)
