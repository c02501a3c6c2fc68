"""Per image, side by side on one card: the stock diffusers pipeline's __call__ against this
project's full path and masked path (issue 28: "the project's full path no slower than stock
diffusers", the per-stage split of where the remaining time goes). Not a test.

- stock: `family.pipe(prompt, image, mask_image, ...)` (FluxFillPipeline /
  StableDiffusionXLInpaintPipeline), eager, torch's ops (every fused kernel off, NCHW:
  bench_masked_step.stock_ops), the text encoders run per call as diffusers runs them; plus
  PIL's PNG encode at its default level (what a user saving the result pays);
- full / masked: EditPipeline.preprocess, every step, VAE decode, `finish` (paste-back off, PNG at
  the fast level), each stage synchronised (bench_masked_step.staged_run), CUDA graphs as served.
Random weights (`full`): the compute cost is the real one. Two rounds, the second timed.

    python bench/stock_vs_engine.py --models flux-fill:full sdxl-inpaint:full --steps 20 \\
        --out $OUT/stock_vs_engine.json
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_masked_step import (  # noqa: E402
    _sync,
    environment,
    graphs_mode,
    staged_run,
    stock_ops,
)
from instgenie.config import ExecConfig  # noqa: E402
from instgenie.engine.imageio import encode_image  # noqa: E402
from instgenie.engine.pipeline import EditPipeline  # noqa: E402
from instgenie.engine.request import EditRequest  # noqa: E402
from instgenie.engine.stepbench import ratio_mask, template_image  # noqa: E402
from instgenie.engine.templates import TemplateSpec  # noqa: E402

PROMPT = "a red leather jacket"


def stock_call(pipe: EditPipeline, image: Image.Image, mask: Image.Image, steps: int) -> dict:
    """Seconds of the diffusers pipeline's own __call__ and of PIL's default PNG encode."""
    fam, dev = pipe.family, pipe.family.device
    size = image.size[0]
    _sync(dev)
    t0 = time.perf_counter()
    out = fam.pipe(
        prompt=PROMPT, image=image, mask_image=mask, height=size, width=size, strength=1.0,
        num_inference_steps=steps, guidance_scale=fam.default_guidance,
        generator=torch.Generator(dev).manual_seed(42),
    ).images[0]  # fmt: skip
    _sync(dev)
    t1 = time.perf_counter()
    out.save(io.BytesIO(), format="PNG")
    return {"pipeline": round(t1 - t0, 4), "encode": round(time.perf_counter() - t1, 4)}


def one_model(model: str, steps: int, ratio: float, execution: ExecConfig, device: str) -> dict:
    pipe = EditPipeline.load(model, device=device, execution=execution)
    size = pipe.family.default_size
    image = template_image(size)
    png = encode_image(image, "png")
    mask_img = ratio_mask(size, size, ratio, pipe.family.granule)
    mask = encode_image(mask_img, "png")
    key = pipe.build_template(
        TemplateSpec(image=png, prompt="a photo of a person", seed=0, num_inference_steps=steps)
    )
    rows: dict = {}
    for _ in range(2):  # the second round is the one kept
        with stock_ops(pipe):
            rows["stock"] = stock_call(pipe, image, mask_img.convert("L"), steps)
        for path in ("full", "masked"):
            req = EditRequest(
                uid=path, image=png, mask=mask, prompt=PROMPT, seed=42, num_inference_steps=steps,
                template_id=key if path == "masked" else None, paste_back=False,
            )  # fmt: skip
            with graphs_mode(pipe, execution.cuda_graphs):
                stages = staged_run(pipe, req, path)[0]
            rows[path] = {k: round(v, 4) for k, v in stages.items()}
    totals = {k: round(sum(v.values()), 3) for k, v in rows.items()}
    result = {"model": model, "size": size, "steps": steps, "mask_ratio": ratio,
              "dtype": str(pipe.family.dtype), "stages_s": rows, "total_s": totals,
              "full_vs_stock": round(totals["stock"] / totals["full"], 3),
              "masked_vs_stock": round(totals["stock"] / totals["masked"], 3),
              "masked_vs_full": round(totals["full"] / totals["masked"], 3)}  # fmt: skip
    pipe.store.delete(key)
    del pipe
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["flux-fill:full", "sdxl-inpaint:full"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (tiny models)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    execution = ExecConfig()
    out = {"env": environment(torch.device(args.device), execution), "argv": sys.argv, "runs": []}
    for model in args.models:
        out["runs"].append(one_model(model, args.steps, args.ratio, execution, args.device))
        print(json.dumps(out["runs"][-1]), flush=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
