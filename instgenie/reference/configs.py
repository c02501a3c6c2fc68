"""The reference models' architectures and tokenizers.

Each family keeps its full architecture's diffusers classes and topology (SDXL: 9-channel
UNet2DConditionModel with text_time conditioning and two CLIP towers; Flux-Fill:
FluxTransformer2DModel with double and single blocks, CLIP + T5) at small widths, with a VAE of
4x downscale, at 256 px (latents 64 x 64): transformer tokens at 32 x 32 and 16 x 16 (SDXL)
and 32 x 32 (Flux, 2 x 2 packed). Sizes (parameters, fp16 bytes) are in docs/reference-models.md.

Tokenizers: the shipped tokenizer assets split most dataset words into letters ("checked" is six
tokens); the reference tokenizers add every dataset word as one token (CLIP: merges appended
after the shipped ones; T5: pieces with a score above any letter's), so a small text tower
reads "checked" as one symbol.
"""

from __future__ import annotations

import json
import re
from typing import Any

from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxFillPipeline,
    FluxTransformer2DModel,
    StableDiffusionXLInpaintPipeline,
    UNet2DConditionModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from instgenie.dataset import vocab
from instgenie.engine import textenc
from instgenie.engine.adapters import flux_fill, sdxl_inpaint
from instgenie.reference.settings import FAMILIES, SIDE, T5_LEN  # noqa: E402

CLIP_SMALL = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, projection_dim=64, hidden_act="gelu")  # fmt: skip
CLIP_LARGE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=4, projection_dim=128, hidden_act="gelu")  # fmt: skip
T5_SMALL = dict(d_model=128, d_ff=384, d_kv=32, num_heads=4, num_layers=3)

#: SDXL topology (no attention at the first level; deeper at the last), small widths
UNET = dict(
    sample_size=SIDE // 4,
    in_channels=9,
    out_channels=4,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    block_out_channels=[48, 96, 128],
    layers_per_block=2,
    transformer_layers_per_block=[1, 1, 2],
    attention_head_dim=[2, 3, 4],  # SDXL's quirk: these are head counts (32 channels each)
    cross_attention_dim=CLIP_SMALL["hidden_size"] + CLIP_LARGE["hidden_size"],
    addition_embed_type="text_time",
    addition_time_embed_dim=32,
    projection_class_embeddings_input_dim=6 * 32 + CLIP_LARGE["projection_dim"],
    norm_num_groups=16,
    use_linear_projection=True,
    flip_sin_to_cos=True,
    freq_shift=0,
)

#: 16 latent channels, VAE scale 4: in = 16*4 (latents) + 16*4 (masked image) + 4*4*4 (mask)
TRANSFORMER = dict(
    patch_size=1,
    in_channels=192,
    out_channels=64,
    num_layers=2,
    num_single_layers=4,
    attention_head_dim=32,
    num_attention_heads=6,
    joint_attention_dim=T5_SMALL["d_model"],
    pooled_projection_dim=CLIP_SMALL["hidden_size"],
    guidance_embeds=False,  # not guidance-distilled: the scale is not an input (no teacher)
    axes_dims_rope=(8, 12, 12),
)


def vae_config(latent_channels: int, **scaling: Any) -> dict[str, Any]:
    """4x downscale (three levels); the scaling (and shift) factors are set after training from
    the latents' statistics (train.latent_stats)."""
    blocks = [32, 64, 64]
    return dict(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        block_out_channels=blocks, down_block_types=["DownEncoderBlock2D"] * 3,
        up_block_types=["UpDecoderBlock2D"] * 3, layers_per_block=1, norm_num_groups=32,
        sample_size=SIDE, force_upcast=False, **scaling,
    )  # fmt: skip


def _words() -> list[str]:
    """Every word a caption or an edit prompt can hold (scenes.caption)."""
    names = [*vocab.COLOURS, *vocab.PATTERNS, *vocab.GARMENTS, *vocab.WALLS, *vocab.TEXTURES,
             *vocab.OBJECTS, "a", "an", "person", "in", "on", "the", "wall", "left", "right",
             "green", "plant"]  # fmt: skip
    return sorted({w for name in names for w in re.findall(r"[a-z]+|[^a-z\s]", name)})


