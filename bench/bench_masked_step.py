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
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from instgenie.config import ExecConfig, add_dataclass_args, dataclass_from_args  # noqa: E402
from instgenie.engine import fused_conv, fused_geglu, fused_norms  # noqa: E402
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
def graphs_mode(pipe: EditPipeline, mode: str):
    """Run with CUDA graphs in `mode` ("off" = eager), starting from no captured graphs."""
    graphs = pipe.family.masked.graphs
    saved = graphs.mode
    graphs.mode = mode
    graphs.clear()
    try:
        yield
    finally:
        graphs.mode = saved
        graphs.clear()


#: the engine's fused-kernel switches (module, class it swaps in) that stock diffusers lacks
FUSED = (fused_norms.FusedGroupNorm, fused_geglu.FusedGEGLU, fused_conv.BiasKernelConv2d)


def fused_modules(pipe: EditPipeline) -> list:
    """Every swapped-in module of FUSED in the backbone and the VAE (each has its `mode`)."""
    parts = [p for p in (pipe.family.backbone, pipe.family.vae) if p is not None]
    return [m for p in parts for m in p.modules() if isinstance(m, FUSED)]


@contextlib.contextmanager
def stock_ops(pipe: EditPipeline):
    """Stock diffusers execution: eager (text towers included), torch's GroupNorm/SiLU, GEGLU and
    conv-bias ops (every switch in FUSED off), NCHW weights (diffusers' default layout; the
    engine's UNets are channels_last on CUDA). Graphs are cleared on exit (graphs_mode), so
    none keeps pointers to the NCHW copies of the convolution weights."""
    swapped = fused_modules(pipe)
    saved = [m.mode for m in swapped]
    for m in swapped:
        m.mode = "off"
    # the text towers run their own forward too (their graphs' static inputs are inference
    # tensors: diffusers' __call__ runs under no_grad, and a replay would copy into them)
    text_graphs = [g.graphs for g in pipe.family.text_graphs.values()]
    text_saved = [g.mode for g in text_graphs]
    for g in text_graphs:
        g.mode = "off"
    backbone = pipe.family.backbone
    cl = torch.channels_last
    nhwc = any(
        p.dim() == 4 and p.is_contiguous(memory_format=cl) and not p.is_contiguous()
        for p in backbone.parameters()
    )
    try:
        if nhwc:
            backbone.to(memory_format=torch.contiguous_format)
        with graphs_mode(pipe, "off"):
            yield
    finally:
        if nhwc:
            backbone.to(memory_format=torch.channels_last)
        for m, mode in zip(swapped, saved, strict=True):
            m.mode = mode
        for g, mode in zip(text_graphs, text_saved, strict=True):
            g.mode = mode


def fused_kernels_active(pipe: EditPipeline, with_vae: bool = False) -> bool:
    """Whether the backbone (and with_vae: the VAE) runs one of the FUSED kernels anywhere
    (else "stock" columns would repeat the eager ones)."""
    parts = [pipe.family.backbone] + ([pipe.family.vae] if with_vae else [])
    return pipe.family.device.type == "cuda" and any(
        isinstance(m, FUSED) and m.mode != "off" for p in parts for m in p.modules()
    )


@contextlib.contextmanager
def identity_blocks(pipe: EditPipeline):
    """Every transformer block returns its input: what is left is the non-transformer part."""
    pipe.family.masked.graphs.clear()  # graphs captured with the real blocks must not replay
    saved = []
    for info in pipe.family.masked.blocks:
        if info.kind in ("resnet", "down", "up"):
            continue  # sparse conv blocks stay: they are the non-transformer part
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
        pipe.family.masked.graphs.clear()


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


def timed(pipe, bench, states, warmup, iters, modes) -> dict[str, float]:
    """Median step ms per CUDA-graph mode ("off" = eager; the warm-up covers the capture)."""
    out = {}
    for mode in modes:
        with graphs_mode(pipe, mode):
            out[mode] = round(bench.time_ms(states, max(warmup, 3), iters), 3)
    return out


