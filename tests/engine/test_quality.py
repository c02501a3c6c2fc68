"""PSNR/SSIM behave as the definitions require."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from instgenie.engine.quality import psnr, ssim
from tests.conftest import make_image


def test_identical_images() -> None:
    img = make_image(64, 48)
    assert ssim(img, img) == pytest.approx(1.0, abs=1e-12)
    assert psnr(img, img) == float("inf")


def test_known_psnr_and_ordering() -> None:
    img = make_image(64, 64)
    arr = np.asarray(img).astype(np.int16)
    shifted = Image.fromarray((arr + 10).clip(0, 255).astype(np.uint8))
    mse = float(((np.asarray(shifted).astype(float) - arr) ** 2).mean())
    assert psnr(img, shifted) == pytest.approx(10 * np.log10(255**2 / mse))
    rng = np.random.default_rng(0)
    noisy = Image.fromarray((arr + rng.normal(0, 40, arr.shape)).clip(0, 255).astype(np.uint8))
    # a small brightness shift keeps structure; heavy noise destroys it
    assert ssim(img, shifted) > 0.95 > 0.6 > ssim(img, noisy)
