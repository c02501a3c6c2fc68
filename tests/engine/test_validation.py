"""Bad inputs raise one typed ValidationError naming the field, with a precise message."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from instgenie.config import LimitsConfig
from instgenie.engine.imageio import decode_image, decode_mask
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.errors import ValidationError
from tests.conftest import make_image, make_mask, png_bytes, tiny_pipeline

IMG = png_bytes(make_image(128, 128))
MASK = png_bytes(make_mask(128, 128))


def _edit(**kw) -> EditRequest:
    base = dict(uid="v", image=IMG, mask=MASK, prompt="a hat", num_inference_steps=2)
    base.update(kw)
    return EditRequest(**base)


def _reject(req: EditRequest, field: str, match: str) -> ValidationError:
    pipe = tiny_pipeline("sd2-inpaint")
    with pytest.raises(ValidationError, match=match) as info:
        pipe.preprocess(req)
    assert info.value.field == field
    assert info.value.code == "invalid_request"
    return info.value


def test_mask_of_another_size() -> None:
    err = _reject(_edit(mask=png_bytes(make_mask(96, 128))), "mask", r"is 96x128 but the image")
    assert "128x128" in str(err)


def test_empty_mask() -> None:
    _reject(_edit(mask=png_bytes(Image.new("L", (128, 128), 127))), "mask", "is empty")


def test_non_image_bytes() -> None:
    _reject(_edit(image=b"%PDF-1.4 definitely not an image"), "image", "not a decodable image")
    _reject(_edit(mask=b"\x00" * 64), "mask", "not a decodable image")


def test_empty_bytes() -> None:
    _reject(_edit(image=b""), "image", r"is empty \(0 bytes\)")


@pytest.mark.parametrize("steps", [0, -3])
def test_steps_not_positive(steps: int) -> None:
    _reject(_edit(num_inference_steps=steps), "num_inference_steps", rf"got {steps}")


def test_steps_above_limit_and_wrong_types() -> None:
    _reject(_edit(num_inference_steps=10_000), "num_inference_steps", r"\[1, 200\]")
    _reject(_edit(num_inference_steps=2.5), "num_inference_steps", "got 2.5")
    _reject(_edit(seed=-1), "seed", "got -1")
    _reject(_edit(prompt=None), "prompt", "must be a string")


@pytest.mark.parametrize("strength", [0.0, 1.5])
def test_strength_out_of_range(strength: float) -> None:
    _reject(_edit(strength=strength), "strength", r"must be in \(0, 1\]")


def test_strength_leaving_no_step() -> None:
    _reject(_edit(strength=0.1, num_inference_steps=2), "strength", "leaves 0 denoising steps")


def test_format_not_allowed() -> None:
    gif = png_bytes(make_image(128, 128), fmt="GIF")
    _reject(_edit(image=gif), "image", r"allowed format \(PNG, JPEG, WEBP\)")
    _reject(_edit(output_format="bmp"), "output_format", "not one of")


def test_truncated_png() -> None:
    _reject(_edit(image=IMG[: len(IMG) // 2]), "image", "truncated or corrupt")


def test_pixel_cap_checked_from_header() -> None:
    limits = LimitsConfig(max_image_pixels=100 * 100)
    with pytest.raises(ValidationError, match=r"128x128 = 16384 pixels; the limit is 10000"):
        decode_image(IMG, limits)


def test_header_past_pillows_own_bomb_limit_names_the_configured_limit() -> None:
    from tests.server.test_harness import png_header

    with pytest.raises(ValidationError, match=r"is 10000000000 pixels \(from its header\); "
                       r"the limit is 16777216 pixels") as info:  # fmt: skip
        decode_image(png_header(100_000, 100_000), LimitsConfig())
    assert info.value.field == "image"


def test_image_smaller_than_granule() -> None:
    small = png_bytes(make_image(16, 16))
    _reject(_edit(image=small, mask=png_bytes(make_mask(16, 16))), "image",
            "is 16x16; this model needs at least 32x32 pixels")  # fmt: skip
    ok = png_bytes(make_image(64, 64))
    _reject(_edit(image=ok, mask=png_bytes(make_mask(64, 64)), height=48), "height",
            "48 must be a positive multiple of 32")  # fmt: skip


def test_mask_polarity_and_binarisation() -> None:
    m = decode_mask(png_bytes(make_mask(64, 64, (0, 0, 0.5, 1.0))), (64, 64), LimitsConfig())
    px = m.load()
    assert px[0, 0] == 255 and px[63, 0] == 0
    # RGBA masks use luminance, like diffusers' mask.convert("L")
    rgba = Image.new("RGBA", (8, 8), (255, 255, 255, 255))
    buf = io.BytesIO()
    rgba.save(buf, "PNG")
    assert decode_mask(buf.getvalue(), (8, 8), LimitsConfig()).getextrema() == (255, 255)


def test_rejected_request_leaves_no_state() -> None:
    pipe = EditPipeline(tiny_pipeline("sd2-inpaint").family)
    with pytest.raises(ValidationError):
        pipe.preprocess(_edit(num_inference_steps=0))
    # the same pipeline still serves a valid request afterwards
    assert pipe.run([_edit()])[0].image.size == (128, 128)


def test_codec_guard_blocks_image_work_in_a_forbidden_process(monkeypatch) -> None:
    from instgenie.engine import imageio

    monkeypatch.setattr(imageio, "_forbidden_pid", None)
    imageio.forbid_codec_in_this_process()
    with pytest.raises(RuntimeError, match="decoding attempted in the denoise loop"):
        decode_image(IMG, LimitsConfig())
    with pytest.raises(RuntimeError, match="encoding attempted"):
        imageio.encode_image(Image.new("RGB", (4, 4)), "png")
