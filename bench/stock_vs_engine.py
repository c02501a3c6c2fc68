"""Per image, side by side on one card: the stock diffusers pipeline's __call__ against this
project's full path and masked path (issue 28: "the project's full path no slower than stock
diffusers", the per-stage split of where the remaining time goes). Not a test.

- stock: `family.pipe(prompt, image, mask_image, ...)` (FluxFillPipeline /
  StableDiffusionXLInpaintPipeline), eager, torch's ops (every fused kernel off, NCHW:
  bench_masked_step.stock_ops), the text encoders run per call as diffusers runs them; plus
  PIL's PNG encode at its default level (what a user saving the result pays);
- full / masked: EditPipeline.preprocess, every step, VAE decode, `finish` (paste-back off, PNG at
  the fast level), each stage synchronised (bench_masked_step.staged_run), CUDA graphs as served
  (graph_capture "buckets": the worker's warm-up captures them first, worker/warmup.py);
- masked_kv (--kv): the masked path on a template whose cache holds keys and values (ExecConfig
  kv_cache; the executor switched in place, its own template and warm-up);
- batch (--batch N): N masked edits of the template run as one batch (every step batches all
  of them, as the serving loop does with N queued edits), mask ratios evenly spaced over
  --batch-ratios, each its own seed; stages run one after another and synchronised (pre-process
  each, the batched steps, one batched VAE decode, encode each): images per second against stock
  diffusers run one request at a time (issue 28's batch-8 figure, without the server's overlap of
  pre/post-processing with the steps).
Random weights (`full`): the compute cost is the real one. Two rounds, the second timed.

    python bench/stock_vs_engine.py --models flux-fill:full sdxl-inpaint:full --steps 20 \\
        --out $OUT/stock_vs_engine.json
    python bench/stock_vs_engine.py --models sdxl-inpaint:full --batch 8 --out $OUT/b8.json
"""

from __future__ import annotations

import argparse
import contextlib
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
    add_exec_args,
    environment,
    exec_config,
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
from instgenie.worker import warmup  # noqa: E402

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


def batch_run(pipe: EditPipeline, png: bytes, template: str, steps: int, n: int,
              ratios: tuple[float, float]) -> dict:  # fmt: skip
    """Seconds per stage of `n` masked edits run as one batch (stages synchronised) and their
    mask ratios; every step of the batch runs all n (one composition)."""
    size, granule = pipe.family.default_size, pipe.family.granule
    lo, hi = ratios
    wanted = [lo + (hi - lo) * i / max(1, n - 1) for i in range(n)]
    masks = [ratio_mask(size, size, r, granule) for r in wanted]
    reqs = [EditRequest(uid=f"b{i}", image=png, mask=encode_image(m, "png"), prompt=PROMPT,
                        seed=100 + i, num_inference_steps=steps, template_id=template,
                        paste_back=False)  # fmt: skip
            for i, m in enumerate(masks)]  # fmt: skip
    dev, t = pipe.family.device, {}

    def mark(name: str, t0: float) -> float:
        _sync(dev)
        now = time.perf_counter()
        t[name] = round(now - t0, 4)
        return now

    t0 = time.perf_counter()
    states = [pipe.preprocess(r) for r in reqs]
    assert all(s.path == "masked" for s in states), [s.path for s in states]
    t0 = mark("preprocess", t0)
    while not all(s.is_done for s in states):
        pipe.denoise_step(states)
    t0 = mark("steps", t0)
    images = pipe.decode_latents(states)
    t0 = mark("vae_decode", t0)
    results = [pipe.finish(s, img) for s, img in zip(states, images, strict=True)]
    mark("encode", t0)
    return {"stages_s": t, "mask_ratios": [round(r.mask_ratio, 3) for r in results]}


def _warm(pipe: EditPipeline, max_batch: int) -> float | None:
    """The worker's warm-up where serving would run one (bucket graphs), for a loop of
    `max_batch` requests (a batch of 2-4 replays buckets as it would in serving); its seconds."""
    if pipe.family.masked.graphs.capture != "buckets" or pipe.family.device.type != "cuda":
        return None
    t0 = time.perf_counter()
    warmup.warm_up(pipe, max_batch=max_batch)
    return round(time.perf_counter() - t0, 1)


