"""What each family's backbone learns, as one loss per batch, computed with the pipelines' own
conventions so that the adapters' inference reads the weights the way they were trained:

- `sdxl-inpaint`: epsilon prediction on the DDPM forward process of its scheduler's betas (the
  Euler scheduler's scale_model_input turns its sample back into that form), input channels
  [noisy latents, latent mask, masked-image latents] as StableDiffusionXLInpaintPipeline
  concatenates them, masked image = image * (mask < 0.5); min-SNR-5 weighting. A dropped
  caption has zero text embeddings: what force_zeros_for_empty_prompt gives the unconditional
  row at inference.
- `flux-fill`: rectified flow, x_t = (1 - s) x0 + s noise, target noise - x0, s logit-normal;
  the condition is FluxFillPipeline.prepare_mask_latents' output (masked image = image *
  (1 - mask)), timestep s (the pipeline's t / 1000).

A batch (train.Batches.latents): the image's VAE latents (a posterior sample) and the masked
image's (posterior mean), both raw (unscaled, unshifted), (B, C, S/4, S/4); masks (B, 1, S, S)
in {0, 1}; captions (B strings); edit (B,) bool: rows whose unmasked pixels are the twin's
(pool.py), whose loss counts only where the mask is (on the latent grid, grown by one cell),
since outside it the context and the target disagree by construction. Each row's loss is its
mean over the cells it counts. The pool is encoded once by the trained, frozen VAE.

The forward process's noise may carry extra low-frequency power (`shaped_noise`: offset noise
and multi-resolution noise, decision 0045): a noise-prediction model trained on plain white
noise learns to read a region's colour from the faint signal the noisiest timesteps leave
(SDXL's schedule keeps sqrt(alpha_bar) = 0.068 at t = 999), and at inference, where sampling
starts from pure noise, it reads the noise's own regional means as colour. Sampling is
unchanged: the pipelines still start from white noise. Measured on the reference models: no
gain in held-out colour accuracy in ~1,000 steps; the shipped weights train on white noise (the
default), the cap was their VAE (decision 0045).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def cell_weights(masks: torch.Tensor, edit: torch.Tensor | None,
                 grid: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """(B, 1, *grid) weights: 1 everywhere for a plain row; for an edit row, 1 on the cells
    the mask touches and their neighbours, 0 elsewhere."""
    b = masks.shape[0]
    ones = torch.ones((b, 1, *grid), device=masks.device)
    if edit is None or not bool(edit.any()):
        return ones
    touched = F.max_pool2d(F.adaptive_max_pool2d(masks, grid), 3, stride=1, padding=1)
    return torch.where(edit[:, None, None, None], touched, ones)


def shaped_noise(shape: tuple[int, ...], device: torch.device, gen: torch.Generator,
                 offset: float = 0.0, multires: float = 0.0) -> torch.Tensor:  # fmt: skip
    """(B, C, H, W) Gaussian noise: white, plus `offset` x one value per row and channel
    (offset noise), plus discount**i x white noise on a grid 2**i times coarser (bilinearly
    upsampled) for every level i >= 1 down to one cell (multi-resolution noise); each row then
    rescaled to unit standard deviation. offset = multires = 0: plain white noise."""
    b, c, h, w = shape
    noise = torch.randn(shape, device=device, generator=gen)
    if not (offset or multires):
        return noise
    level = 1
    while multires and min(h, w) >> (level - 1) > 1:
        low = torch.randn((b, c, max(1, h >> level), max(1, w >> level)), device=device,
                          generator=gen)  # fmt: skip
        up = F.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
        noise = noise + up * multires**level
        level += 1
    if offset:
        noise = noise + offset * torch.randn((b, c, 1, 1), device=device, generator=gen)
    return noise / noise.std(dim=(1, 2, 3), keepdim=True)


def row_means(err: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(B,): each row's mean of err (B, 1, H, W) over the cells w (0 / 1) counts."""
    return (err * w).sum(dim=(1, 2, 3)) / w.sum(dim=(1, 2, 3)).clamp_min(1.0)


