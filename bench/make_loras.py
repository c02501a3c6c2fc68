"""Random LoRA files for a served model, for load tests and benchmarks: rank-R pairs on every
attention projection of the backbone and the first text encoder (a typical style LoRA's layers),
shapes from the model's layer table on the meta device (no weights are loaded).

    python bench/make_loras.py --model sdxl-inpaint:full --count 8 --rank 64 --out /tmp/loras
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file

from instgenie.lora.targets import model_table

#: layer-name endings a style LoRA adapts (diffusers and transformers names)
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
             "to_add_out", "q_proj", "k_proj", "v_proj", "out_proj")  # fmt: skip


def make(model: str, rank: int, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for comp, layers in model_table(model).items():
        if comp == "text_encoder_2":
            continue
        for path, (cin, cout) in layers.items():
            if path.rsplit(".", 1)[-1] in ATTENTION or path.endswith("to_out.0"):
                out[f"{comp}.{path}.lora_A.weight"] = (
                    torch.randn(rank, cin, generator=g) * std
                ).half()
                out[f"{comp}.{path}.lora_B.weight"] = (
                    torch.randn(cout, rank, generator=g) * std
                ).half()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(args.count):
        path = args.out / f"lora{i}.safetensors"
        save_file(make(args.model, args.rank, i), str(path))
        print(path)


if __name__ == "__main__":
    main()
