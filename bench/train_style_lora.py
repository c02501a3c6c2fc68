"""Train a small style LoRA for a reference model (issue 30's quality checks): "blueprint style",
every scene recoloured as a blue duotone of its luminance, the trigger phrase prefixed to its
caption. The reference pipeline stays frozen; PEFT LoRA pairs on the backbone's attention
projections learn the style with the family's own training objective (instgenie/reference).

    python bench/train_style_lora.py --family sdxl-inpaint --steps 400 \
        --out instgenie/assets/ref/loras/blueprint-sdxl-inpaint.safetensors

Writes the LoRA in diffusers/PEFT format (`unet.<module>.lora_A.weight`, metadata lora_alpha)
and a JSON record beside it (loss curve, time, device).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from safetensors.torch import save_file

from instgenie.engine.family import REF_ROOT
from instgenie.reference import configs
from instgenie.reference import pool as pools
from instgenie.reference.objectives import OBJECTIVES
from instgenie.reference.settings import SIDE
from instgenie.reference.train import Batches

TRIGGER = "blueprint style"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def blueprint(images: np.ndarray) -> np.ndarray:
    """uint8 NHWC -> the style: luminance mapped from deep blue to near white."""
    lum = images.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32) / 255.0
    dark, light = np.array([12, 40, 110], np.float32), np.array([225, 238, 255], np.float32)
    out = dark + lum[..., None] * (light - dark)
    return out.round().clip(0, 255).astype(np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="sdxl-inpaint")
    ap.add_argument("--scenes", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    t0 = time.monotonic()
    pool = pools.render(args.scenes, SIDE, seed=args.seed + 1, twins=False)
    styled = replace(pool, images=blueprint(pool.images),
                     captions=[f"{TRIGGER}, {c}" for c in pool.captions])  # fmt: skip
    pipe = configs.load_pipeline(args.family, str(REF_ROOT / args.family)).to(dev)
    pipe.set_progress_bar_config(disable=True)
    batches = Batches(styled, dev, args.seed, full_mask_p=0.3)
    batches.encode(pipe.vae, "fp32")
    backbone = pipe.unet if args.family == "sdxl-inpaint" else pipe.transformer
    for m in (pipe.unet if hasattr(pipe, "unet") else pipe.transformer, pipe.text_encoder,
              getattr(pipe, "text_encoder_2", None), pipe.vae):  # fmt: skip
        if m is not None:
            m.requires_grad_(False)
    lcfg = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS,
                      init_lora_weights="gaussian")  # fmt: skip
    inject_adapter_in_model(lcfg, backbone)
    params = [p for n, p in backbone.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    objective = OBJECTIVES[args.family](pipe, uncond_p=0.1)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    curve, running = [], []
    for step in range(1, args.steps + 1):
        lat, masked, masks, captions, edit = batches.latents(args.batch, gen)
        loss = objective.loss(lat, masked, masks, captions, gen, edit)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running.append(float(loss.detach()))
        if step % 25 == 0:
            curve.append([step, float(np.mean(running))])
            running = []
            print(f"step {step} loss {curve[-1][1]:.4f} {time.monotonic() - t0:.0f}s", flush=True)
    prefix = "unet" if args.family == "sdxl-inpaint" else "transformer"
    state = {f"{prefix}.{k}": v.detach().float().contiguous()
             for k, v in get_peft_model_state_dict(backbone).items()}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"lora_adapter_metadata": json.dumps({"r": args.rank, "lora_alpha": args.rank})}
    save_file(state, str(out), metadata=meta)
    record = {"family": args.family, "trigger": TRIGGER, "targets": TARGETS, "rank": args.rank,
              "scenes": args.scenes, "steps": args.steps, "batch": args.batch, "lr": args.lr,
              "seconds": round(time.monotonic() - t0, 1), "curve": curve,
              "bytes": out.stat().st_size, "device": str(dev), "cpu": platform.processor(),
              "torch": torch.__version__}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "curve"}))


if __name__ == "__main__":
    main()
