"""Working sizes: the native resolution of each model family, the default pixel cap derived from
it, and the working size of an image under the oversize policy (LimitsConfig.oversize).

Pure Python (no torch): the API process resolves the same limits its workers apply. The native
sides match the adapters' `default_size` (tests/server/test_admission.py checks the tiny ones):
`full` and local checkpoints work at their family's published resolution, every `tiny` model at
128 pixels (UNet/transformer sample size x the tiny VAE's 4x downscale), every `ref` model at 256.
"""

from __future__ import annotations

import dataclasses
import math

from instgenie.config import LimitsConfig
from instgenie.errors import TooManyPixelsError

#: family -> native working side, pixels (square), of `full` and local checkpoints
NATIVE_SIDE = {"sd2-inpaint": 512, "sdxl-inpaint": 1024, "flux-fill": 1024}
#: native side of every `tiny` model, pixels
TINY_SIDE = 128
#: native side of every reference model (`ref`, instgenie/reference), pixels
REF_SIDE = 256
#: default max_image_pixels = native area x this
PIXEL_CAP_FACTOR = 4


def native_side(model: str) -> int:
    """The native working side (pixels) of a model spec "FAMILY:SIZE" or "FAMILY:/dir"."""
    family, _, size = model.partition(":")
    if size == "tiny":
        return TINY_SIDE
    if size == "ref":
        return REF_SIDE
    return NATIVE_SIDE.get(family, 1024)


def resolve_limits(limits: LimitsConfig, native: int) -> LimitsConfig:
    """`limits` with max_image_pixels = 0 replaced by the default of a model of native side
    `native` (pixels): its native area x PIXEL_CAP_FACTOR."""
    if limits.max_image_pixels:
        return limits
    return dataclasses.replace(limits, max_image_pixels=PIXEL_CAP_FACTOR * native * native)


def pixel_hint(limits: LimitsConfig) -> str:
    """How a client or operator gets past the pixel cap, for refusals."""
    if limits.oversize == "resize":
        return f"the limit of --oversize resize is --max-input-pixels ({limits.max_input_pixels})"
    return (
        "raise it with --max-image-pixels, or pass --oversize resize to work on larger images "
        "at the model's native area"
    )


def too_many_pixels(
    field: str, width: int, height: int, limits: LimitsConfig
) -> TooManyPixelsError:
    """The typed refusal of a `width` x `height` image over the cap (413 image_too_large)."""
    return TooManyPixelsError(
        field,
        f"is {width}x{height} = {width * height} pixels; the limit is {limits.decode_pixels} "
        f"pixels ({pixel_hint(limits)})",
    )


def working_size(
    width: int, height: int, granule: int, native: int, limits: LimitsConfig
) -> tuple[int, int]:
    """(width, height) the model works at for an input of `width` x `height` pixels: the input
    rounded down to multiples of `granule`; under oversize="resize", an input over
    max_image_pixels is scaled to about the native area (`native`^2, aspect ratio kept, each
    side a multiple of `granule`, at least one granule). Raises TooManyPixelsError when the
    input exceeds what the limits accept."""
    if width * height > limits.decode_pixels:
        raise too_many_pixels("image", width, height, limits)
    if width * height <= limits.max_image_pixels or limits.oversize != "resize":
        return max(0, width - width % granule), max(0, height - height % granule)
    scale = math.sqrt(native * native / (width * height))
    w = max(granule, int(width * scale) // granule * granule)
    h = max(granule, int(height * scale) // granule * granule)
    return w, h
