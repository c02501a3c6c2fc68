"""Image and mask decoding, validation, paste-back and encoding. CPU only; no model code here.

Invariants:
- Every rejection is a `ValidationError` naming the field, raised before any pixel is decoded when
  the header already shows the problem (size caps, format allow-list).
- Masks are binarised at 0.5 (value >= 128 of 255 means "edit"), exactly as diffusers'
  VaeImageProcessor(do_binarize=True) does, so the model and paste-back agree on the region.
"""

from __future__ import annotations

import io
import os
import re
import warnings
import zlib

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from instgenie.config import LimitsConfig
from instgenie.engine.png_bands import encode_png
from instgenie.engine.sizing import pixel_hint, too_many_pixels
from instgenie.errors import TooManyPixelsError, ValidationError

OUTPUT_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
#: ExecConfig.png_compression -> (zlib level, zlib strategy; -1: zlib's default) of a PNG
#: output. "fast" is level 1 with run-length matching (Z_RLE): after PNG's row filters it comes
#: within 1 % of level 6's bytes at level 1's speed (decision 0040, png-encoding.md), encoded
#: in parallel bands (png_bands.py, decision 0053); the others by Pillow
PNG_SETTINGS = {"fast": (1, zlib.Z_RLE), "default": (6, -1), "small": (9, -1)}

#: the pid of a process that must never decode or encode images (a worker's denoise loop sets
#: it: codec work there would stall every request of the running batch)
_forbidden_pid: int | None = None


def forbid_codec_in_this_process() -> None:
    global _forbidden_pid
    _forbidden_pid = os.getpid()


def codec_allowed() -> bool:
    """False in a process that called forbid_codec_in_this_process."""
    return _forbidden_pid is None or os.getpid() != _forbidden_pid


def _check_codec_allowed(what: str) -> None:
    if not codec_allowed():
        raise RuntimeError(f"image {what} attempted in the denoise loop process")


ImageInput = bytes | bytearray | memoryview | Image.Image


def open_header(raw: bytes, field: str, limits: LimitsConfig) -> Image.Image:
    """Open encoded bytes lazily and check what the header says — allowed format, pixel count,
    a single frame — before any pixel is decoded. ValidationError naming `field` otherwise."""
    if not raw:
        raise ValidationError(field, "is empty (0 bytes)")
    allowed = ", ".join(limits.allowed_formats)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(raw), formats=list(limits.allowed_formats))
        except UnidentifiedImageError:
            raise ValidationError(
                field, f"is not a decodable image of an allowed format ({allowed})"
            ) from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise _bomb(field, exc, limits) from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise ValidationError(field, f"has a corrupt header: {exc}") from None
    _check_pixels(img, field, limits)
    try:
        frames = getattr(img, "n_frames", 1)
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ValidationError(field, f"has a corrupt header: {exc}") from None
    if frames > 1:
        raise ValidationError(field, f"has {frames} frames; a single still image is required")
    return img


def _open(data: ImageInput, field: str, limits: LimitsConfig) -> Image.Image:
    _check_codec_allowed("decoding")
    if isinstance(data, Image.Image):
        img = data
        _check_pixels(img, field, limits)
        return img
    img = open_header(bytes(data), field, limits)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img.load()
        except (OSError, SyntaxError, ValueError) as exc:
            raise ValidationError(field, f"is truncated or corrupt ({img.format}): {exc}") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise _bomb(field, exc, limits) from None
    # honour EXIF orientation so that the mask and image are compared as the user sees them
    return ImageOps.exif_transpose(img)


def _bomb(field: str, exc: Exception, limits: LimitsConfig) -> ValidationError:
    """Pillow's own bomb check fires inside Image.open, before ours, for headers past its
    MAX_IMAGE_PIXELS: answer with the configured limit (the one the client can act on)."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    size = f"{found.group(1)} pixels" if found else "too many pixels"
    return TooManyPixelsError(
        field,
        f"is {size} (from its header); the limit is {limits.decode_pixels} pixels "
        f"({pixel_hint(limits)})",
    )


def _check_pixels(img: Image.Image, field: str, limits: LimitsConfig) -> None:
    w, h = img.size
    if w < 1 or h < 1:
        raise ValidationError(field, f"has an empty size {w}x{h}")
    if w * h > limits.decode_pixels:
        raise too_many_pixels(field, w, h, limits)


def decode_image(data: ImageInput, limits: LimitsConfig, field: str = "image") -> Image.Image:
    """Decode and validate an image; returns an RGB image."""
    img = _open(data, field, limits)
    if img.mode != "RGB":
        img = img.convert("RGBA").convert("RGB") if "A" in img.getbands() else img.convert("RGB")
    return img


def decode_mask(
    data: ImageInput, image_size: tuple[int, int], limits: LimitsConfig, field: str = "mask"
) -> Image.Image:
    """Decode, validate and binarise a mask (native polarity: white = edit).

    Returns an "L" image with values in {0, 255}. Grayscale, RGB and RGBA masks are converted
    with Pillow's luminance formula, as diffusers does (`mask.convert("L")`).
    """
    img = _open(data, field, limits)
    if img.size != image_size:
        raise ValidationError(
            field,
            f"is {img.size[0]}x{img.size[1]} but the image is {image_size[0]}x{image_size[1]}; "
            "the mask must have the image's size",
        )
    gray = np.asarray(img.convert("L"))
    binary = gray >= 128
    if not binary.any():
        raise ValidationError(
            field, "is empty: no pixel is >= 128 (white marks the region to edit), nothing to edit"
        )
    return Image.fromarray(binary.astype(np.uint8) * 255, mode="L")


def mask_ratio(mask: Image.Image) -> float:
    """Fraction of pixels marked for editing, in [0, 1]."""
    return float((np.asarray(mask) >= 128).mean())


def paste_back(generated: Image.Image, original: Image.Image, mask: Image.Image) -> Image.Image:
    """Keep `original` pixels where `mask` is 0; take `generated` where it is 255.

    All three must have the same size; `generated` is resized to it beforehand by the caller.
    """
    assert generated.size == original.size == mask.size, (generated.size, original.size, mask.size)
    return Image.composite(generated.convert("RGB"), original.convert("RGB"), mask)


def encode_image(img: Image.Image, output_format: str, quality: int = 95,
                 png_compression: str = "fast") -> bytes:  # fmt: skip
    """Encode to PNG/JPEG/WebP bytes; a PNG with PNG_SETTINGS[png_compression] (ExecConfig)."""
    _check_codec_allowed("encoding")
    fmt = OUTPUT_FORMATS.get(output_format.lower())
    if fmt is None:
        raise ValidationError(
            "output_format", f"{output_format!r} is not one of {sorted(set(OUTPUT_FORMATS))}"
        )
    buf = io.BytesIO()
    if fmt == "PNG":
        level, strategy = PNG_SETTINGS[png_compression]
        if png_compression == "fast":  # bands filtered and deflated in parallel (decision 0053)
            return encode_png(np.asarray(img.convert("RGB")), level, strategy)
        kwargs = {"compress_level": level, "compress_type": strategy}
    else:
        kwargs = {"quality": quality}
    img.convert("RGB").save(buf, format=fmt, **kwargs)
    return buf.getvalue()
