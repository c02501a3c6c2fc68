"""The reference models' settings that the CLI reads without importing torch: families, working
side, T5 length, and the training configuration."""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("sdxl-inpaint", "flux-fill")
#: the reference models' working side, pixels
SIDE = 256
#: T5 tokens per prompt (the longest caption is under 40 with the reference vocabulary)
T5_LEN = 64


@dataclass(frozen=True)
class TrainConfig:
    family: str
    seed: int = 0
    vae_steps: int = 2500
    vae_batch: int = 32
    vae_lr: float = 5e-4
    #: VAE training crops, pixels (fully convolutional: crops teach it the whole image's statistics)
    vae_crop: int = 128
    #: VAE loss: L1 + this x L1 of image gradients + kl_weight x KL (summed over latents)
    grad_weight: float = 0.5
    kl_weight: float = 1e-6
    #: + this x L1 of the images' 8 x 8 means (regional colour; 0 in runs 1-6)
    colour_weight: float = 1.0
    #: with init: fine-tune the VAE's decoder for this many steps on whole images (vae_minutes
    #: bounds it); alone (encoder frozen, so the latent space the backbone learnt is kept)
    #: unless encoder_lr > 0
    decoder_steps: int = 0
    decoder_lr: float = 2e-4
    #: with decoder_steps: the encoder (and quant conv) train too, at this learning rate (0:
    #: frozen). The latent space then moves: the latent scaling is measured again and the
    #: backbone must train on the new latents (steps > 0)
    encoder_lr: float = 0.0
    #: share of the decoder fine-tune's images shown with their RGB channels permuted
    colour_augment: float = 0.5
    steps: int = 20000
    batch: int = 64
    lr: float = 4e-4
    warmup: int = 250
    ema: float = 0.998
    #: share of samples whose mask is the whole image (text-to-image; as SD inpainting trains)
    full_mask_p: float = 0.2
    #: share of masked samples shown their twin's unmasked pixels (pool.py: edit training)
    edit_p: float = 0.5
    #: the forward process's noise (objectives.shaped_noise): offset noise (std of one value
    #: per row and channel) and the multi-resolution discount per halving (0: white noise)
    noise_offset: float = 0.0
    multires_noise: float = 0.0
    #: share of captions dropped (SDXL's unconditional row for CFG)
    uncond_p: float = 0.1
    #: stop each phase after this many minutes (0: no limit)
    vae_minutes: float = 0.0
    max_minutes: float = 0.0
    log_every: int = 50
    #: "bf16" (autocast on CUDA) or "fp32" (TF32 matmuls)
    amp: str = "bf16"
    #: the UNet's activations on CUDA: "channels_last" (NHWC) or "contiguous" (NCHW)
    memory_format: str = "channels_last"
    #: the learning rate falls on a cosine from lr to lr * lr_final over the run (its progress:
    #: the larger of steps done / steps and minutes spent / max_minutes); 1.0 keeps it constant
    lr_final: float = 1.0
    #: write the EMA weights to --out every this many minutes while training (0: at the end only)
    checkpoint_minutes: float = 0.0
    #: a reference pipeline directory to continue from ("" = fresh weights); its VAE and latent
    #: scaling are kept (vae_steps is ignored) and its backbone and text towers train on
    init: str = ""

    def __post_init__(self) -> None:
        """The combinations train-reference refuses (its flags are these fields' names)."""
        if self.decoder_steps and not self.init:
            raise ValueError("decoder_steps (--decoder-steps) fine-tunes a trained model's "
                             "decoder: give --init DIR (a new model trains its whole VAE with "
                             "--vae-steps)")  # fmt: skip
        if self.encoder_lr < 0 or self.decoder_lr < 0:
            raise ValueError(f"learning rates are >= 0: encoder_lr (--encoder-lr) "
                             f"{self.encoder_lr}, decoder_lr {self.decoder_lr}")  # fmt: skip
        if self.encoder_lr and not (self.decoder_steps and self.steps):
            raise ValueError("encoder_lr (--encoder-lr) moves a trained model's latent space: "
                             "it needs --decoder-steps and a backbone that trains on the new "
                             "latents (--steps > 0)")  # fmt: skip