def step_rows(pipe, bench, ratios, batches, warmup, iters, log, modes=("off", "all")):
    """ms_full / ms_masked: eager (graphs off); *_graph: CUDA graphs (if "all" in modes)."""
    rows = []
    for batch in batches:
        full = bench.states(1.0, batch, masked=False)
        f_flops, f_ms = bench.flops(full), timed(pipe, bench, full, warmup, iters, modes)
        stock_ms = None
        if fused_kernels_active(pipe):
            with stock_ops(pipe):
                stock_ms = round(bench.time_ms(full, max(warmup, 3), iters), 3)
        with identity_blocks(pipe), graphs_mode(pipe, "off"):
            rest_ms = bench.time_ms(full, warmup, iters)
        for ratio in ratios:
            masked = bench.states(ratio, batch, masked=True)
            m_flops = bench.flops(masked)
            m_ms = timed(pipe, bench, masked, warmup, iters, modes)
            row = dict(
                batch=batch, mask_ratio=ratio, token_ratio=round(bench.token_ratio(masked), 4),
                flops_full=f_flops, flops_masked=m_flops,
                flop_ratio=round(m_flops / f_flops, 4),
                ms_full=f_ms[modes[0]], ms_masked=m_ms[modes[0]],
                speedup=round(f_ms[modes[0]] / m_ms[modes[0]], 3),
                ms_non_transformer=round(rest_ms, 3),
                backend=pipe.family.masked.attention_backend or "auto",
            )  # fmt: skip
            if "all" in modes and "off" in modes:
                row.update(
                    ms_full_graph=f_ms["all"], ms_masked_graph=m_ms["all"],
                    # against the eager full path (stock diffusers) and the graphed one
                    speedup_graph_vs_eager=round(f_ms["off"] / m_ms["all"], 3),
                    speedup_graph_vs_graph=round(f_ms["all"] / m_ms["all"], 3),
                )  # fmt: skip
                if stock_ms is not None:
                    # against stock diffusers: eager, torch's GroupNorm (no fused kernels)
                    row.update(ms_full_stock=stock_ms,
                               speedup_graph_vs_stock=round(stock_ms / m_ms["all"], 3))  # fmt: skip
            if pipe.family.device.type == "cuda" and ratio in (0.2,):
                with graphs_mode(pipe, "off"):
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
    from instgenie.engine.stepbench import template_image

    png = encode_image(template_image(size), "png")
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
    variants = [(path, mode) for mode in ("off", "all") for path in ("full", "masked")]
    if fused_kernels_active(pipe, with_vae=True):
        variants.append(("full", "stock"))  # eager, torch's ops: stock diffusers
    for path, mode in variants * 2:  # the second round is the timed one
        req = EditRequest(
            uid=path, image=png, mask=mask, prompt="a red leather jacket", seed=42,
            num_inference_steps=steps, template_id=key if path == "masked" else None,
            paste_back=False,
        )  # fmt: skip
        ctx = stock_ops(pipe) if mode == "stock" else graphs_mode(pipe, mode)
        with ctx:
            results[(path, mode)] = staged_run(pipe, req, path)
    for (path, mode), (stages, _img) in results.items():
        suffix = {"off": "", "all": "_graph", "stock": "_stock"}[mode]
        out[f"s_{path}{suffix}"] = round(sum(stages.values()), 3)
        out[f"stages_{path}{suffix}"] = {k: round(v, 4) for k, v in stages.items()}
    out["speedup"] = round(out["s_full"] / out["s_masked"], 3)
    out["speedup_graph_vs_eager"] = round(out["s_full"] / out["s_masked_graph"], 3)
    out["speedup_graph_vs_graph"] = round(out["s_full_graph"] / out["s_masked_graph"], 3)
    if "s_full_stock" in out:
        out["speedup_graph_vs_stock"] = round(out["s_full_stock"] / out["s_masked_graph"], 3)
    a, b = results[("full", "off")][1], results[("masked", "all")][1]
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