def one_model(model: str, steps: int, ratio: float, execution: ExecConfig, device: str,
              kv: bool = False, batch: int = 0,
              batch_ratios: tuple[float, float] = (0.05, 0.35)) -> dict:  # fmt: skip
    pipe = EditPipeline.load(model, device=device, execution=execution)
    size = pipe.family.default_size
    image = template_image(size)
    png = encode_image(image, "png")
    mask_img = ratio_mask(size, size, ratio, pipe.family.granule)
    mask = encode_image(mask_img, "png")
    spec = TemplateSpec(image=png, prompt="a photo of a person", seed=0, num_inference_steps=steps)
    key = pipe.build_template(spec)
    rows: dict = {}

    def request(p: EditPipeline, path: str, template: str | None) -> dict:
        req = EditRequest(uid=path, image=png, mask=mask, prompt=PROMPT, seed=42,
                          num_inference_steps=steps, template_id=template,
                          paste_back=False)  # fmt: skip
        # bucket graphs come from the warm-up: kept (graphs_mode starts from none)
        keep = p.family.masked.graphs.capture == "buckets"
        with contextlib.nullcontext() if keep else graphs_mode(p, execution.cuda_graphs):
            stages = staged_run(p, req, "full" if template is None else "masked")[0]
        return {k: round(v, 4) for k, v in stages.items()}

    for _ in range(2):  # the second round is the one kept
        with stock_ops(pipe):  # (it drops every graph: NCHW weights for the stock call)
            rows["stock"] = stock_call(pipe, image, mask_img.convert("L"), steps)
    warm = {"masked": _warm(pipe, max(1, batch))}
    for _ in range(2):
        rows["full"] = request(pipe, "full", None)
        rows["masked"] = request(pipe, "masked", key)
    stock_ips = 1.0 / sum(rows["stock"].values())

    def batched(p: EditPipeline, template: str) -> dict | None:
        if not batch:
            return None
        for _ in range(2):
            out = batch_run(p, png, template, steps, batch, batch_ratios)
        total = sum(out["stages_s"].values())
        out.update(n=batch, total_s=round(total, 3), images_per_s=round(batch / total, 3),
                   stock_images_per_s=round(stock_ips, 3),
                   vs_stock=round(batch / total / stock_ips, 3))  # fmt: skip
        return out

    batches = {"masked": batched(pipe, key)}
    pipe.store.delete(key)
    if kv:  # its own template (2x the bytes: the output cache goes first) and warm-up
        pipe.family.masked.set_kv_cache(True)
        warm["masked_kv"] = _warm(pipe, max(1, batch))
        key = pipe.build_template(spec)
        for _ in range(2):
            rows["masked_kv"] = request(pipe, "masked_kv", key)
        batches["masked_kv"] = batched(pipe, key)
        pipe.store.delete(key)
        pipe.family.masked.set_kv_cache(execution.kv_cache == "on")
    totals = {k: round(sum(v.values()), 3) for k, v in rows.items()}
    result = {"model": model, "size": size, "steps": steps, "mask_ratio": ratio,
              "dtype": str(pipe.family.dtype), "stages_s": rows, "total_s": totals,
              "warm_up_s": warm, "full_vs_stock": round(totals["stock"] / totals["full"], 3),
              **{f"{k}_vs_stock": round(totals["stock"] / totals[k], 3)
                 for k in ("masked", "masked_kv") if k in totals},
              "masked_vs_full": round(totals["full"] / totals["masked"], 3),
              "batch": batches}  # fmt: skip
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
    p.add_argument(
        "--kv",
        action="store_true",
        help="also the masked path on a K/V cache (Flux: ExecConfig.kv_cache)",
    )
    p.add_argument("--batch", type=int, default=0, help="also N masked edits as one batch")
    p.add_argument(
        "--batch-ratios",
        type=float,
        nargs=2,
        default=(0.05, 0.35),
        help="the batch's mask ratios, evenly spaced from the first to the second",
    )
    p.add_argument("--out", type=Path, required=True)
    add_exec_args(p)
    args = p.parse_args()
    execution = exec_config(args)
    out = {"env": environment(torch.device(args.device), execution), "argv": sys.argv, "runs": []}
    for model in args.models:
        kv = args.kv and model.startswith("flux")
        out["runs"].append(
            one_model(
                model,
                args.steps,
                args.ratio,
                execution,
                args.device,
                kv,
                args.batch,
                tuple(args.batch_ratios),
            )
        )
        print(json.dumps(out["runs"][-1]), flush=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
