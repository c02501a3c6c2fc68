"""Quality of LoRA edits on a reference model (issue 30): a trained style LoRA
(bench/train_style_lora.py), held-out edits of the reference evaluation set, each run

    base      full path, no LoRA
    sync      full path, the LoRA from the first step (synchronous loading)
    k1/k3/k5  full path, the LoRA from step K on (bounded asynchronous loading, Katz's bound)
    masked    masked path on a template captured WITHOUT adapters, the LoRA on the edit
    captured  masked path on a template captured WITH the LoRA

Scores: SSIM / PSNR of each variant against `sync` (whole image and inside the mask; pasted back,
so outside the mask only the template shows), and the style's strength inside the mask (blue
dominance, (B - (R + G) / 2) / 255: the LoRA's duotone is ~0.2, the scenes' ~0) for every
variant. CPU, float32.

    python bench/lora_quality.py \
        --lora instgenie/assets/ref/loras/blueprint-sdxl-inpaint.safetensors \
        --cases 16 --out docs/benchmarks/data/lora-quality-cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from instgenie.engine.imageio import paste_back
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.templates import TemplateSpec
from instgenie.reference import evaluate
from instgenie.reference.evaluate import TEMPLATE_SEED, edit_request, png
from tests.lora.helpers import attach

TRIGGER = "blueprint style"


def style(img: Image.Image, mask: np.ndarray) -> float:
    a = np.asarray(img.convert("RGB"), np.float32)[mask]
    return float(np.mean(a[:, 2] - (a[:, 0] + a[:, 1]) / 2) / 255)


def run_bounded(pipe: EditPipeline, req, k: int) -> Image.Image:
    """The edit with its backbone LoRA applied from step k on (the worker's gate, replayed:
    k steps with the adapters still "loading", then synchronously loaded)."""
    state = pipe.preprocess(req)
    for _ in range(k):
        pipe.prepare_reads([state])
        pipe.denoise_step([state], pipe.plan_step([state]))  # a plan: no synchronous load
    while not state.is_done:
        pipe.denoise_step([state])
    return pipe.postprocess([state])[0].image


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="sdxl-inpaint:ref")
    ap.add_argument("--lora", required=True)
    ap.add_argument("--cases", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.monotonic()
    pipe = EditPipeline.load(args.model)
    d = Path(tempfile.mkdtemp())
    data = Path(args.lora).read_bytes()
    lora_id = hashlib.sha256(data).hexdigest()
    shutil.copy(args.lora, d / f"{lora_id}.safetensors")
    attach(pipe, d)
    lora = ((lora_id, args.scale),)
    rows = []
    for case in evaluate.cases(args.cases):
        case = replace(case, prompt=f"{TRIGGER}, {case.prompt}")
        image = Image.fromarray(case.image)
        mask = Image.fromarray(case.mask.astype(np.uint8) * 255)
        req = edit_request(case, args.steps, None, seed=1)
        out = {"base": pipe.run([req])[0].image}
        styled = replace(req, loras=lora)
        out["sync"] = pipe.run([styled])[0].image
        for k in (1, 3, 5):
            out[f"k{k}"] = run_bounded(pipe, styled, k)
        for name, caps in (("masked", ()), ("captured", lora)):
            spec = TemplateSpec(image=png(case.image), prompt=case.caption, seed=TEMPLATE_SEED,
                                num_inference_steps=args.steps, loras=caps)  # fmt: skip
            key = pipe.build_template(spec)
            res = pipe.run([replace(styled, image=None, template_id=key)])[0]
            assert res.path == "masked", res.fallback_reason
            out[name] = res.image
            pipe.store.delete(key)
        pasted = {n: paste_back(im, image, mask) for n, im in out.items()}
        row = {"id": case.id, "ratio": round(case.ratio, 4)}
        for n, im in pasted.items():
            row[f"style_{n}"] = round(style(im, case.mask), 4)
            if n != "sync":
                m = evaluate.compare(pasted["sync"], im, case)
                row[f"ssim_{n}"], row[f"ssim_mask_{n}"] = m["ssim"], m["ssim_mask"]
                row[f"psnr_mask_{n}"] = m["psnr_mask"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = [k for k in rows[0] if k not in ("id", "ratio")]
    summary = {k: round(statistics.mean(r[k] for r in rows), 4) for k in keys}
    record = {"model": args.model, "lora": Path(args.lora).name, "lora_sha256": lora_id,
              "cases": len(rows), "steps": args.steps, "scale": args.scale,
              "summary": summary, "rows": rows, "seconds": round(time.monotonic() - t0, 1),
              "torch": torch.__version__, "device": "cpu"}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
