"""The per-request work around the denoise loop: the prompt cache, the device-side uint8
conversion, Flux's skipped strength-1.0 image encode and the VAE dtype option. Each is checked
against the work it replaces: same tensors, same bytes, or (VAE dtype) the requested precision."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instgenie.config import ModelConfig
from instgenie.engine.family import check_model_config, load_family
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.prompt_cache import PromptCache
from instgenie.engine.request import EditRequest
from instgenie.errors import ValidationError
from tests.conftest import make_image, make_mask, png_bytes


def _t(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


# ---- PromptCache (pure state machine) -----------------------------------------------------------
def test_prompt_cache_lru_by_bytes() -> None:
    cache = PromptCache(capacity_bytes=100)  # float32: 4 bytes per element
    calls = []

    def enc(n: int):
        return lambda: (calls.append(n), (_t(n), None))[1]

    a = cache.get("a", enc(10))  # 40 B
    assert cache.get("a", enc(10)) is a  # a hit returns the stored tuple, encode not called
    cache.get("b", enc(10))  # 80 B
    cache.get("a", enc(10))  # a is now the most recent
    cache.get("c", enc(5))  # 100 B: fits exactly
    assert cache.bytes == 100 and len(cache) == 3 and cache.evictions == 0
    cache.get("d", enc(5))  # evicts b (least recent), not a
    assert cache.evictions == 1 and cache.bytes == 80
    before = len(calls)
    cache.get("a", enc(10))
    assert len(calls) == before  # a survived
    cache.get("b", enc(10))
    assert len(calls) == before + 1  # b was evicted: encoded again
    assert (cache.hits, cache.misses) == (3, 5)
    assert cache.stats()["prompt_bytes"] == cache.bytes <= 100


def test_prompt_cache_oversize_and_off() -> None:
    cache = PromptCache(capacity_bytes=16)
    cache.get("big", lambda: (_t(5),))  # 20 B > 16: returned, not kept
    assert len(cache) == 0 and cache.bytes == 0
    cache.get("big", lambda: (_t(5),))
    assert cache.misses == 2 and cache.hits == 0
    off = PromptCache(0)
    off.get("x", lambda: (_t(1),))
    off.get("x", lambda: (_t(1),))
    assert off.misses == 2 and len(off) == 0
    with pytest.raises(ValueError, match=">= 0"):
        PromptCache(-1)


# ---- the families' prompt encoders through the cache --------------------------------------------
def _request(uid: str, prompt: str, negative: str | None = None, **kw) -> EditRequest:
    image, mask = make_image(128, 96, seed=3), make_mask(128, 96)
    return EditRequest(uid=uid, image=png_bytes(image), mask=png_bytes(mask), prompt=prompt,
                       negative_prompt=negative, seed=7, num_inference_steps=3,
                       paste_back=False, **kw)  # fmt: skip


@pytest.mark.parametrize("family", ["sdxl-inpaint", "sd2-inpaint", "flux-fill"])
def test_prompt_cache_hits_give_the_same_images(family: str) -> None:
    """A request whose prompt is cached gives the bytes it gives with the cache off, and an
    earlier request with the same prompt cannot have changed the cached tensors."""
    cached = EditPipeline(load_family(f"{family}:tiny", prompt_cache_bytes=1 << 20))
    uncached = EditPipeline(load_family(f"{family}:tiny", prompt_cache_bytes=0))
    neg = None if family == "flux-fill" else "blurry"
    first = cached.run([_request("a", "a red dress", neg)])[0]
    assert cached.family.prompts.misses == 1 and cached.family.prompts.hits == 0
    again = cached.run([_request("b", "a red dress", neg)])[0]
    assert cached.family.prompts.hits == 1
    ref = uncached.run([_request("c", "a red dress", neg)])[0]
    assert uncached.family.prompts.hits == 0 and len(uncached.family.prompts) == 0
    assert np.array_equal(np.asarray(first.image), np.asarray(ref.image))
    assert np.array_equal(np.asarray(again.image), np.asarray(ref.image))
    # another prompt (or negative prompt) is another key
    cached.run([_request("d", "a blue coat", neg)])
    if neg is not None:
        cached.run([_request("e", "a red dress", "dark")])
    assert cached.family.prompts.hits == 1
    assert cached.family.prompts.misses == (2 if neg is None else 3)


# ---- device-side uint8 conversion ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_to_pil_matches_the_image_processor(dtype: torch.dtype) -> None:
    fam = load_family("sd2-inpaint:tiny", parts="none")
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 24, 40, generator=g) * 2.4 - 1.2  # beyond [-1, 1]: clamped
    # values whose scaled form sits exactly on a rounding tie (k + 0.5) / 255
    ties = (torch.arange(0, 255, dtype=torch.float64) + 0.5) / 255 * 2 - 1
    x.view(-1)[: ties.numel()] = ties.to(x.dtype)
    x = x.to(dtype)
    ours = fam.to_pil(x)
    ref = fam.pipe.image_processor.postprocess(x, output_type="pil")
    assert len(ours) == len(ref) == 2
    for a, b in zip(ours, ref, strict=True):
        assert a.mode == b.mode == "RGB" and a.size == b.size
        assert np.array_equal(np.asarray(a), np.asarray(b))


# ---- Flux: the strength-1.0 image encode is skipped, exactly ------------------------------------
def _count_encodes(fam) -> list:
    calls = []
    encode = fam.vae.encode

    def counted(x, *a, **k):
        calls.append(tuple(x.shape))
        return encode(x, *a, **k)

    fam.vae.encode = counted
    return calls


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_flux_skips_only_the_image_encode_that_noise_overwrites(strength: float) -> None:
    image, mask = make_image(128, 96, seed=3), make_mask(128, 96)
    req = _request("f", "a hat", strength=strength)
    states, counts = [], []
    for skip in (True, False):
        fam = load_family("flux-fill:tiny")
        fam.skip_noised_encode = skip
        calls = _count_encodes(fam)
        with torch.inference_mode():
            states.append(fam.prepare(req, image, mask, 96, 128))
        counts.append(len(calls))
    skipped, full = states
    # strength 1.0: only the masked image is encoded; otherwise both, as diffusers does
    assert counts == ([1, 2] if strength == 1.0 else [2, 2])
    assert torch.equal(skipped.latents, full.latents)
    assert skipped.cond.keys() == full.cond.keys()
    for k in full.cond:
        assert torch.equal(skipped.cond[k], full.cond[k]), k


# ---- VAE dtype ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["sdxl-inpaint", "sd2-inpaint", "flux-fill"])
def test_vae_dtype_option_runs_the_vae_in_that_dtype(family: str) -> None:
    ref = EditPipeline(load_family(f"{family}:tiny"))
    half = EditPipeline(load_family(f"{family}:tiny", vae_dtype="bf16"))
    assert ref.family.vae.dtype == torch.float32
    assert half.family.vae.dtype == torch.bfloat16
    assert half.family.backbone.dtype == torch.float32  # only the VAE moved
    seen = []
    half.family.vae.decoder.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    req = _request("v", "a red dress", None if family == "flux-fill" else "blurry")
    a = np.asarray(ref.run([req])[0].image).astype(np.float64)
    b = np.asarray(half.run([req])[0].image).astype(np.float64)
    assert seen == [torch.bfloat16]
    assert a.shape == b.shape and not np.array_equal(a, b)  # it did run in bfloat16
    psnr = 10 * np.log10(255.0**2 / np.mean((a - b) ** 2))
    assert psnr > 25, psnr  # bfloat16 rounding, not a broken image (random tiny weights)


def test_sdxl_auto_vae_dtype_keeps_float32_under_float16_weights() -> None:
    fam = load_family("sdxl-inpaint:tiny", dtype="fp16", parts="stages")
    assert fam.vae.dtype == torch.float32  # force_upcast: as diffusers runs it
    assert load_family("flux-fill:tiny", dtype="bf16", parts="stages").vae.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "field,value", [("vae_dtype", "fp12"), ("prompt_cache_bytes", -1), ("dtype", "int3")]
)
def test_model_config_checks_the_new_fields(field: str, value) -> None:
    with pytest.raises(ValidationError) as err:
        check_model_config(ModelConfig(**{field: value}))
    assert err.value.field == field


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_to_pil_on_cuda_matches_the_image_processor(dtype: torch.dtype) -> None:
    fam = load_family("sdxl-inpaint:tiny", parts="none")
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(2, 3, 64, 48, generator=g) * 2.4 - 1.2).to("cuda", dtype)
    ours = fam.to_pil(x)
    ref = fam.pipe.image_processor.postprocess(x, output_type="pil")
    for a, b in zip(ours, ref, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
def test_prompt_cache_hit_on_cuda_gives_the_same_image() -> None:
    cached = EditPipeline.load("sdxl-inpaint:tiny", device="cuda", dtype="fp16")
    uncached = EditPipeline.load(
        "sdxl-inpaint:tiny", device="cuda", dtype="fp16", prompt_cache_bytes=0
    )
    cached.run([_request("a", "a red dress", "blurry")])
    hit = cached.run([_request("b", "a red dress", "blurry")])[0]
    ref = uncached.run([_request("c", "a red dress", "blurry")])[0]
    assert cached.family.prompts.hits == 1
    assert np.array_equal(np.asarray(hit.image), np.asarray(ref.image))
