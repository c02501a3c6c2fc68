"""`sdxl-inpaint`: SDXL inpainting (9-channel UNet, CLIP-L + OpenCLIP-bigG, 1024²).

With fp16 weights the VAE is kept in float32 (its config asks for `force_upcast`); diffusers
upcasts it around every call instead, which mutates shared module state. ModelConfig.vae_dtype
overrides it (decision 0021).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionXLInpaintPipeline,
    UNet2DConditionModel,
)

from instgenie.engine import textenc
from instgenie.engine.adapters.unet_inpaint import UNetInpaintAdapter
from instgenie.engine.adapters.vae import vae_config
from instgenie.engine.request import EditRequest

UNET_CONFIGS: dict[str, dict[str, Any]] = {
    "full": dict(
        act_fn="silu",
        addition_embed_type="text_time",
        addition_embed_type_num_heads=64,
        addition_time_embed_dim=256,
        attention_head_dim=[5, 10, 20],
        block_out_channels=[320, 640, 1280],
        cross_attention_dim=2048,
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        mid_block_type="UNetMidBlock2DCrossAttn",
        in_channels=9,
        out_channels=4,
        layers_per_block=2,
        norm_num_groups=32,
        norm_eps=1e-5,
        projection_class_embeddings_input_dim=2816,
        sample_size=128,
        transformer_layers_per_block=[1, 2, 10],
        use_linear_projection=True,
        flip_sin_to_cos=True,
        freq_shift=0,
    ),
    # SDXL topology (transformers at two resolutions, deeper at the lower one), tiny widths:
    # 4 + 6 (down) + 3 (mid) + 9 + 6 (up) = 28 transformer blocks
    "tiny": dict(
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        attention_head_dim=[2, 2, 4],
        block_out_channels=[16, 32, 64],
        cross_attention_dim=64,
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        in_channels=9,
        out_channels=4,
        layers_per_block=2,
        norm_num_groups=8,
        projection_class_embeddings_input_dim=6 * 8 + 32,
        sample_size=32,
        transformer_layers_per_block=[1, 2, 3],
        use_linear_projection=True,
        flip_sin_to_cos=True,
        freq_shift=0,
    ),
}

VAE_CONFIGS = {size: vae_config(size, scaling_factor=0.13025) for size in ("full", "tiny")}

SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    steps_offset=1,
    timestep_spacing="leading",
    prediction_type="epsilon",
    interpolation_type="linear",
    use_karras_sigmas=False,
)


class SDXLInpaint(UNetInpaintAdapter):
    name = "sdxl-inpaint"
    pipeline_cls = StableDiffusionXLInpaintPipeline
    pipeline_kwargs: ClassVar[dict[str, Any]] = dict(
        requires_aesthetics_score=False, force_zeros_for_empty_prompt=True, add_watermarker=False
    )

    @classmethod
    def build_components(cls, size: str, *, build: Any) -> dict[str, Any]:
        tiny = size == "tiny"
        return dict(
            unet=build(lambda: UNet2DConditionModel(**UNET_CONFIGS[size]), 0, "backbone"),
            vae=build(lambda: AutoencoderKL(**VAE_CONFIGS[size]), 1, "vae"),
            text_encoder=build(
                lambda: textenc.clip_text_model("tiny" if tiny else "clip-l"), 2, "text"
            ),
            text_encoder_2=build(
                lambda: textenc.clip_text_model(
                    "tiny" if tiny else "openclip-bigg", with_projection=True
                ),
                3,
                "text",
            ),
            tokenizer=textenc.clip_tokenizer(77),
            tokenizer_2=textenc.clip_tokenizer(77),
            scheduler=EulerDiscreteScheduler(**SCHEDULER_CONFIG),
        )

    def auto_vae_dtype(self) -> torch.dtype:
        # the released SDXL VAE overflows in float16: diffusers upcasts it around every call when
        # its config asks (force_upcast); we keep it in float32 instead. bfloat16 (float32's
        # exponent range) is what diffusers runs for a bfloat16 pipeline: ModelConfig.vae_dtype
        if self.dtype == torch.float16 and self.vae.config.force_upcast:
            return torch.float32
        return self.dtype

    def encode_texts(self, prompt: str, negative_prompt: str | None, do_cfg: bool) -> tuple:
        return self.pipe.encode_prompt(
            prompt=prompt,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=do_cfg,
            negative_prompt=negative_prompt,
        )

    def encode_prompt(self, request: EditRequest, do_cfg: bool, height: int, width: int) -> dict:
        pipe = self.pipe
        pe, npe, ppe, nppe = self.prompts.get(
            (request.prompt, request.negative_prompt, do_cfg),
            lambda: self.encode_texts(request.prompt, request.negative_prompt, do_cfg),
        )
        proj_dim = (
            pipe.text_encoder_2.config.projection_dim
            if pipe.text_encoder_2 is not None
            else int(ppe.shape[-1])
        )
        size = (height, width)
        time_ids, neg_time_ids = pipe._get_add_time_ids(
            size, (0, 0), size, 6.0, 2.5, size, (0, 0), size,
            dtype=pe.dtype, text_encoder_projection_dim=proj_dim,
        )  # fmt: skip
        if do_cfg:
            pe, ppe = torch.cat([npe, pe]), torch.cat([nppe, ppe])
            time_ids = torch.cat([neg_time_ids, time_ids])
        return {
            "prompt_embeds": pe.to(self.device),
            "text_embeds": ppe.to(self.device),
            "time_ids": time_ids.to(self.device),
        }

    def unet_kwargs(self, cond: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {
            "encoder_hidden_states": cond["prompt_embeds"],
            "added_cond_kwargs": {"text_embeds": cond["text_embeds"], "time_ids": cond["time_ids"]},
        }

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        cfg = self.vae.config
        latents = latents.to(self.vae.dtype)
        mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
        if mean is not None and std is not None:
            mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            return latents * std / cfg.scaling_factor + mean
        return latents / cfg.scaling_factor
