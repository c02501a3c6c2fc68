"""GPU benchmark (issue 4): per-image latency of masked editing when the template cache lives in
pinned host memory, for four loading schemes, plus fp8 storage. Not a test.

  naive     each block's cached rows are copied on the compute stream right before the block
  strawman  block-wise pipelined loading on a copy stream, every block uses the cache
  dp        pipelined loading, the per-step planner (fitted profile) picks blocks to compute all
  ideal     the cache already resides in GPU memory

    python bench/bench_loading.py --model sdxl-inpaint:full --profile profiles/X.json
    python bench/bench_loading.py --model sdxl-inpaint:tiny --device cpu --quick   # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_masked_step import add_exec_args, environment, exec_config  # noqa: E402
from instgenie.cache.quant import FP8  # noqa: E402
from instgenie.cache.store import InMemoryStore  # noqa: E402
from instgenie.engine.costspec import model_cost_spec  # noqa: E402
from instgenie.engine.family import load_family  # noqa: E402
from instgenie.engine.imageio import encode_image  # noqa: E402
from instgenie.engine.pipeline import EditPipeline  # noqa: E402
from instgenie.engine.profiling import profile_dram_load  # noqa: E402
from instgenie.engine.quality import psnr, ssim  # noqa: E402
from instgenie.engine.request import EditRequest  # noqa: E402
from instgenie.engine.step_pricing import StepPricer  # noqa: E402
from instgenie.engine.stepbench import ratio_mask, template_image  # noqa: E402
from instgenie.engine.templates import TemplateSpec  # noqa: E402
from instgenie.scheduler.fits import Profile  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_edit(
    pipe: EditPipeline,
    key: str,
    mask: bytes,
    steps: int,
    stop_after: int | None = None,
    planner=None,  # noqa: ANN001 - batch -> compute-all block ids (a load planner), or None
) -> tuple[float, object, dict]:
    """Denoise one masked edit (to completion, or `stop_after` steps for a warm-up), each step's
    plan taking its compute-all set from `planner` when given; returns (seconds, state, stats)."""
    req = EditRequest(uid="e", image=None, template_id=key, mask=mask, prompt="a red jacket",
                      seed=42, num_inference_steps=steps, paste_back=False)  # fmt: skip
    s = pipe.preprocess(req)
    assert s.path == "masked", s.path
    ex = pipe.family.masked
    loaded, planned = 0, []
    _sync(pipe.family.device)
    t0 = time.perf_counter()
    while not s.is_done:
        if stop_after is not None and s.step_index >= stop_after:
            pipe.release(s)
            break
        pipe.prepare_reads([s])
        plan = pipe.plan_step([s])
        if planner is not None:
            plan = dataclasses.replace(plan, compute_all=planner([s]))
        pipe.denoise_step([s], plan)
        if ex.last_context is not None:
            planned.append(len(plan.compute_all))
            if ex.last_context.loader is not None:
                loaded += ex.last_context.loader.bytes_loaded
    _sync(pipe.family.device)
    return time.perf_counter() - t0, s, {"bytes_loaded": loaded, "compute_all_blocks": planned}


def _record(row: dict, name: str, state, stats: dict, ref) -> None:
    row[f"bytes_{name}"] = stats["bytes_loaded"]
    if name == "dp":
        plans = stats["compute_all_blocks"]
        row["dp_compute_all_mean"] = round(sum(plans) / max(1, len(plans)), 2)
    if ref is not None and name in ("naive", "strawman"):  # same arithmetic as ideal
        row[f"maxdiff_{name}"] = float((state.latents - ref).abs().max())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", default=None, help="fitted profile JSON for the dp scheme")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.5])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--fp8-ratio", type=float, default=0.2)
    p.add_argument("--repeats", type=int, default=1, help="interleaved runs per scheme; median")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    add_exec_args(p)
    args = p.parse_args()
    execution = exec_config(args)
    if args.quick:
        args.ratios, args.steps = [0.2], 3
    dev = torch.device(args.device)
    out_path = Path(args.out or Path(os.environ.get("OUT", ".")) / "loading.json")
    fam = load_family(args.model, device=args.device, execution=execution)
    size = fam.default_size
    ideal = EditPipeline(fam, store=InMemoryStore(dev))
    host = EditPipeline(fam, store=InMemoryStore("cpu", pin_memory=True))
    host8 = EditPipeline(fam, store=InMemoryStore("cpu", dtype=FP8, pin_memory=True))
    cost = None
    if args.profile:
        spec = model_cost_spec(fam, str(host.store_dtype()), Profile.load_file(args.profile))
        cost = StepPricer(spec, fam.device)
    ex = fam.masked
    result = {"env": environment(dev, execution), "model": args.model, "size": size,
              "steps": args.steps, "dtype": str(fam.dtype), "argv": sys.argv, "rows": [],
              "fp8": None}  # fmt: skip
    peak = profile_dram_load(dev, [64, 256])
    result["pinned_copy_gbps"] = round(peak[-1][0] / peak[-1][1] / 1e6, 2)

    def save(row=None):
        if row is not None:
            print(json.dumps(row), flush=True)
        out_path.write_text(json.dumps(result, indent=1))

    png = encode_image(template_image(size), "png")
    spec = TemplateSpec(image=png, prompt="a person", seed=0, num_inference_steps=args.steps)
    keys = {}
    for name, pipe in (("ideal", ideal), ("host", host), ("host8", host8)):
        if name == "host8" and not (args.fp8_ratio and dev.type == "cuda" or args.quick):
            continue
        t0 = time.perf_counter()
        keys[name] = pipe.build_template(spec)
        _sync(dev)
        meta = pipe.store.meta(keys[name])
        save({"capture": name, "s": round(time.perf_counter() - t0, 2), "bytes": meta.nbytes})
    schemes = [("ideal", ideal, "auto", None), ("naive", host, "naive", None),
               ("strawman", host, "pipelined", None)]  # fmt: skip
    if cost is not None:
        schemes.append(("dp", host, "pipelined", cost.compute_all))
    for ratio in args.ratios:
        mask = encode_image(ratio_mask(size, size, ratio, fam.granule), "png")
        row, ref = {"mask_ratio": ratio}, None
        times: dict[str, list[float]] = {name: [] for name, *_ in schemes}
        for rep in range(args.repeats):  # round-robin, so drift hits every scheme alike
            for name, pipe, loading, planner in schemes:
                ex.loading = loading
                key = keys["ideal" if name == "ideal" else "host"]
                if rep == 0:
                    run_edit(pipe, key, mask, args.steps, stop_after=2, planner=planner)  # warm-up
                secs, state, stats = run_edit(pipe, key, mask, args.steps, planner=planner)
                times[name].append(secs)
                if rep == 0:
                    _record(row, name, state, stats, ref)
                    ref = state.latents if ref is None else ref
        for name, ts in times.items():
            row[f"s_{name}"] = round(statistics.median(ts), 4)
            row[f"runs_{name}"] = [round(t, 4) for t in ts]
        ex.loading = "auto"
        row["dp_vs_ideal"] = round(row["s_dp"] / row["s_ideal"], 4) if "s_dp" in row else None
        result["rows"].append(row)
        save(row)

    if "host8" in keys:
        mask = encode_image(ratio_mask(size, size, args.fp8_ratio, fam.granule), "png")
        ex.loading = "pipelined"
        run_edit(host8, keys["host8"], mask, args.steps, stop_after=2)
        s8, st8, stats8 = run_edit(host8, keys["host8"], mask, args.steps)
        run_edit(host, keys["host"], mask, args.steps, stop_after=2)
        s16, st16, stats16 = run_edit(host, keys["host"], mask, args.steps)
        ex.loading = "auto"
        a, b = host.postprocess([st16])[0].image, host8.postprocess([st8])[0].image
        result["fp8"] = {
            "mask_ratio": args.fp8_ratio,
            "s_strawman_fp8": round(s8, 4),
            "s_strawman_16bit": round(s16, 4),
            "bytes_per_step_fp8": stats8["bytes_loaded"] // args.steps,
            "bytes_per_step_16bit": stats16["bytes_loaded"] // args.steps,
            "cache_bytes_fp8": host8.store.meta(keys["host8"]).nbytes,
            "cache_bytes_16bit": host.store.meta(keys["host"]).nbytes,
            "ssim_vs_16bit_cache": round(ssim(a, b), 4),
            "psnr_vs_16bit_cache": round(psnr(a, b), 2),
        }
        save(result["fp8"])
    save({"done": True})


if __name__ == "__main__":
    main()
