"""Token masks: which tokens of each transformer resolution a request must compute.

A token is masked (computed) when any pixel it covers is marked for editing: masks are max-pooled
from the binarised pixel mask, never nearest-sampled, so a small mask never vanishes at a coarse
resolution and every computed latent lies under a computed token at every resolution.
Masks are keyed by their token count L, which identifies the resolution uniquely (each UNet level
quarters L; Flux has one level).

A compute margin (ModelConfig.compute_margin, decision 0050) dilates the pixel mask by a square
of that many pixels on each side before pooling: the tokens around the edit are computed under
its prompt too, and paste-back still keeps only the edit's own mask. The router measures the same
dilated masks (scheduler/estimate.token_ratios).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pixel_mask_tensor(mask_l: torch.Tensor | object) -> torch.Tensor:
    """PIL "L" {0, 255} mask (or an (H, W) tensor) -> (1, 1, H, W) float32 {0, 1}."""
    if isinstance(mask_l, torch.Tensor):
        t = mask_l.float()
    else:
        import numpy as np

        t = torch.from_numpy(np.asarray(mask_l, dtype="uint8").copy()).float() / 255.0
    return (t >= 0.5).float().reshape(1, 1, *t.shape[-2:])


def dilate(mask: torch.Tensor, margin: int) -> torch.Tensor:
    """(1, 1, H, W) {0, 1} mask -> the same, 1 wherever a pixel within `margin` pixels (Chebyshev
    distance: a (2 margin + 1)² square) is 1; margin 0 returns `mask` itself."""
    if margin < 0:
        raise ValueError(f"a compute margin is a pixel count >= 0, got {margin}")
    if margin == 0:
        return mask
    return F.max_pool2d(mask, kernel_size=2 * margin + 1, stride=1, padding=margin)


def pooled_masks(mask: torch.Tensor, first_stride: int, num_levels: int) -> dict[int, torch.Tensor]:
    """Token masks at strides first_stride * 2^k, k < num_levels, as {L: bool (L,)} (row-major)."""
    out = {}
    for k in range(num_levels):
        s = first_stride * 2**k
        if mask.shape[-2] % s or mask.shape[-1] % s:
            break
        pooled = F.max_pool2d(mask, kernel_size=s, stride=s)[0, 0] > 0
        out[pooled.numel()] = pooled.flatten()
    return out


def unet_token_masks(
    mask: torch.Tensor, vae_scale: int, num_levels: int
) -> dict[int, torch.Tensor]:
    """UNet levels: the latent grid (stride = VAE scale) and each downsampled grid below it."""
    return pooled_masks(mask, vae_scale, num_levels)


def flux_token_masks(mask: torch.Tensor, vae_scale: int) -> dict[int, torch.Tensor]:
    """Flux: one grid of 2x2-latent patches (stride = 2 * VAE scale)."""
    return pooled_masks(mask, 2 * vae_scale, 1)
