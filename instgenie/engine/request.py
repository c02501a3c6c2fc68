"""Engine-level request types: what a caller asks for, and the per-request denoising state.

`EditRequest` is immutable user input. `RequestState` is what pre-processing produces and the
denoise loop advances one step at a time; it owns every per-request table, so a batch may mix
requests at different step indices, with different step counts, templates, masks and prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from PIL import Image

from instgenie.cache.store import CacheWriter, TemplateHandle, TemplateMeta
from instgenie.engine.imageio import ImageInput
from instgenie.lora.gate import LoraUse
from instgenie.messages import CacheOutcome, Path, RequestNotes, Tier


@dataclass(frozen=True)
class EditRequest:
    uid: str
    #: the template image; may be None when `template_id` names a registered template
    image: ImageInput | None
    #: native polarity: white (>= 128) = edit, black = keep
    mask: ImageInput
    prompt: str
    seed: int = 0
    negative_prompt: str | None = None
    #: None = the family's default (50)
    num_inference_steps: int | None = None
    #: None = the family's default (7.5 for SD2/SDXL, 30 for Flux-Fill)
    guidance_scale: float | None = None
    #: fraction of the schedule to run, in (0, 1]; 1.0 starts from pure noise
    strength: float = 1.0
    #: working resolution in pixels; None = the image's size rounded down to the model's granule
    height: int | None = None
    width: int | None = None
    #: copy unmasked pixels of the input into the output
    paste_back: bool = True
    output_format: str = "png"
    #: a registered template (EditPipeline.register_template); its cache makes the edit masked
    template_id: str | None = None
    #: LoRAs to apply, ((lora id (64 hex), scale), ...), in order; see instgenie/lora
    loras: tuple[tuple[str, float], ...] = ()


@dataclass(eq=False)  # identity semantics: a state is one request's evolving run
class RequestState:
    """Per-request denoising state. Tensors live on the model's device.

    Invariant: `sigmas` has `num_steps + 1` entries (the last is 0) and `timesteps` has
    `num_steps`; step `step_index` uses sigmas[step_index] -> sigmas[step_index + 1].
    """

    uid: str
    request: EditRequest
    #: current latents, model dtype; (1, C, h, w) for UNet families, (1, L, C) packed for Flux
    latents: torch.Tensor
    #: family-specific conditioning tensors, one entry per CFG row already stacked (rows, ...)
    cond: dict[str, torch.Tensor]
    #: float32, (num_steps,), the model's timestep input per step
    timesteps: torch.Tensor
    #: float32, (num_steps + 1,)
    sigmas: torch.Tensor
    guidance_scale: float
    #: 2 with classifier-free guidance (uncond, cond), else 1
    num_rows: int
    #: the image at working resolution (RGB) and its binarised mask ("L", {0, 255})
    image: Image.Image
    mask: Image.Image
    #: latent-resolution mask, (1, 1, h, w) float in {0, 1}; token masks are derived from it
    latent_mask: torch.Tensor
    #: the input image and mask at their own size, restored by post-processing (set by the
    #: pipeline; equal to image/mask when no resize was needed)
    original_image: Image.Image | None = None
    original_mask: Image.Image | None = None
    step_index: int = 0
    #: what the stages learn on the way (cache outcome, capture run, stage times); it travels
    #: with the state (worker.state_wire); frozen: a stage records with dataclasses.replace
    notes: RequestNotes = field(default_factory=RequestNotes)
    #: the working size (height, width) in pixels, where the family needs it after prepare
    #: (Flux unpacks its latents with it); None for the UNet families
    size: tuple[int, int] | None = None
    #: positional ids the backbone takes beside the latents, shared by all rows, on the model's
    #: device (Flux: "txt_ids" (T, 3), "img_ids" (L, 3)); empty for the UNet families
    ids: dict[str, torch.Tensor] = field(default_factory=dict)
    # ---- mask-aware execution (set by the pipeline's path selection) ----
    #: MASKED (computes its masked tokens, the rest from cache_key's template) or FULL
    path: Path = Path.FULL
    #: template cache this request reads (key, open handle, its meta); None on the full path
    cache_key: str | None = None
    cache_handle: TemplateHandle | None = None
    cache_meta: TemplateMeta | None = None
    #: {L: int64 indices of the request's masked tokens at the resolution with L tokens} (CPU)
    token_index: dict[int, torch.Tensor] | None = None
    #: bool, broadcastable to `latents`: True where the latents are edited (computed)
    edit_mask: torch.Tensor | None = None
    #: the template's final latents (its cache's `latents(num_steps - 1)`), layout and dtype of
    #: `latents`; captured when the cache handle closes after the last step, for the cropped
    #: VAE decode (engine/cropped_decode.py); it travels with the state (worker.state_wire)
    template_latents: torch.Tensor | None = None
    #: capture sink: this (full) run records its block outputs and latents
    writer: CacheWriter | None = None
    #: its LoRAs (lora/gate.py): adapters loaded, steps run without them; None = it names none
    lora: LoraUse | None = None

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])

    @property
    def is_done(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def batch_key(self) -> tuple:
        """Requests may share a denoising batch only if these agree (latent shape, text length)."""
        text = self.cond.get("prompt_embeds")
        return (tuple(self.latents.shape), None if text is None else tuple(text.shape[1:]))


@dataclass(frozen=True)
class EditResult:
    uid: str
    #: encoded image bytes in `output_format`
    data: bytes
    output_format: str
    image: Image.Image
    #: fraction of the image's pixels marked for editing
    mask_ratio: float
    num_steps: int
    #: MASKED or FULL
    path: Path
    #: HIT (read a template cache), MISS (template given, cache not usable), None (no template)
    cache: CacheOutcome | None
    #: on a hit: the tier the cache was read from (cache.store.tier_of), else None
    cache_tier: Tier | None = None
    #: why an edit of a template took the full path (select_path), else None
    fallback_reason: str | None = None


@dataclass
class DecodedInputs:
    """Pre-processing's CPU half (decode, validate, resize): what the model half needs."""

    request: EditRequest
    image: Image.Image  # as given: the paste-back source, output size
    mask: Image.Image  # binary "L" (255 = edit), image's size
    work_image: Image.Image  # resized to (width, height), the working resolution
    work_mask: Image.Image
    height: int  # working resolution, pixels
    width: int
