"""Training throughput of the reference models' backbones on one GPU, per precision and memory
format: optimizer steps per second at a batch size, from a small rendered pool (the step is
train.py's: objective, backward, clip, AdamW, EMA). Prints JSON lines and writes the fastest
setting per family (`--best FILE`: {"sdxl-inpaint": {"amp": ..., "memory_format": ...}, ...}),
with the top CUDA kernels of the first setting when `--profile` is given.

    python bench/train_speed.py --init-root instgenie/assets/ref --best /tmp/best.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instgenie.reference import configs, pool  # noqa: E402
from instgenie.reference.train import BackboneStep, Batches  # noqa: E402

VARIANTS = {
    "sdxl-inpaint": [("fp32", "channels_last"), ("fp32", "contiguous"),
                     ("bf16", "contiguous"), ("bf16", "channels_last")],
    "flux-fill": [("fp32", "contiguous"), ("bf16", "contiguous")],
}  # fmt: skip


def measure(family: str, init: Path, scenes: pool.Pool, amp: str, memory_format: str,
            batch: int, steps: int, profile: bool, device: str = "cuda") -> dict:  # fmt: skip
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    pipe = configs.load_pipeline(family, str(init)).to(dev, torch.float32)
    if family == "sdxl-inpaint" and memory_format == "channels_last":
        pipe.unet.to(memory_format=torch.channels_last)
    batches = Batches(scenes, dev, 0, 0.2, 0.5)
    batches.encode(pipe.vae, amp)
    step_once = BackboneStep(pipe, family, 0.1, lr=1e-5)
    gen = torch.Generator(device=dev).manual_seed(0)

    def step() -> None:
        step_once(batches, batch, amp, gen, lr=1e-5, ema_decay=0.998)

    for _ in range(5):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    rate = steps / (time.perf_counter() - t0)
    row = {"family": family, "amp": amp, "memory_format": memory_format, "batch": batch,
           "steps_per_s": round(rate, 2), "samples_per_s": round(rate * batch, 1)}  # fmt: skip
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                step()
            sync()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init-root", type=Path, default=Path("instgenie/assets/ref"))
    p.add_argument("--families", default="sdxl-inpaint,flux-fill")
    p.add_argument("--scenes", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--best", type=Path, default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (no timing worth reading)")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.enable_cudnn_sdp(False)
    scenes = pool.render(args.scenes, 256, seed=99)
    best = {}
    for family in args.families.split(","):
        rows = []
        for i, (amp, fmt) in enumerate(VARIANTS[family]):
            rows.append(measure(family, args.init_root / family, scenes, amp, fmt, args.batch,
                                args.steps, args.profile and i == 0, args.device))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        top = max(rows, key=lambda r: r["steps_per_s"])
        best[family] = {"amp": top["amp"], "memory_format": top["memory_format"]}
    if args.best is not None:
        args.best.write_text(json.dumps(best) + "\n")
    print(json.dumps({"best": best}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
