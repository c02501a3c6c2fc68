"""`sd2-inpaint`: Stable Diffusion 2 inpainting (9-channel UNet, OpenCLIP-H text encoder, 512²).

SD2's released scheduler is PNDM (multistep); batched per-request stepping uses Euler with the
same betas and timestep spacing, so a local directory's scheduler is converted to Euler on load.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionInpaintPipeline,
    UNet2DConditionModel,
)

from instgenie.engine import textenc
from instgenie.engine.adapters.unet_inpaint import UNetInpaintAdapter
from instgenie.engine.adapters.vae import vae_config
from instgenie.engine.request import EditRequest

UNET_CONFIGS: dict[str, dict[str, Any]] = {
    "full": dict(
        sample_size=64,
        in_channels=9,
        out_channels=4,
        attention_head_dim=[5, 10, 20, 20],
        block_out_channels=[320, 640, 1280, 1280],
        cross_attention_dim=1024,
        down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
        up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
        layers_per_block=2,
        use_linear_projection=True,
        act_fn="silu",
        norm_num_groups=32,
        flip_sin_to_cos=True,
        freq_shift=0,
    ),
    # same topology as full (16 transformer blocks over 3 resolutions), tiny widths
    "tiny": dict(
        sample_size=32,
        in_channels=9,
        out_channels=4,
        attention_head_dim=[2, 2, 4, 4],
        block_out_channels=[16, 32, 32, 32],
        cross_attention_dim=32,
        down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
        up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
        layers_per_block=2,
        use_linear_projection=True,
        norm_num_groups=8,
        flip_sin_to_cos=True,
        freq_shift=0,
    ),
}

VAE_CONFIGS = {
    s: vae_config(s, scaling_factor=0.18215, full_sample_size=768) for s in ("full", "tiny")
}

SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    steps_offset=1,
    timestep_spacing="leading",
    prediction_type="epsilon",
)


class SD2Inpaint(UNetInpaintAdapter):
    name = "sd2-inpaint"
    pipeline_cls = StableDiffusionInpaintPipeline
    pipeline_kwargs: ClassVar[dict[str, Any]] = dict(
        safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )

    @classmethod
    def build_components(cls, size: str, *, build: Any) -> dict[str, Any]:
        text = "tiny" if size == "tiny" else "openclip-h"
        return dict(
            unet=build(lambda: UNet2DConditionModel(**UNET_CONFIGS[size]), 0, "backbone"),
            vae=build(lambda: AutoencoderKL(**VAE_CONFIGS[size]), 1, "vae"),
            text_encoder=build(lambda: textenc.clip_text_model(text), 2, "text"),
            tokenizer=textenc.clip_tokenizer(77),
            scheduler=EulerDiscreteScheduler(**SCHEDULER_CONFIG),
        )

    def encode_texts(self, prompt: str, negative_prompt: str | None, do_cfg: bool) -> tuple:
        return self.pipe.encode_prompt(
            prompt, self.device, 1, do_cfg, negative_prompt=negative_prompt
        )

    def encode_prompt(self, request: EditRequest, do_cfg: bool, height: int, width: int) -> dict:
        pos, neg = self.prompts.get(
            (request.prompt, request.negative_prompt, do_cfg),
            lambda: self.encode_texts(request.prompt, request.negative_prompt, do_cfg),
        )
        return {"prompt_embeds": torch.cat([neg, pos]) if do_cfg else pos}

    def unet_kwargs(self, cond: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"encoder_hidden_states": cond["prompt_embeds"]}
