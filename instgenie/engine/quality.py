"""Image similarity metrics: PSNR and SSIM (Wang et al. 2004; 11x11 Gaussian window, sigma 1.5,
K1 = 0.01, K2 = 0.03, data range 255), computed on RGB uint8 images, averaged over channels."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image


def _array(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float64).copy())


def psnr(a: Image.Image, b: Image.Image) -> float:
    """Peak signal-to-noise ratio in dB (inf for identical images)."""
    mse = float(((_array(a) - _array(b)) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)


def ssim(a: Image.Image, b: Image.Image) -> float:
    """Mean structural similarity in [-1, 1] (1 for identical images)."""
    x = _array(a).permute(2, 0, 1)[:, None]  # (3, 1, H, W)
    y = _array(b).permute(2, 0, 1)[:, None]
    return float(_ssim_terms(x, y).mean())


def _ssim_terms(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """SSIM of each valid 11 x 11 window of (3, 1, H, W) float64 images: (3, 1, H-10, W-10)."""
    g = torch.exp(-((torch.arange(11, dtype=torch.float64) - 5) ** 2) / (2 * 1.5**2))
    g = g / g.sum()
    win = (g[:, None] * g[None, :])[None, None]
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, win)

    mx, my = blur(x), blur(y)
    sxx = blur(x * x) - mx * mx
    syy = blur(y * y) - my * my
    sxy = blur(x * y) - mx * my
    return ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))


def ssim_map(a: Image.Image, b: Image.Image) -> np.ndarray:
    """Per-pixel SSIM (channel mean), (H, W): the 11 x 11 window centred on each pixel, edge
    pixels replicated (so a region's mean SSIM covers every pixel of the region)."""
    x = F.pad(_array(a).permute(2, 0, 1)[:, None], (5, 5, 5, 5), mode="replicate")
    y = F.pad(_array(b).permute(2, 0, 1)[:, None], (5, 5, 5, 5), mode="replicate")
    return _ssim_terms(x, y).mean(dim=0)[0].numpy()


def region_psnr(a: Image.Image, b: Image.Image, region: np.ndarray) -> float:
    """PSNR (dB) over the pixels where `region` (bool, (H, W)) is True."""
    d = (_array(a) - _array(b))[torch.from_numpy(region)]
    mse = float((d**2).mean()) if d.numel() else 0.0
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)
