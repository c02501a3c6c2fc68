"""GPU profile: where one denoising step's time goes, by kernel category, masked vs full, eager
and with CUDA graphs; and the image-level stages that are not denoising steps. Not a test.

    python bench/profile_step.py --model sdxl-inpaint:full --batches 1 8 --out $OUT/profile.json

Per (path, batch, graph mode): wall ms of one step (after warm-up; CUDA events), summed kernel ms
(torch.profiler; kernels replayed inside a CUDA graph are reported one by one), kernel count, and
per category (gemm, conv, attention, norm, index/copy, elementwise) summed ms and count, plus the
top kernels. `wall - kernel` is host/launch time not hidden behind the GPU. Stages: VAE encode
and decode of one 1024² image in the VAE's own dtype and in bfloat16, PNG encode at zlib levels.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_masked_step import (  # noqa: E402
    add_exec_args,
    environment,
    exec_config,
    graphs_mode,
)
from instgenie.engine.pipeline import EditPipeline  # noqa: E402
from instgenie.engine.stepbench import StepBench  # noqa: E402

#: first matching category wins (kernel names lower-cased)
CATEGORIES = (
    ("attention", ("varlen_attention", "fmha", "flash", "attention", "sdpa")),
    ("conv", ("conv", "implicit_convolve", "fprop", "dgrad", "winograd")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "sm90_")),
    ("norm", ("norm", "welford")),
    ("index/copy", ("index", "gather", "scatter", "copy", "cat", "memcpy", "memset", "fill")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise/other"


def profile_step(bench: StepBench, states, top: int) -> dict:
    """One warmed-up step under torch.profiler: kernel ms by category and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    wall_ms = bench.time_ms(states, 3, 5)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        bench.time_ms(states, 0, 1)
    by_cat: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.device_time <= 0:
            continue
        ms = e.device_time / 1e3
        for d, key in ((by_cat, category(e.name)), (by_name, e.name[:90])):
            d[key][0] += ms
            d[key][1] += 1
    kernel_ms = sum(v[0] for v in by_cat.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    # the torch ops that launched the kernels (eager only: a graph replay is one op)
    ops = sorted(prof.key_averages(), key=lambda a: -a.self_device_time_total)[:top]
    return {
        "wall_ms": round(wall_ms, 3),
        "kernel_ms": round(kernel_ms, 3),
        "kernels": int(sum(v[1] for v in by_cat.values())),
        "categories": {k: [round(v[0], 3), v[1]] for k, v in sorted(by_cat.items())},
        "top": [[k, round(v[0], 3), v[1]] for k, v in ranked],
        "top_ops": [
            [a.key[:60], round(a.self_device_time_total / 1e3, 3), a.count]
            for a in ops
            if a.self_device_time_total > 0
        ],  # fmt: skip
    }


def stage_times(pipe: EditPipeline, size: int, iters: int = 5) -> dict:
    """VAE encode/decode of one image in the VAE's dtype and in bfloat16; PNG encode levels."""
    from PIL import Image

    fam, out = pipe.family, {}
    sync = torch.cuda.synchronize if fam.device.type == "cuda" else (lambda: None)
    vae = fam.vae
    dev = fam.device
    dtypes = {"own": vae.dtype, "bfloat16": torch.bfloat16}
    x = torch.rand(1, 3, size, size, device=dev) * 2 - 1
    own = vae.dtype
    for label, dt in dtypes.items():
        vae.to(dt)
        for name, fn in (
            ("encode", lambda: vae.encode(x.to(dt)).latent_dist.mode()),
            ("decode", lambda: vae.decode(lat.to(dt), return_dict=False)[0]),
        ):
            if name == "encode":
                lat = fn()
            times = []
            for i in range(iters + 2):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                if i >= 2:
                    times.append(1e3 * (time.perf_counter() - t0))
            out[f"vae_{name}_{label}_ms"] = round(sorted(times)[len(times) // 2], 2)
    vae.to(own)
    noise = Image.frombytes("RGB", (size, size), os.urandom(size * size * 3))
    for level in (1, 6):
        buf = io.BytesIO()
        t0 = time.perf_counter()
        noise.save(buf, format="PNG", compress_level=level)
        out[f"png_level{level}_noise_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--modes", nargs="+", default=["off", "all"])
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    p.add_argument("--skip-stages", action="store_true")
    p.add_argument("--out", default=None)
    add_exec_args(p)
    args = p.parse_args()
    execution = exec_config(args)
    pipe = EditPipeline.load(args.model, device=args.device, dtype="auto", execution=execution)
    size = pipe.family.default_size
    bench = StepBench.setup(pipe, size)
    result = {"env": environment(pipe.family.device, execution), "model": args.model, "size": size,
              "ratio": args.ratio, "argv": sys.argv, "profiles": [], "stages": None}  # fmt: skip
    out_path = Path(args.out or Path(os.environ.get("OUT", ".")) / "profile_step.json")
    for batch in args.batches:
        for masked in (True, False):
            states = bench.states(args.ratio if masked else 1.0, batch, masked=masked)
            for mode in args.modes:
                with graphs_mode(pipe, mode):
                    row = {"batch": batch, "path": "masked" if masked else "full", "graphs": mode}
                    row.update(profile_step(bench, states, args.top))
                print(json.dumps(row), flush=True)
                result["profiles"].append(row)
                out_path.write_text(json.dumps(result, indent=1))
    if not args.skip_stages:
        result["stages"] = stage_times(pipe, size)
        print(json.dumps(result["stages"]), flush=True)
    out_path.write_text(json.dumps(result, indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
