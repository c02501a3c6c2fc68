"""`flux-fill`: FLUX.1 Fill (FluxTransformer2DModel, 384 input channels, CLIP-L + T5-XXL, 1024²).

Guidance-distilled: no CFG rows; the guidance scale (default 30) is a transformer input. Latents
are packed 2x2 into tokens: (1, (h/2)(w/2), 4C). Pre-processing follows FluxFillPipeline.__call__
up to its loop; the generator is consumed for: the image's VAE sample, noise, the masked image's
VAE sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxFillPipeline,
    FluxTransformer2DModel,
)
from diffusers.pipelines.flux.pipeline_flux_fill import (
    calculate_shift,
    retrieve_latents,
    retrieve_timesteps,
)
from PIL import Image

from instgenie.engine import textenc
from instgenie.engine.adapters.base import AdapterBase
from instgenie.engine.adapters.vae import vae_config
from instgenie.engine.masked.tokens import flux_token_masks
from instgenie.engine.noise_schedule import flow_match_step
from instgenie.engine.request import EditRequest, RequestState
from instgenie.errors import BatchError
from instgenie.scheduler.step import StepPlan

TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "full": dict(
        patch_size=1,
        in_channels=384,
        out_channels=64,
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ),
    # 4 latent channels, VAE scale 4: in = 4*4 (latents) + 4*4 (masked image) + 4*4*4 (mask)
    "tiny": dict(
        patch_size=1,
        in_channels=96,
        out_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ),
}

VAE_CONFIGS = {
    size: vae_config(
        size,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        latent_channels=16 if size == "full" else 4,
        quant_conv=False,
    )
    for size in ("full", "tiny")
}

SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)

#: T5 sequence length per size (tokens), stored as tokenizer_2.model_max_length
TEXT_LEN = {"tiny": 32, "full": 512}


class FluxFill(AdapterBase):
    #: skip the strength-1.0 image encode whose result is multiplied by 0 (tests compare both)
    skip_noised_encode = True

    name = "flux-fill"
    pipeline_cls = FluxFillPipeline
    scheduler_cls = FlowMatchEulerDiscreteScheduler
    gpu_dtype = torch.bfloat16
    default_guidance = 30.0
    backbone_name = "transformer"

    @classmethod
    def build_components(cls, size: str, *, build: Any) -> dict[str, Any]:
        tiny = size == "tiny"
        return dict(
            transformer=build(
                lambda: FluxTransformer2DModel(**TRANSFORMER_CONFIGS[size]), 0, "backbone"
            ),
            vae=build(lambda: AutoencoderKL(**VAE_CONFIGS[size]), 1, "vae"),
            text_encoder=build(
                lambda: textenc.clip_text_model("tiny" if tiny else "clip-l"), 2, "text"
            ),
            text_encoder_2=build(
                lambda: textenc.t5_encoder("tiny" if tiny else "t5-xxl"), 3, "text"
            ),
            tokenizer=textenc.clip_tokenizer(77),
            tokenizer_2=textenc.t5_tokenizer(TEXT_LEN[size]),
            scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.transformer = self.pipe.transformer
        self.granule = self.pipe.vae_scale_factor * 2
        #: pixels per token side (a token is a 2x2 patch of latents)
        self.token_stride = self.pipe.vae_scale_factor * 2
        #: the native resolution in pixels (square side)
        self.default_size = int(self.vae.config.sample_size)
        # T5 sequence length: the tokenizer's own limit (512 for the released checkpoints)
        self.text_len = min(512, int(self.pipe.tokenizer_2.model_max_length))

    def uses_cfg(self, guidance: float) -> bool:
        return False  # guidance-distilled: the scale is a transformer input, not CFG rows

    def encode_texts(self, prompt: str, negative_prompt: str | None, do_cfg: bool) -> tuple:
        # Flux-Fill is guidance-distilled: no negative prompt, no unconditional row
        return self.pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.text_len,
        )

    def prepare(
        self, request: EditRequest, image: Image.Image, mask: Image.Image, height: int, width: int
    ) -> RequestState:
        pipe, dev, dtype = self.pipe, self.device, self.dtype
        steps, guidance = self.resolve_steps_guidance(
            request.num_inference_steps, request.guidance_scale
        )
        gen = self.generator(request.seed)
        init_image = pipe.image_processor.preprocess(image, height=height, width=width)
        init_image = init_image.to(dtype=torch.float32)
        prompt_embeds, pooled, text_ids = self.prompts.get(
            request.prompt, lambda: self.encode_texts(request.prompt, None, False)
        )

        sched = self.new_scheduler()
        view = self.view(sched, _encode_vae_image=self._image_latents_encoder(sched))
        vsf = pipe.vae_scale_factor
        cfg = sched.config
        mu = calculate_shift(
            (height // vsf // 2) * (width // vsf // 2),
            cfg.get("base_image_seq_len", 256),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        timesteps, n = retrieve_timesteps(sched, steps, dev, sigmas=sigmas, mu=mu)
        timesteps, n = type(pipe).get_timesteps(view, n, request.strength, dev)
        self.check_num_steps(n, request.strength)

        channels = self.vae.config.latent_channels
        latents, img_ids = type(pipe).prepare_latents(
            view, init_image, timesteps[:1], 1, channels, height, width, dtype, dev, gen, None
        )
        mask_image = pipe.mask_processor.preprocess(mask, height=height, width=width)
        # diffusers encodes it as given: in the VAE's dtype (ModelConfig.vae_dtype), then casts
        masked_image = (init_image * (1 - mask_image)).to(device=dev, dtype=self.vae.dtype)
        mask_packed, masked_lat = type(pipe).prepare_mask_latents(
            view, mask_image, masked_image, 1, channels, 1, height, width, dtype, dev, gen
        )
        lat_h, lat_w = 2 * (height // (vsf * 2)), 2 * (width // (vsf * 2))
        latent_mask = torch.nn.functional.interpolate(mask_image, size=(lat_h, lat_w))

        t_start = sched.begin_index or 0
        return RequestState(
            uid=request.uid,
            request=request,
            latents=latents,
            cond={
                "prompt_embeds": prompt_embeds,
                "pooled_projections": pooled,
                "masked_image_latents": torch.cat((masked_lat, mask_packed), dim=-1),
                "guidance": torch.full([1], guidance, device=dev, dtype=torch.float32),
            },
            timesteps=timesteps.to("cpu", torch.float32),
            sigmas=sched.sigmas[t_start:].to("cpu", torch.float32),
            guidance_scale=guidance,
            num_rows=1,
            image=image,
            mask=mask,
            latent_mask=latent_mask.to(dev),
            size=(height, width),
            ids={"txt_ids": text_ids, "img_ids": img_ids},
        )

    def _image_latents_encoder(self, sched: Any):
        """FluxFillPipeline._encode_vae_image for the image's initial latents, the VAE run in its
        own dtype. When the first sigma is 1.0 in the latents' dtype (strength 1.0),
        prepare_latents' scheduler.scale_noise computes 1.0 * noise + 0.0 * latents = noise,
        whatever the latents: the encode is skipped, and its posterior sample's normal draw
        (DiagonalGaussianDistribution.sample: the mean's shape, the VAE's dtype, on the
        generator's CPU) is made anyway, so that the generator reaches the noise and the masked
        image's sample in diffusers' order. Saves one VAE encode per request (22 ms at 1024² on
        an H100, docs/benchmarks/stages-h100.md)."""
        vae, vsf = self.vae, self.pipe.vae_scale_factor

        def encode(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
            if self.skip_noised_encode and _noise_only(sched, image.dtype):
                b, _, h, w = image.shape
                shape = (b, vae.config.latent_channels, h // vsf, w // vsf)
                torch.randn(shape, generator=generator, dtype=vae.dtype)  # the sample's draw
                return torch.zeros(shape, device=image.device, dtype=image.dtype)
            latents = retrieve_latents(vae.encode(image.to(vae.dtype)), generator=generator)
            shift, scale = vae.config.shift_factor, vae.config.scaling_factor
            return ((latents - shift) * scale).to(image.dtype)

        return encode

    def denoise_step(self, batch: list[RequestState], plan: StepPlan) -> None:
        if not batch:
            return
        keys = {s.batch_key for s in batch}
        if len(keys) > 1:
            raise BatchError(f"requests with different token shapes cannot share a batch: {keys}")
        dev = self.device
        t, sig, sig_next = self.step_vectors(batch)
        latents = torch.cat([s.latents for s in batch])
        cond = {k: torch.cat([s.cond[k] for s in batch]) for k in batch[0].cond}
        hidden = torch.cat((latents, cond["masked_image_latents"]), dim=2)
        # diffusers: timestep = t.to(latents.dtype) / 1000, computed in the latents' dtype
        timestep = t.to(dev).to(latents.dtype) / 1000
        out = self.masked.run_backbone(
            batch,
            plan,
            self._transformer,
            hidden_states=hidden,
            timestep=timestep,
            guidance=cond["guidance"] if self.transformer.config.guidance_embeds else None,
            pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=batch[0].ids["txt_ids"],
            img_ids=batch[0].ids["img_ids"],
        )
        new = flow_match_step(out, latents, sig.to(dev), sig_next.to(dev))
        for i, s in enumerate(batch):
            s.latents = new[i : i + 1]
            s.step_index += 1
        self.masked.after_step(batch)

    def _transformer(self, **kwargs: Any) -> torch.Tensor:
        return self.transformer(return_dict=False, **kwargs)[0]

    # ---- mask-aware execution ----------------------------------------------------------------
    def token_masks(self, mask: torch.Tensor) -> dict[int, torch.Tensor]:
        """{L: bool (L,)} for the packed 2x2-latent token grid."""
        return flux_token_masks(mask, self.pipe.vae_scale_factor)

    def edit_mask(self, masks: dict[int, torch.Tensor], state: RequestState) -> torch.Tensor:
        L = state.latents.shape[1]
        return masks[L].reshape(1, L, 1).to(self.device)

    def decode(self, batch: list[RequestState]) -> list[Image.Image]:
        """Working-resolution images; a pasted-back edit of a cached template may decode only
        its mask's crop (engine/cropped_decode.py). A batch shares one size (its batch_key)."""
        assert batch[0].size is not None  # set by prepare
        height, width = batch[0].size

        def decoder_input(latents: torch.Tensor) -> torch.Tensor:
            vsf = self.pipe.vae_scale_factor
            latents = self.pipe._unpack_latents(latents, height, width, vsf)
            latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
            return latents.to(self.vae.dtype)

        return self.cropped.decode(batch, decoder_input)


def _noise_only(sched: Any, dtype: torch.dtype) -> bool:
    """Whether scheduler.scale_noise, called before the first step (begin index set, no step
    index), would weigh the sample by exactly 0: its sigma, in the sample's dtype, is 1.0."""
    if sched.begin_index is None or sched.step_index is not None:
        return False
    return float(sched.sigmas[sched.begin_index].to(dtype)) == 1.0
