"""AutoencoderKL configurations shared by the families: the real SD/SDXL/Flux VAE topology
(`full`, 8x downscale) and a tiny one (`tiny`, 4x downscale, random weights on CPU)."""

from __future__ import annotations

from typing import Any


def vae_config(
    size: str,
    *,
    scaling_factor: float,
    latent_channels: int = 4,
    full_sample_size: int = 1024,
    shift_factor: float | None = None,
    quant_conv: bool = True,
    force_upcast: bool = True,
) -> dict[str, Any]:
    if size == "full":
        blocks, layers, extra = [128, 256, 512, 512], 2, {"sample_size": full_sample_size}
    else:  # tiny: vae_scale_factor 4
        blocks, layers, extra = [16, 32, 32], 1, {"norm_num_groups": 8, "sample_size": 128}
    cfg = dict(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        block_out_channels=blocks,
        down_block_types=["DownEncoderBlock2D"] * len(blocks),
        up_block_types=["UpDecoderBlock2D"] * len(blocks),
        layers_per_block=layers,
        scaling_factor=scaling_factor,
        force_upcast=force_upcast,
        **extra,
    )
    if shift_factor is not None:
        cfg["shift_factor"] = shift_factor
    if not quant_conv:
        cfg.update(use_quant_conv=False, use_post_quant_conv=False)
    return cfg