def staged_run(pipe: EditPipeline, req: EditRequest, path: str):
    """One request through pre-process, every step, VAE decode and image encode; seconds per
    stage (synchronised at each boundary) and the output image."""
    dev = pipe.family.device
    t = {}

    def mark(name: str, t0: float) -> float:
        _sync(dev)
        now = time.perf_counter()
        t[name] = now - t0
        return now

    t0 = time.perf_counter()
    state = pipe.preprocess(req)
    assert state.path == path, (state.path, path)
    t0 = mark("preprocess", t0)
    while not state.is_done:
        pipe.denoise_step([state])
    t0 = mark("steps", t0)
    img = pipe.decode_latents([state])[0]
    t0 = mark("vae_decode", t0)
    res = pipe.finish(state, img)
    mark("encode", t0)
    return t, res.image


def add_exec_args(p: argparse.ArgumentParser) -> None:
    """The execution flags of config.ExecConfig (--attention-backend, --cuda-graphs, ...)."""
    add_dataclass_args(p, ExecConfig)


def exec_config(args: argparse.Namespace) -> ExecConfig:
    """The run's ExecConfig: the flags given, else their INSTGENIE_* variables (read here, once),
    else the defaults."""
    return dataclass_from_args(ExecConfig, args)


def source_commit() -> str:
    """The commit a benchmark ran: GIT_COMMIT first (the device's copy of the tree may carry a
    stale .git), else `git rev-parse HEAD`, else ""."""
    commit = os.environ.get("GIT_COMMIT", "")
    if not commit:
        try:
            git = ["git", "rev-parse", "HEAD"]
            commit = subprocess.run(git, capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return commit


def environment(device: torch.device, execution: ExecConfig | None = None) -> dict:
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
    env["commit"] = source_commit()
    # the engine's switches (kernels, graphs, layouts) this run was made with
    if execution is not None:
        env["execution"] = dataclasses.asdict(execution)
    env["flags"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("INSTGENIE_")}
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
    p.add_argument(
        "--backend",
        default=None,
        help="attention backend of the masked path (default: --attention-backend)",
    )
    p.add_argument("--graph-modes", nargs="+", default=["off", "all"],
                   help="CUDA-graph modes per row; the first gives ms_full, ms_masked")  # fmt: skip
    p.add_argument("--out", default=None)
    add_exec_args(p)
    args = p.parse_args()
    execution = exec_config(args)
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
    pipe = EditPipeline.load(args.model, device=args.device, dtype=args.dtype, execution=execution)
    _sync(dev)
    load_s = time.perf_counter() - t0
    size = args.size or pipe.family.default_size
    result = {"env": environment(dev, execution), "model": args.model, "size": size,
              "dtype": str(pipe.family.dtype), "load_s": round(load_s, 1),
              "argv": sys.argv, "steps": [], "image": None}  # fmt: skip

    def log(row):
        print(json.dumps(row), flush=True)
        out_path.write_text(json.dumps(result, indent=1))

    print(json.dumps(result["env"]), flush=True)
    pipe.family.masked.attention_backend = args.backend or execution.attention_backend
    bench = StepBench.setup(pipe, size)
    if dev.type != "cuda":
        args.graph_modes = ["off"]  # CUDA graphs need CUDA
    if args.profile and dev.type == "cuda":
        b = max(args.batches)
        for masked in (True, False):
            table = kernel_table(bench, bench.states(0.2, b, masked=masked))
            print(f"== top kernels, batch {b}, {'masked m=0.2' if masked else 'full'} ==")
            print(table, flush=True)
    result["steps"] = step_rows(pipe, bench, args.ratios, args.batches, args.warmup, args.iters,
                                lambda r: (result["steps"].append(r), log(r)),
                                tuple(args.graph_modes))  # fmt: skip
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
