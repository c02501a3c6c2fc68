"""GPU benchmark: one denoising step, masked vs full, over mask ratios and batch sizes; where the
time goes; image-level latency and quality of masked vs full edits. Not a test.

    python bench/bench_masked_step.py --model sdxl-inpaint:full --out $OUT/sdxl.json
    python bench/bench_masked_step.py --model sdxl-inpaint:tiny --device cpu --quick   # smoke run

Per (ratio, batch): counted FLOPs and median step latency of the full path and of the masked path
with the template cache resident in GPU memory (the ideal case of paper §6.3). Attribution at
m = 0.2: the step with every transformer block replaced by identity (= the non-transformer part),
and the GPU busy fraction of the masked step from torch.profiler (1 - busy = launch/host gaps).
Image level: pre-process + N steps + post-process, masked vs full, with SSIM/PSNR of the outputs
for edits whose prompt and seed differ from the template's (random weights: labelled as such).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from instgenie.engine.imageio import encode_image  # noqa: E402
from instgenie.engine.pipeline import EditPipeline  # noqa: E402
from instgenie.engine.quality import psnr, ssim  # noqa: E402
from instgenie.engine.request import EditRequest  # noqa: E402
from instgenie.engine.stepbench import StepBench, ratio_mask  # noqa: E402
from instgenie.engine.templates import TemplateSpec  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def identity_blocks(pipe: EditPipeline):
    """Every transformer block returns its input: what is left is the non-transformer part."""
    saved = []
    for info in pipe.family.masked.blocks:
        mod = pipe.family.backbone.get_submodule(info.name)
        saved.append((mod, mod.forward))
        if info.kind == "unet":
            mod.forward = lambda hidden_states, *a, **k: hidden_states
        else:
            mod.forward = lambda hidden_states, encoder_hidden_states, *a, **k: (
                encoder_hidden_states,
                hidden_states,
            )
    try:
        yield
    finally:
        for mod, fwd in saved:
            mod.forward = fwd


def busy_fraction(bench: StepBench, states) -> float:
    """GPU kernel time / wall time of one step (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    bench.time_ms(states, 1, 1)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        bench.pipe.denoise_step(states)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernel_us = sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA")
    bench.time_ms(states, 0, 1)  # restores the states
    return min(1.0, kernel_us / 1e6 / wall)


def kernel_table(bench: StepBench, states, rows: int = 25) -> str:
    """torch.profiler's top CUDA kernels of one step (after a warm-up step)."""
    from torch.profiler import ProfilerActivity, profile

    bench.time_ms(states, 1, 1)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        bench.pipe.denoise_step(states)
        torch.cuda.synchronize()
    bench.time_ms(states, 0, 1)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def step_rows(pipe, bench, ratios, batches, warmup, iters, log):
    rows = []
    for batch in batches:
        full = bench.states(1.0, batch, masked=False)
        f_flops, f_ms = bench.flops(full), bench.time_ms(full, warmup, iters)
        with identity_blocks(pipe):
            rest_ms = bench.time_ms(full, warmup, iters)
        for ratio in ratios:
            masked = bench.states(ratio, batch, masked=True)
            m_flops = bench.flops(masked)
            m_ms = bench.time_ms(masked, warmup, iters)
            row = dict(
                batch=batch, mask_ratio=ratio, token_ratio=round(bench.token_ratio(masked), 4),
                flops_full=f_flops, flops_masked=m_flops,
                flop_ratio=round(m_flops / f_flops, 4),
                ms_full=round(f_ms, 3), ms_masked=round(m_ms, 3),
                speedup=round(f_ms / m_ms, 3), ms_non_transformer=round(rest_ms, 3),
                backend=pipe.family.masked.attention_backend or "auto",
            )  # fmt: skip
            if pipe.family.device.type == "cuda" and ratio in (0.2,):
                row["gpu_busy_masked"] = round(busy_fraction(bench, masked), 3)
                row["gpu_busy_full"] = round(busy_fraction(bench, full), 3)
            rows.append(row)
            log(row)
            del masked
        del full
    return rows


def image_level(pipe, size, ratio, steps, log):
    """End-to-end single-request latency masked vs full, and SSIM/PSNR between the outputs."""
    dev = pipe.family.device
    from instgenie.engine.stepbench import _template_image

    png = encode_image(_template_image(size), "png")
    t0 = time.perf_counter()
    key = pipe.build_template(
        TemplateSpec(image=png, prompt="a photo of a person", seed=0, num_inference_steps=steps)
    )
    _sync(dev)
    capture_s = time.perf_counter() - t0
    mask = encode_image(ratio_mask(size, size, ratio, pipe.family.granule), "png")
    out = {"steps": steps, "mask_ratio": ratio, "capture_s": round(capture_s, 3),
           "cache_bytes": pipe.store.meta(key).nbytes}  # fmt: skip
    results = {}
    for path in ("full", "masked", "full", "masked"):  # second round is the timed one
        req = EditRequest(
            uid=path, image=png, mask=mask, prompt="a red leather jacket", seed=42,
            num_inference_steps=steps, template_id=key if path == "masked" else None,
            paste_back=False,
        )  # fmt: skip
        _sync(dev)
        t0 = time.perf_counter()
        res = pipe.run([req])[0]
        _sync(dev)
        assert res.path == path, (res.path, path)
        results[path] = (time.perf_counter() - t0, res.image)
    out["s_full"] = round(results["full"][0], 3)
    out["s_masked"] = round(results["masked"][0], 3)
    out["speedup"] = round(results["full"][0] / results["masked"][0], 3)
    a, b = results["full"][1], results["masked"][1]
    out["ssim_raw"], out["psnr_raw"] = round(ssim(a, b), 4), round(psnr(a, b), 2)
    from instgenie.config import LimitsConfig
    from instgenie.engine.imageio import decode_image, decode_mask, paste_back

    orig = decode_image(png, LimitsConfig())
    m = decode_mask(mask, orig.size, LimitsConfig())
    pa, pb = paste_back(a, orig, m), paste_back(b, orig, m)
    out["ssim_pasted"], out["psnr_pasted"] = round(ssim(pa, pb), 4), round(psnr(pa, pb), 2)
    log(out)
    pipe.store.delete(key)
    return out


def environment(device: torch.device) -> dict:
    import diffusers
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    commit = os.environ.get("GIT_COMMIT", "")
    try:
        git = ["git", "rev-parse", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True).stdout.strip() or commit
    except OSError:
        pass
    env["commit"] = commit
    return env


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--size", type=int, default=None)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.35, 0.5, 1.0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--image-steps", type=int, default=50, help="steps of the image-level run")
    p.add_argument("--image-ratio", type=float, default=0.2)
    p.add_argument("--skip-image", action="store_true")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 ratios, batch 1-2, 3 steps")
    p.add_argument("--profile", action="store_true", help="print top kernels at m=0.2, max batch")
    p.add_argument("--backend", default=None, help="attention backend of the masked path")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.quick:
        args.ratios, args.batches, args.warmup, args.iters, args.image_steps = (
            [0.2, 1.0],
            [1, 2],
            1,
            2,
            3,
        )

    dev = torch.device(args.device)
    out_path = Path(
        args.out
        or Path(os.environ.get("OUT", ".")) / f"masked_step_{args.model.replace(':', '_')}.json"
    )
    t0 = time.perf_counter()
    pipe = EditPipeline.load(args.model, device=args.device, dtype=args.dtype)
    _sync(dev)
    load_s = time.perf_counter() - t0
    size = args.size or pipe.family.default_size
    result = {"env": environment(dev), "model": args.model, "size": size,
              "dtype": str(pipe.family.dtype), "load_s": round(load_s, 1),
              "argv": sys.argv, "steps": [], "image": None}  # fmt: skip

    def log(row):
        print(json.dumps(row), flush=True)
        out_path.write_text(json.dumps(result, indent=1))

    print(json.dumps(result["env"]), flush=True)
    pipe.family.masked.attention_backend = args.backend
    bench = StepBench.setup(pipe, size)
    if args.profile and dev.type == "cuda":
        b = max(args.batches)
        for masked in (True, False):
            table = kernel_table(bench, bench.states(0.2, b, masked=masked))
            print(f"== top kernels, batch {b}, {'masked m=0.2' if masked else 'full'} ==")
            print(table, flush=True)
    result["steps"] = step_rows(pipe, bench, args.ratios, args.batches, args.warmup, args.iters,
                                lambda r: (result["steps"].append(r), log(r)))  # fmt: skip
    pipe.store.delete(bench.template_key)
    if not args.skip_image:
        steps = args.image_steps
        if dev.type == "cuda":  # the whole template cache must fit next to the model
            per_step = pipe.store.nbytes  # 0 now; measure from a 1-step capture instead
            free = torch.cuda.mem_get_info(dev)[0]
            probe = StepBench.setup(pipe, size)
            per_step = pipe.store.meta(probe.template_key).nbytes / 2  # BENCH_STEPS = 2
            pipe.store.delete(probe.template_key)
            steps = max(1, min(steps, int(0.8 * free / per_step)))
        result["image"] = image_level(pipe, size, args.image_ratio, steps, log)
    log({"done": True})
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
