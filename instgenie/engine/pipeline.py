"""The step-split editing pipeline: pre-process -> denoise_step(batch) x N -> post-process.

`EditPipeline` owns validation and image I/O and delegates model work to a family adapter. The
three stages are separate calls so that a serving loop can run pre/post-processing elsewhere and
step a batch whose members joined at different times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from instgenie.config import LimitsConfig
from instgenie.engine.family import ModelFamily, load_family
from instgenie.engine.imageio import (
    OUTPUT_FORMATS,
    decode_image,
    decode_mask,
    encode_image,
    mask_ratio,
    paste_back,
)
from instgenie.engine.request import EditRequest, RequestState
from instgenie.errors import ValidationError

MAX_SEED = 2**63 - 1


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


class EditPipeline:
    def __init__(self, family: ModelFamily, limits: LimitsConfig | None = None) -> None:
        self.family = family
        self.limits = limits or LimitsConfig()

    @classmethod
    def load(
        cls,
        model: str,
        device: str = "cpu",
        dtype: str = "auto",
        limits: LimitsConfig | None = None,
    ) -> EditPipeline:
        return cls(load_family(model, device=device, dtype=dtype), limits)

    # ---- pre-process ---------------------------------------------------------------------------
    def validate(self, req: EditRequest) -> tuple[Image.Image, Image.Image, int, int]:
        """Check every field; decode image and mask. Returns (image, mask, height, width)."""
        lim = self.limits
        _check_text("prompt", req.prompt, lim.max_prompt_chars, required=True)
        _check_text("negative_prompt", req.negative_prompt, lim.max_prompt_chars, required=False)
        if (
            isinstance(req.seed, bool)
            or not isinstance(req.seed, int)
            or not 0 <= req.seed <= MAX_SEED
        ):
            raise ValidationError(
                "seed", f"must be an integer in [0, {MAX_SEED}], got {req.seed!r}"
            )
        steps = req.num_inference_steps
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= lim.max_steps
        ):
            raise ValidationError(
                "num_inference_steps", f"must be an integer in [1, {lim.max_steps}], got {steps!r}"
            )
        g = req.guidance_scale
        if g is not None and not (0.0 <= float(g) <= lim.max_guidance_scale):
            raise ValidationError(
                "guidance_scale", f"must be in [0, {lim.max_guidance_scale}], got {g!r}"
            )
        if not 0.0 < float(req.strength) <= 1.0:
            raise ValidationError("strength", f"must be in (0, 1], got {req.strength!r}")
        if req.output_format.lower() not in OUTPUT_FORMATS:
            raise ValidationError(
                "output_format", f"{req.output_format!r} is not one of png, jpeg, webp"
            )
        image = decode_image(req.image, lim, "image")
        mask = decode_mask(req.mask, image.size, lim, "mask")
        height, width = self._working_size(req, image)
        return image, mask, height, width

    def _working_size(self, req: EditRequest, image: Image.Image) -> tuple[int, int]:
        g = self.family.granule
        w, h = image.size
        height = req.height if req.height is not None else h - h % g
        width = req.width if req.width is not None else w - w % g
        for name, value in (("height", height), ("width", width)):
            if value < g or value % g:
                src = "" if getattr(req, name) is not None else f" (from the image's {w}x{h})"
                raise ValidationError(
                    name, f"{value}{src} must be a positive multiple of {g} pixels for this model"
                )
            if height * width > self.limits.max_image_pixels:
                raise ValidationError(name, f"{width}x{height} exceeds the pixel limit")
        return height, width

    def preprocess(self, req: EditRequest) -> RequestState:
        image, mask, height, width = self.validate(req)
        work_image, work_mask = image, mask
        if image.size != (width, height):
            work_image = image.resize((width, height), Image.Resampling.LANCZOS)
            work_mask = mask.resize((width, height), Image.Resampling.NEAREST)
            if not any(work_mask.getdata()):
                raise ValidationError(
                    "mask", f"becomes empty at the working resolution {width}x{height}"
                )
        with torch.inference_mode():
            state = self.family.prepare(req, work_image, work_mask, height, width)
        state.original_image, state.original_mask = image, mask
        return state

    # ---- denoise -------------------------------------------------------------------------------
    def denoise_step(self, batch: Sequence[RequestState]) -> None:
        """One step for every request in `batch`, each at its own step index."""
        active = [s for s in batch if not s.is_done]
        with torch.inference_mode():
            self.family.denoise_step(active)

    # ---- post-process --------------------------------------------------------------------------
    def postprocess(self, batch: Sequence[RequestState]) -> list[EditResult]:
        with torch.inference_mode():
            images = self.family.decode(list(batch))
        results = []
        for state, img in zip(batch, images, strict=True):
            original, mask = state.original_image or state.image, state.original_mask or state.mask
            if img.size != original.size:
                img = img.resize(original.size, Image.Resampling.LANCZOS)
            if state.request.paste_back:
                img = paste_back(img, original, mask)
            results.append(
                EditResult(
                    uid=state.uid,
                    data=encode_image(img, state.request.output_format),
                    output_format=state.request.output_format.lower(),
                    image=img,
                    mask_ratio=mask_ratio(mask),
                    num_steps=state.num_steps,
                )
            )
        return results

    # ---- convenience ---------------------------------------------------------------------------
    def run(self, requests: Sequence[EditRequest]) -> list[EditResult]:
        """Run requests to completion together (every step batches all unfinished requests)."""
        states = [self.preprocess(r) for r in requests]
        while not all(s.is_done for s in states):
            self.denoise_step(states)
        return self.postprocess(states)


def _check_text(field: str, value: object, limit: int, *, required: bool) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str):
        raise ValidationError(field, f"must be a string, got {type(value).__name__}")
    if len(value) > limit:
        raise ValidationError(field, f"is {len(value)} characters; the limit is {limit}")
