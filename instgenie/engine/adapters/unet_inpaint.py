"""Shared adapter logic for the 9-channel UNet inpainting families (SD2, SDXL).

Pre-processing follows StableDiffusion(XL)InpaintPipeline.__call__ up to its denoising loop,
calling the pipeline's own methods (through a `PipelineView` with a private scheduler) so the
generator is consumed in the same order: [VAE sample of the image if strength < 1], noise,
VAE sample of the masked image.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from diffusers import EulerDiscreteScheduler
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint import (
    retrieve_latents,
    retrieve_timesteps,
)
from PIL import Image

from instgenie.engine.adapters.base import AdapterBase
from instgenie.engine.masked.tokens import unet_token_masks
from instgenie.engine.noise_schedule import euler_scale_input, euler_step
from instgenie.engine.request import EditRequest, RequestState
from instgenie.errors import BatchError, ModelLoadError
from instgenie.scheduler.step import StepPlan

_NHWC = torch.channels_last


def _nhwc_transformer_output(
    self: Transformer2DModel,
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    batch_size: int,
    height: int,
    width: int,
    inner_dim: int,
) -> torch.Tensor:
    # Transformer2DModel._get_output_for_continuous_inputs without its NCHW `.contiguous()`:
    # token-major rows (B, H*W, C) are NHWC memory, so with a channels_last residual the NCHW
    # view of proj_out's output needs no copy and the sum stays channels_last. Same values.
    if not (self.use_linear_projection and residual.is_contiguous(memory_format=_NHWC)):
        return Transformer2DModel._get_output_for_continuous_inputs(
            self, hidden_states, residual, batch_size, height, width, inner_dim
        )
    nhwc = self.proj_out(hidden_states).reshape(batch_size, height, width, inner_dim)
    return nhwc.permute(0, 3, 1, 2) + residual


def keep_channels_last(unet: torch.nn.Module) -> int:
    """Let every linear-projection Transformer2DModel of `unet` return channels_last maps.

    Stock diffusers converts each transformer stack's output back to NCHW, which in a
    channels_last UNet costs two layout copies per stack (decision 0004). Returns the number of
    modules changed (an instance attribute shadows the class method; parameters untouched).
    """
    n = 0
    for module in unet.modules():
        if isinstance(module, Transformer2DModel) and module.use_linear_projection:
            module._get_output_for_continuous_inputs = types.MethodType(
                _nhwc_transformer_output, module
            )
            n += 1
    return n


class UNetInpaintAdapter(AdapterBase):
    scheduler_cls = EulerDiscreteScheduler
    gpu_dtype = torch.float16
    default_guidance = 7.5
    backbone_name = "unet"

    @classmethod
    def _check_pipeline(cls, pipe: Any) -> None:
        if pipe.unet.config.in_channels != 9:
            raise ModelLoadError(
                f"{cls.name} needs a 9-channel inpainting UNet, got in_channels="
                f"{pipe.unet.config.in_channels}"
            )
        if pipe.unet.config.time_cond_proj_dim is not None:
            raise ModelLoadError(f"{cls.name}: guidance-embedding (LCM) UNets are not supported")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        unet = self.pipe.unet
        self.unet = unet
        # image sides must survive VAE downscaling and every UNet downsampler
        self.granule = self.pipe.vae_scale_factor * 2 ** (len(unet.config.block_out_channels) - 1)
        self.prediction_type = self.pipe.scheduler.config.prediction_type
        #: the native resolution in pixels (square side)
        self.default_size = unet.config.sample_size * self.pipe.vae_scale_factor
        #: pixels per token side at the first transformer grid (the latent grid)
        self.token_stride = self.pipe.vae_scale_factor
        #: prompt tokens per row (CLIP's context length)
        tokenizer = getattr(self.pipe, "tokenizer", None)
        self.text_len = int(tokenizer.model_max_length) if tokenizer is not None else 77
        if self.device.type == "cuda" and self.execution.channels_last:
            # NHWC convolutions without cuDNN's NCHW<->NHWC transposes; with keep_channels_last
            # the maps stay NHWC end to end (docs/decisions/0004-unet-memory-format.md)
            unet.to(memory_format=torch.channels_last)
            keep_channels_last(unet)

    def uses_cfg(self, guidance: float) -> bool:
        return guidance > 1.0

    # ---- family hooks ------------------------------------------------------------------------
    def encode_prompt(self, request: EditRequest, do_cfg: bool, height: int, width: int) -> dict:
        """Conditioning rows, (num_rows, ...) each, uncond row first when do_cfg."""
        raise NotImplementedError

    def unet_kwargs(self, cond: dict[str, torch.Tensor]) -> dict[str, Any]:
        raise NotImplementedError

    def encode_vae_image(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """VAE-encode with sampling; result in `image.dtype`, scaled by the VAE scaling factor."""
        latents = retrieve_latents(self.vae.encode(image.to(self.vae.dtype)), generator=generator)
        return self.vae.config.scaling_factor * latents.to(image.dtype)

    # ---- pre-process -------------------------------------------------------------------------
    def prepare(
        self, request: EditRequest, image: Image.Image, mask: Image.Image, height: int, width: int
    ) -> RequestState:
        pipe, dev, dtype = self.pipe, self.device, self.dtype
        steps, guidance = self.resolve_steps_guidance(
            request.num_inference_steps, request.guidance_scale
        )
        do_cfg = self.uses_cfg(guidance)
        gen = self.generator(request.seed)
        cond = self.encode_prompt(request, do_cfg, height, width)

        sched = self.new_scheduler()
        view = self.view(sched, _encode_vae_image=self.encode_vae_image)
        timesteps, n = retrieve_timesteps(sched, steps, dev)
        timesteps, n = type(pipe).get_timesteps(view, n, request.strength, dev)
        self.check_num_steps(n, request.strength)

        init_image = pipe.image_processor.preprocess(image, height=height, width=width)
        init_image = init_image.to(dtype=torch.float32)
        mask_cond = pipe.mask_processor.preprocess(mask, height=height, width=width)
        masked_image = init_image * (mask_cond < 0.5)
        latents, _noise = type(pipe).prepare_latents(
            view,
            1,
            self.vae.config.latent_channels,
            height,
            width,
            dtype,
            dev,
            gen,
            None,
            image=init_image,
            timestep=timesteps[:1],
            is_strength_max=request.strength == 1.0,
            return_noise=True,
            return_image_latents=False,
        )
        mask_lat, masked_lat = type(pipe).prepare_mask_latents(
            view, mask_cond, masked_image, 1, height, width, dtype, dev, gen, do_cfg
        )
        cond["mask"] = mask_lat
        cond["masked_image_latents"] = masked_lat

        t_start = sched.begin_index or 0
        sigmas = sched.sigmas[t_start:].to("cpu", torch.float32)
        timesteps = timesteps.to("cpu", torch.float32)
        assert sigmas.shape[0] == timesteps.shape[0] + 1, (sigmas.shape, timesteps.shape)
        return RequestState(
            uid=request.uid,
            request=request,
            latents=latents,
            cond=cond,
            timesteps=timesteps,
            sigmas=sigmas,
            guidance_scale=guidance,
            num_rows=2 if do_cfg else 1,
            image=image,
            mask=mask,
            latent_mask=mask_lat[:1].float(),
        )

    # ---- one denoising step for a mixed batch ------------------------------------------------
    def denoise_step(self, batch: list[RequestState], plan: StepPlan) -> None:
        if not batch:
            return
        keys = {s.batch_key for s in batch}
        if len(keys) > 1:
            raise BatchError(f"requests with different latent shapes cannot share a batch: {keys}")
        t, sig, sig_next = self.step_vectors(batch)
        rows = torch.tensor([s.num_rows for s in batch])
        dev = self.device

        latents = torch.cat([s.latents for s in batch])  # (B, 4, h, w)
        x = latents.repeat_interleave(rows.to(dev), dim=0)  # (R, 4, h, w), CFG rows adjacent
        x = euler_scale_input(x, sig.repeat_interleave(rows).to(dev))
        cond = {k: torch.cat([s.cond[k] for s in batch]) for k in batch[0].cond}
        x = torch.cat([x, cond["mask"], cond["masked_image_latents"]], dim=1)
        out = self.masked.run_backbone(
            batch,
            plan,
            self._unet,
            x,
            t.repeat_interleave(rows).to(dev),
            **self.unet_kwargs(cond),
        )

        eps, off = [], 0
        for s in batch:
            o = out[off : off + s.num_rows]
            off += s.num_rows
            if s.num_rows == 2:
                uncond, text = o.chunk(2)
                o = uncond + s.guidance_scale * (text - uncond)
            eps.append(o)
        new = euler_step(
            torch.cat(eps), latents, sig.to(dev), sig_next.to(dev), self.prediction_type
        )
        for i, s in enumerate(batch):
            s.latents = new[i : i + 1]
            s.step_index += 1
        self.masked.after_step(batch)

    def _unet(self, x: torch.Tensor, t: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.unet(x, t, return_dict=False, **kwargs)[0]

    # ---- mask-aware execution ----------------------------------------------------------------
    def token_masks(self, mask: torch.Tensor) -> dict[int, torch.Tensor]:
        """{L: bool (L,)} for the latent grid and every UNet resolution below it."""
        levels = len(self.unet.config.block_out_channels)
        return unet_token_masks(mask, self.pipe.vae_scale_factor, levels)

    def edit_mask(self, masks: dict[int, torch.Tensor], state: RequestState) -> torch.Tensor:
        h, w = state.latents.shape[-2:]
        return masks[h * w].reshape(1, 1, h, w).to(self.device)

    # ---- post-process ------------------------------------------------------------------------
    def decode(self, batch: list[RequestState]) -> list[Image.Image]:
        """Working-resolution images; a pasted-back edit of a cached template may decode only
        its mask's crop (engine/cropped_decode.py)."""
        return self.cropped.decode(batch, self._decoder_input)

    def _decoder_input(self, latents: torch.Tensor) -> torch.Tensor:
        return self.unscale_latents(latents).to(self.vae.dtype)

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents / self.vae.config.scaling_factor
