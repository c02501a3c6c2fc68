"""Making LoRA files for tests: random low-rank pairs on a model's linear layers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import save

from instgenie.config import LoraConfig
from instgenie.engine.pipeline import EditPipeline
from instgenie.lora.store import open_store

#: substrings of the layers the test LoRAs adapt (attention, feed-forward, AdaLN, text towers)
BACKBONE_PICKS = ("attn1.to_q", "attn2.to_v", "ff.net.2", "to_out.0", "norm1.linear", "proj_mlp")
TEXT_PICKS = ("layers.0.self_attn.q_proj", "layers.1.mlp.fc1")


def lora_state(
    pipe: EditPipeline,
    *,
    rank: int = 4,
    seed: int = 0,
    text: bool = True,
    std: float = 0.3,
    picks: tuple[str, ...] = BACKBONE_PICKS,
    legacy_text: bool = False,
) -> dict[str, torch.Tensor]:
    """A PEFT-format state dict (`<component>.<module>.lora_A.weight` (r, in), `lora_B` (out, r)).
    legacy_text: text-encoder keys carry transformers 4's `text_model.` level, as older files
    do (diffusers 0.42 + transformers 5 no longer load those; this server does)."""
    g = torch.Generator().manual_seed(seed)
    fam = pipe.family.pipe
    out = {}
    parts = [("unet", "transformer")] + ([("text_encoder", "text_encoder_2")] if text else [])
    for names in parts:
        for comp in names:
            module = getattr(fam, comp, None)
            if not isinstance(module, torch.nn.Module):
                continue
            backbone = comp in ("unet", "transformer")
            for path, m in module.named_modules():
                if not isinstance(m, torch.nn.Linear):
                    continue
                if not any(p in path for p in (picks if backbone else TEXT_PICKS)):
                    continue
                prefix = comp if backbone or not legacy_text else f"{comp}.text_model"
                a = torch.randn(rank, m.in_features, generator=g) * std
                b = torch.randn(m.out_features, rank, generator=g) * std
                out[f"{prefix}.{path}.lora_A.weight"] = a
                out[f"{prefix}.{path}.lora_B.weight"] = b
    return out


def register(directory: Path, state: dict[str, torch.Tensor]) -> str:
    """Write a LoRA file as the API does (content-addressed); returns its id."""
    data = save(state)
    lora_id = hashlib.sha256(data).hexdigest()
    (directory / f"{lora_id}.safetensors").write_bytes(data)
    return lora_id


def attach(pipe: EditPipeline, directory: Path, async_steps: int = 0, **cfg) -> None:
    pipe.attach_loras(open_store(pipe.family, directory, LoraConfig(**cfg)), async_steps)


def detach(pipe: EditPipeline) -> None:
    if pipe.loras is not None:
        pipe.loras.close()
    pipe.loras, pipe.lora_async_steps = None, 0
