"""PNG outputs at the configured zlib effort (ExecConfig.png_compression, decision 0040): the
level reaches the encoder (a zlib stream names its level class in its header's FLEVEL bits) and
changes no pixel."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from instgenie.config import ExecConfig
from instgenie.engine.imageio import PNG_SETTINGS, encode_image
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.reference.evaluate import png

#: zlib's FLEVEL for a compression level: 0 (levels 0-1), 1 (2-5), 2 (6, the default), 3 (7-9)
FLEVEL = {"fast": 0, "default": 2, "small": 3}


def flevel(data: bytes) -> int:
    """The FLEVEL bits of the first IDAT chunk's zlib header."""
    at = data.index(b"IDAT") + 4
    assert data[at] & 0x0F == 8  # deflate
    return data[at + 1] >> 6


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("name", list(PNG_SETTINGS))
def test_each_setting_encodes_at_its_level_losslessly(name: str) -> None:
    rng = np.random.default_rng(0)
    image = (rng.random((64, 64, 3)) * 40 + np.arange(64)[:, None, None] * 3).astype(np.uint8)
    data = encode_image(Image.fromarray(image), "png", png_compression=name)
    assert flevel(data) == FLEVEL[name]
    assert (_pixels(data) == image).all()


def test_an_edit_is_encoded_with_its_models_setting() -> None:
    image = np.full((64, 64, 3), 120, np.uint8)
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    req = EditRequest(uid="a", image=png(image), mask=png(mask), prompt="a red shirt",
                      num_inference_steps=2, seed=3)  # fmt: skip
    fast = EditPipeline.load("sd2-inpaint:tiny").run([req])[0].data
    small = EditPipeline.load("sd2-inpaint:tiny", execution=ExecConfig(png_compression="small"))
    smaller = small.run([req])[0].data
    assert (flevel(fast), flevel(smaller)) == (FLEVEL["fast"], FLEVEL["small"])
    assert (_pixels(fast) == _pixels(smaller)).all()