class SDXLObjective:
    def __init__(self, pipe: Any, uncond_p: float, offset: float = 0.0,
                 multires: float = 0.0) -> None:  # fmt: skip
        self.pipe, self.uncond_p = pipe, uncond_p
        self.noise = {"offset": offset, "multires": multires}
        self.modules = [pipe.unet, pipe.text_encoder, pipe.text_encoder_2]
        self._alphas: torch.Tensor | None = None
        w = pipe.unet.conv_in.weight  # the memory format train.py gave the UNet
        self.format = (torch.channels_last if w.is_contiguous(memory_format=torch.channels_last)
                       and not w.is_contiguous() else torch.contiguous_format)  # fmt: skip

    def loss(self, lat: torch.Tensor, masked: torch.Tensor, masks: torch.Tensor,
             captions: list[str], gen: torch.Generator,
             edit: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        pipe, dev = self.pipe, lat.device
        b, side = lat.shape[0], masks.shape[-1]
        sf = pipe.vae.config.scaling_factor
        latents, masked = lat.float() * sf, masked.float() * sf
        mask_lat = F.interpolate(masks, size=latents.shape[-2:])
        pe, _, pooled, _ = pipe.encode_prompt(
            prompt=captions, device=dev, num_images_per_prompt=1, do_classifier_free_guidance=False
        )
        keep = (torch.rand(b, device=dev, generator=gen) >= self.uncond_p).to(pe.dtype)
        pe, pooled = pe * keep[:, None, None], pooled * keep[:, None]
        size = (side, side)
        time_ids, _ = pipe._get_add_time_ids(
            size, (0, 0), size, 6.0, 2.5, size, (0, 0), size, dtype=pe.dtype,
            text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim,
        )  # fmt: skip
        if self._alphas is None:
            self._alphas = pipe.scheduler.alphas_cumprod.to(dev, torch.float32)
        t = torch.randint(0, len(self._alphas), (b,), device=dev, generator=gen)
        a = self._alphas[t][:, None, None, None]
        noise = shaped_noise(tuple(latents.shape), dev, gen, **self.noise)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        x = torch.cat([noisy, mask_lat, masked], dim=1)
        pred = pipe.unet(
            x.contiguous(memory_format=self.format), t, encoder_hidden_states=pe,
            added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids.to(dev).repeat(b, 1)},
        ).sample  # fmt: skip
        snr = (a / (1 - a)).flatten()
        weight = torch.clamp(snr, max=5.0) / snr
        err = ((pred.float() - noise) ** 2).mean(dim=1, keepdim=True)
        per = row_means(err, cell_weights(masks, edit, tuple(err.shape[-2:])))
        return (weight * per).mean()


class FluxObjective:
    def __init__(self, pipe: Any, uncond_p: float, offset: float = 0.0,
                 multires: float = 0.0) -> None:  # fmt: skip
        self.pipe, self.uncond_p = pipe, uncond_p  # no CFG at inference: captions never dropped
        self.noise = {"offset": offset, "multires": multires}
        self.modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]

    def loss(self, lat: torch.Tensor, masked: torch.Tensor, masks: torch.Tensor,
             captions: list[str], gen: torch.Generator,
             edit: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        pipe, dev = self.pipe, lat.device
        b, side = lat.shape[0], masks.shape[-1]
        vae, c = pipe.vae, pipe.vae.config.latent_channels
        with torch.no_grad():
            lat = (lat.float() - vae.config.shift_factor) * vae.config.scaling_factor
            h, w = lat.shape[-2:]
            x0 = pipe._pack_latents(lat, b, c, h, w)
            # raw masked-image latents take prepare_mask_latents' "already latents" path
            mask_packed, masked = pipe.prepare_mask_latents(
                masks, masked.float(), b, c, 1, side, side, lat.dtype, dev, gen
            )
        pe, pooled, text_ids = pipe.encode_prompt(
            prompt=captions, prompt_2=None, device=dev, num_images_per_prompt=1,
            max_sequence_length=pipe.tokenizer_2.model_max_length,
        )  # fmt: skip
        img_ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, dev, lat.dtype)
        s = torch.sigmoid(torch.randn(b, device=dev, generator=gen))
        noise = pipe._pack_latents(shaped_noise((b, c, h, w), dev, gen, **self.noise), b, c, h, w)
        xt = (1 - s[:, None, None]) * x0 + s[:, None, None] * noise
        pred = pipe.transformer(
            hidden_states=torch.cat((xt, masked, mask_packed), dim=2), timestep=s, guidance=None,
            pooled_projections=pooled, encoder_hidden_states=pe, txt_ids=text_ids,
            img_ids=img_ids, return_dict=False,
        )[0]  # fmt: skip
        err = ((pred.float() - (noise - x0)) ** 2).mean(dim=-1)  # (B, tokens), row-major grid
        grid = (h // 2, w // 2)
        return row_means(err.view(b, 1, *grid), cell_weights(masks, edit, grid)).mean()


OBJECTIVES = {"sdxl-inpaint": SDXLObjective, "flux-fill": FluxObjective}