def clip_tokenizer() -> CLIPTokenizer:
    """The shipped CLIP BPE with merges appended (lowest priority) until every dataset word is
    one token: each word's pieces under the merges so far are joined left to right."""
    base_vocab, merges = textenc._clip_vocab()
    vocab_ = dict(base_vocab)
    merges = list(merges)
    for word in _words():
        while True:
            tok = CLIPTokenizer(vocab=dict(vocab_), merges=list(merges), model_max_length=77)
            pieces = tok.tokenize(word)
            if len(pieces) == 1:
                break
            a, b = pieces[0], pieces[1]
            merges.append((a, b))
            vocab_.setdefault(a + b, len(vocab_))
    return CLIPTokenizer(vocab=vocab_, merges=merges, model_max_length=77)


def t5_tokenizer() -> T5Tokenizer:
    """The shipped T5 Unigram vocabulary with "▁word" pieces scored above any letter."""
    pieces = [tuple(p) for p in json.loads(textenc._asset("t5_vocab.json"))]
    words = {f"\u2581{w}" for w in _words()} | set(_words())
    pieces = [p for p in pieces if p[0] not in words] + [(w, -1.0) for w in sorted(words)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_LEN)


def _clip(cfg: dict, vocab_size: int, projection: bool) -> CLIPTextModel:
    config = CLIPTextConfig(vocab_size=vocab_size, max_position_embeddings=77, bos_token_id=0,
                            eos_token_id=1, pad_token_id=1, **cfg)  # fmt: skip
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def new_pipeline(family: str) -> Any:
    """A freshly initialised (random) reference pipeline of `family`, float32 on the CPU."""
    clip_tok = clip_tokenizer()
    n_clip = len(clip_tok)
    if family == "sdxl-inpaint":
        return StableDiffusionXLInpaintPipeline(
            unet=UNet2DConditionModel(**UNET),
            vae=AutoencoderKL(**vae_config(4, scaling_factor=1.0)),
            text_encoder=_clip(CLIP_SMALL, n_clip, False),
            text_encoder_2=_clip(CLIP_LARGE, n_clip, True),
            tokenizer=clip_tok,
            tokenizer_2=clip_tokenizer(),
            scheduler=EulerDiscreteScheduler(**sdxl_inpaint.SCHEDULER_CONFIG),
            **sdxl_inpaint.SDXLInpaint.pipeline_kwargs,
        )
    if family == "flux-fill":
        t5_tok = t5_tokenizer()
        t5_cfg = T5Config(vocab_size=len(t5_tok), feed_forward_proj="gated-gelu",
                          is_encoder_decoder=False, use_cache=False, **T5_SMALL)  # fmt: skip
        t5 = T5EncoderModel(t5_cfg)
        return FluxFillPipeline(
            transformer=FluxTransformer2DModel(**TRANSFORMER),
            vae=AutoencoderKL(
                **vae_config(
                    16,
                    scaling_factor=1.0,
                    shift_factor=0.0,
                    use_quant_conv=False,
                    use_post_quant_conv=False,
                )
            ),
            text_encoder=_clip(CLIP_SMALL, n_clip, False),
            text_encoder_2=t5,
            tokenizer=clip_tok,
            tokenizer_2=t5_tok,
            scheduler=FlowMatchEulerDiscreteScheduler(**flux_fill.SCHEDULER_CONFIG),
        )
    raise ValueError(f"no reference model of family {family!r}; known: {FAMILIES}")


def load_pipeline(family: str, path: str) -> Any:
    """A reference pipeline directory (train.save's output), float32 on the CPU."""
    import torch

    cls = {"sdxl-inpaint": StableDiffusionXLInpaintPipeline, "flux-fill": FluxFillPipeline}[family]
    kwargs = sdxl_inpaint.SDXLInpaint.pipeline_kwargs if family == "sdxl-inpaint" else {}
    return cls.from_pretrained(path, torch_dtype=torch.float32, local_files_only=True, **kwargs)
