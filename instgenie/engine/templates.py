"""Templates: an image plus the parameters of the one full run whose activations are cached.

A template's cache is made by a full inference of the template image with its own caption,
seed and step schedule, and by default an all-"keep" mask (so every token sees the template as it
is). Edits on the template then compute only their masked tokens (paper §3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from PIL import Image

from instgenie.cache.keys import TemplateKey, pixel_digest
from instgenie.cache.store import TemplateMeta
from instgenie.engine.imageio import ImageInput
from instgenie.engine.request import RequestState


@dataclass(frozen=True)
class TemplateSpec:
    image: ImageInput
    #: the template's caption; "" works for inpainting models
    prompt: str = ""
    negative_prompt: str | None = None
    seed: int = 0
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    strength: float = 1.0
    #: capture mask (white = edit); None = keep everything (the default for reuse by any edit)
    mask: ImageInput | None = None
    height: int | None = None
    width: int | None = None
    #: LoRAs the capture runs with, ((id, scale), ...): edits that name the same LoRAs then read
    #: activations made with them (see docs/lora.md); () = a cache made without adapters
    loras: tuple[tuple[str, float], ...] = ()


@dataclass
class TemplateRecord:
    key: str
    spec: TemplateSpec
    #: the decoded template image (input size)
    image: Image.Image
    height: int
    width: int


def scheduler_fields(config: dict) -> dict:
    """The scheduler config as it enters a template key: every field except diffusers'
    `_use_default_values`, which lists the fields that took their defaults as list(set(...)) —
    its order follows the process's hash seed, so each process (pre processes, restarted ones,
    other workers of the host) would key the same template differently. It changes nothing the
    scheduler does; the fields it names are in the config with their values."""
    return {k: v for k, v in dict(config).items() if k != "_use_default_values"}


def template_key(
    model: str,
    scheduler_config: dict,
    image: Image.Image,
    mask: Image.Image | None,
    spec: TemplateSpec,
    *,
    height: int,
    width: int,
    num_steps: int,
    cfg: bool,
    cache_dtype: str,
    layout: str = "",
) -> str:
    return TemplateKey(
        image=pixel_digest(image),
        model=model,
        height=height,
        width=width,
        scheduler=json.dumps(scheduler_fields(scheduler_config), sort_keys=True, default=str),
        num_steps=num_steps,
        strength=float(spec.strength),
        cfg=cfg,
        prompt=spec.prompt,
        negative_prompt=spec.negative_prompt or "",
        seed=int(spec.seed),
        capture_mask=pixel_digest(mask),
        cache_dtype=cache_dtype,
        loras=json.dumps([[i, float(s)] for i, s in spec.loras]) if spec.loras else "",
        layout=layout,
    ).digest


def mismatch(meta: TemplateMeta, state: RequestState, masks: dict) -> str | None:
    """Why the template cache described by `meta` cannot serve `state`, else None."""
    if len(meta.timesteps) != state.num_steps:
        return (
            f"the edit runs {state.num_steps} denoise steps but the template's cache was "
            f"captured at {len(meta.timesteps)}: use the template's num_inference_steps "
            "(and strength)"
        )
    if meta.timesteps != tuple(state.timesteps.tolist()):
        return "the edit's step schedule (strength) differs from the template's"
    if meta.latent_shape != tuple(state.latents.shape):
        return (
            f"the edit's working size (latents {tuple(state.latents.shape)}) differs from the "
            f"template's {meta.latent_shape}"
        )
    if meta.num_rows < state.num_rows:
        return (
            "the edit uses classifier-free guidance but the template's cache was captured "
            "without it (guidance_scale)"
        )
    # L = 1: the GroupNorm statistics pseudo-block of sparse convs (ConvLayout), not a grid
    if any(L not in masks for L, _ in meta.block_shapes.values() if L > 1):
        return "the template's cache has a token grid the edit's mask does not map to"
    return None
