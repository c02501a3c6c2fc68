"""Per-request LoRAs on the tiny models: equal to diffusers' load_lora_weights, a mixed batch gives
each request its own output, masked edits too, every file format reads the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.messages import Path
from tests.conftest import make_image, make_mask, png_bytes, tiny_pipeline
from tests.lora.helpers import attach, detach, lora_state, register

STEPS = 4


@pytest.fixture
def env(family, tmp_path):
    pipe = tiny_pipeline(family)
    attach(pipe, tmp_path)
    yield pipe, tmp_path
    detach(pipe)


def _request(family: str, uid: str, loras=(), **over) -> EditRequest:
    image, mask = make_image(128, 96, seed=3), make_mask(128, 96)
    flux = family == "flux-fill"
    fields = dict(
        image=png_bytes(image), mask=png_bytes(mask), prompt="a red silk dress",
        negative_prompt=None if flux else "blurry", seed=1234, num_inference_steps=STEPS,
        guidance_scale=30.0 if flux else 6.0, paste_back=False, loras=tuple(loras),
    )  # fmt: skip
    fields.update(over)
    return EditRequest(uid=uid, **fields)


def _pixels(result) -> np.ndarray:
    return np.asarray(result.image).astype(np.int16)


def _fresh(module: torch.nn.Module) -> torch.nn.Module:
    """A hook-free copy with the same weights (deepcopy would keep the masked-block hooks, whose
    forwards are bound to the original modules)."""
    if hasattr(type(module), "from_config"):
        fresh = type(module).from_config(module.config)
    else:
        fresh = type(module)(module.config)
    fresh.load_state_dict(module.state_dict())
    return fresh.to(module.dtype).eval()


def _diffusers(family: str, pipe, state, scale: float, req: EditRequest) -> np.ndarray:
    fam = pipe.family
    comps = dict(fam.pipe.components)
    for name in ("unet", "transformer", "text_encoder", "text_encoder_2"):
        if isinstance(comps.get(name), torch.nn.Module):
            comps[name] = _fresh(comps[name])
    comps["scheduler"] = type(fam.pipe.scheduler).from_config(fam.pipe.scheduler.config)
    kwargs = {k: v for k, v in type(fam).pipeline_kwargs.items() if k not in comps}
    ref = type(fam.pipe)(**comps, **kwargs)
    ref.set_progress_bar_config(disable=True)
    ref.load_lora_weights(dict(state), adapter_name="style")
    ref.set_adapters(["style"], adapter_weights=[scale])
    extra = {"max_sequence_length": fam.text_len} if family == "flux-fill" else {
        "negative_prompt": req.negative_prompt}  # fmt: skip
    out = ref(
        prompt=req.prompt, image=make_image(128, 96, seed=3), mask_image=make_mask(128, 96),
        height=96, width=128, num_inference_steps=STEPS, guidance_scale=req.guidance_scale,
        strength=1.0, generator=torch.Generator("cpu").manual_seed(req.seed), output_type="np",
        **extra,
    )  # fmt: skip
    return (out.images[0] * 255).round().astype(np.int16)


def test_equals_diffusers_load_lora_weights(family: str, env) -> None:
    pipe, d = env
    state = lora_state(pipe)
    lora_id = register(d, state)
    req = _request(family, "a", [(lora_id, 0.8)])
    ours = _pixels(pipe.run([req])[0])
    plain = _pixels(pipe.run([_request(family, "b")])[0])
    assert np.abs(ours - plain).max() > 10  # the LoRA changes the image: the check can fail
    ref = _diffusers(family, pipe, state, 0.8, req)
    assert np.abs(ours - ref).max() <= 1, np.abs(ours - ref).max()


def test_mixed_batch_equals_alone(family: str, env) -> None:
    """Two LoRAs (one request with both), a request with none and a masked edit of a template
    with a LoRA, in one batch: each gets the image it gets alone."""
    pipe, d = env
    one = register(d, lora_state(pipe, seed=1))
    two = register(d, lora_state(pipe, seed=2, text=False))
    image, mask = make_image(128, 96, seed=3), make_mask(128, 96)
    spec = TemplateSpec(image=png_bytes(image), mask=png_bytes(mask), prompt="x", seed=7,
                        num_inference_steps=STEPS)  # fmt: skip
    key = pipe.build_template(spec)
    small = png_bytes(make_mask(128, 96, box=(0.3, 0.35, 0.6, 0.6)))
    reqs = [
        _request(family, "one", [(one, 1.0)]),
        _request(family, "none", seed=5),
        _request(family, "both", [(two, 0.7), (one, -0.5)], seed=9),
        _request(family, "masked", [(two, 1.0)], image=None, mask=small, template_id=key),
    ]
    together = pipe.run(reqs)
    assert together[3].path == Path.MASKED  # the LoRA runs on its masked tokens only
    for req, got in zip(reqs, together, strict=True):
        alone = _pixels(pipe.run([req])[0])
        diff = np.abs(_pixels(got) - alone).max()
        assert diff <= 1, (req.uid, diff)
    assert np.abs(_pixels(together[0]) - _pixels(together[1])).max() > 10


def test_kohya_file_equals_peft_file(env, family) -> None:
    """The same pairs as a kohya file (lora_down/lora_up/alpha) and as a PEFT file with the
    alpha / rank scale folded into B give the same image."""
    if family != "sdxl-inpaint":
        pytest.skip("kohya naming is checked on SDXL (lora_unet_*, lora_te1_*)")
    pipe, d = env
    peft = lora_state(pipe, picks=("attn1.to_q", "attn2.to_k"), text=True)
    kohya, folded = {}, {}
    for k, v in peft.items():
        comp, _, rest = k.partition(".")
        module, half = rest.rsplit(".lora_", 1)
        module = module.removeprefix("text_model.")
        prefix = {"unet": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}
        name = f"{prefix[comp]}_{('text_model.' if comp != 'unet' else '') + module}"
        name = name.replace(".", "_")
        kohya[f"{name}.lora_{'down' if half.startswith('A') else 'up'}.weight"] = v
        kohya[f"{name}.alpha"] = torch.tensor(2.0)  # rank 4: scale 0.5
        folded[k] = v * 0.5 if half.startswith("B") else v
    a = _pixels(pipe.run([_request(family, "k", [(register(d, kohya), 1.0)])])[0])
    b = _pixels(pipe.run([_request(family, "p", [(register(d, folded), 1.0)])])[0])
    assert np.abs(a - b).max() <= 1


def test_template_captured_with_lora_replays_exactly(family: str, tmp_path) -> None:
    """The exactness invariant with adapters: a template captured with a LoRA, edited with its
    own prompt, seed, mask and that LoRA, equals full computation with the LoRA (float64). On a
    template captured without it the masked path only approximates it (the unmasked tokens'
    activations come from the adapter-less run): why capture with an adapter is offered."""
    from tests.engine.test_masked_exact import RTOL, _full, _run, fp64_pipeline

    pipe = fp64_pipeline(family)
    attach(pipe, tmp_path)
    lora = ((register(tmp_path, lora_state(pipe, seed=4)), 1.0),)
    img, mask = png_bytes(make_image(128, 128, seed=1)), png_bytes(make_mask(128, 128))
    common = dict(prompt="a red felt hat", seed=5, num_inference_steps=STEPS)
    with_lora = pipe.build_template(TemplateSpec(image=img, mask=mask, loras=lora, **common))
    plain = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
    assert with_lora != plain  # the LoRAs are part of the cache key
    full = _full(pipe, EditRequest(uid="f", image=img, mask=mask, loras=lora, paste_back=False,
                                   **common))  # fmt: skip
    scale = float(full.latents.abs().max())
    for key, exact in ((with_lora, True), (plain, False)):
        edit = EditRequest(uid="e", image=None, template_id=key, mask=mask, loras=lora,
                           paste_back=False, **common)  # fmt: skip
        masked = _run(pipe, pipe.preprocess(edit))
        assert masked.path == Path.MASKED
        diff = float((masked.latents - full.latents).abs().max())
        assert (diff <= RTOL * scale) == exact, (key == plain, diff)
    detach(pipe)


def test_text_lora_is_part_of_the_prompt_cache_key(env, family) -> None:
    """A text-encoder-only LoRA changes the image though the prompt's plain encode is cached,
    and does not leak into a later plain request of the same prompt."""
    pipe, d = env
    text_only = register(d, lora_state(pipe, picks=("no backbone layer",), std=1.0))
    plain = _pixels(pipe.run([_request(family, "p")])[0])
    styled = _pixels(pipe.run([_request(family, "s", [(text_only, 1.0)])])[0])
    again = _pixels(pipe.run([_request(family, "q")])[0])
    assert np.abs(styled - plain).max() > 10
    assert np.array_equal(again, plain)
