"""GPU benchmark: the per-request stages around the denoise loop, and the VAE's precision/layout.

Times, for one family at one resolution (median of `--iters` after warm-up, synchronised host
clock): the prompt encode with eager and CUDA-graphed text towers (and whether they agree
exactly), the adapter's whole `prepare` with the prompt cache warm and off, its
`decode`, the VAE encode of one image, the VAE decode of 1 and 4 latents, the tensor -> PIL
conversion (diffusers' image processor and the adapter's device-side form) and the PNG/JPEG
encode. The VAE parts run once per variant (dtype x
memory format); each variant's decode is compared with the float32 NCHW one (PSNR of the 8-bit
images, max 8-bit difference, NaN count) and its encode with float32's latent mean (relative
error). Not a test.

    python bench/bench_stages.py --model sdxl-inpaint:full --out X.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_masked_step import add_exec_args, environment, exec_config  # noqa: E402
from instgenie.engine.family import load_family  # noqa: E402
from instgenie.engine.imageio import encode_image  # noqa: E402
from instgenie.engine.request import EditRequest  # noqa: E402
from instgenie.engine.stepbench import template_image  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], iters: int, warmup: int = 2) -> tuple[float, object]:
    """(median ms, last result) of fn(), synchronised around each call."""
    out = None
    for _ in range(warmup):
        out = fn()
    sync()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn()
        sync()
        ms.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ms), out


def psnr8(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def to_uint8(img: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) in [-1, 1] -> uint8 (B, H, W, 3), the image processor's rounding."""
    x = (img.float() / 2 + 0.5).clamp(0, 1)
    return (x.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype("uint8")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="sdxl-inpaint:full")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="")
    add_exec_args(ap)
    args = ap.parse_args()
    execution = exec_config(args)
    dev = torch.device(args.device)
    fam = load_family(args.model, device=args.device, parts="stages", execution=execution)
    pipe, vae = fam.pipe, fam.vae
    report: dict = {"env": environment(dev, execution), "model": args.model, "size": args.size}
    req = EditRequest(uid="b", image=b"", mask=b"", prompt="a red jacket with gold buttons")

    # ---- prompt encode (the encoders themselves: prompt cache off), eager and graphed towers ----
    capacity, fam.prompts.capacity = fam.prompts.capacity, 0
    if hasattr(fam, "encode_prompt"):
        cfg = fam.uses_cfg(fam.default_guidance)

        def encode() -> object:
            return fam.encode_prompt(req, cfg, args.size, args.size)
    else:  # flux: the pipeline's own encode_prompt (CLIP + T5)

        def encode() -> object:
            return pipe.encode_prompt(
                prompt=req.prompt, prompt_2=None, device=dev, max_sequence_length=fam.text_len
            )

    with torch.inference_mode():
        for mode in ("off", "all"):  # text-encoder graphs off (eager towers), then on
            for wrapped in fam.text_graphs.values():
                wrapped.graphs.mode = mode
            if mode == "off":
                report["prompt_encode_eager_ms"], eager_out = timed(encode, args.iters)
                continue
            # graphed: a shape's first call warms up, captures and replays; the graphs' pools
            # stay reserved (empty_cache cannot release them)
            if dev.type == "cuda":
                sync()
                torch.cuda.empty_cache()
                reserved = torch.cuda.memory_reserved(dev)
            report["prompt_encode_first_call_ms"] = timed(encode, 1, 0)[0]
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                report["text_graphs_reserved_mib"] = (
                    torch.cuda.memory_reserved(dev) - reserved
                ) / 2**20
            report["prompt_encode_ms"], out = timed(encode, args.iters, 0)
    report["text_encoder_graphs"] = {k: dict(w.counters) for k, w in fam.text_graphs.items()}
    flat_a, flat_b = (torch.utils._pytree.tree_leaves(o) for o in (eager_out, out))
    pairs = [(a, b) for a, b in zip(flat_a, flat_b, strict=True) if torch.is_tensor(a)]
    report["prompt_encode_graph_equal"] = all(torch.equal(a, b) for a, b in pairs)
    report["prompt_encode_graph_max_abs_diff"] = max(
        float((a.float() - b.float()).abs().max()) for a, b in pairs
    )
    fam.prompts.capacity = capacity

    # ---- the whole pre-process model half (prompt, VAE encode, noise), as loaded ----
    image = template_image(args.size)
    mask = Image.new("L", image.size, 0)
    mask.paste(255, (0, 0, args.size // 2, args.size // 2))
    with torch.inference_mode():
        # prompt cache warm (every call after the first hits) and off
        report["prepare_ms_prompt_hit"], state = timed(
            lambda: fam.prepare(req, image, mask, args.size, args.size), args.iters
        )
        capacity, fam.prompts.capacity = fam.prompts.capacity, 0
        fam.prompts.clear()
        report["prepare_ms_prompt_miss"], _ = timed(
            lambda: fam.prepare(req, image, mask, args.size, args.size), args.iters
        )
        fam.prompts.capacity = capacity
        report["decode_adapter_ms"], _ = timed(lambda: fam.decode([state]), args.iters)
    report["vae_as_loaded"] = str(vae.dtype)

    # ---- image side: VAE variants ----
    pixels = pipe.image_processor.preprocess(image, height=args.size, width=args.size).to(dev)
    g = torch.Generator(device="cpu")
    lat_shape = None
    variants, ref_img, ref_lat = [], None, None
    for dname in args.dtypes:
        for lname in args.layouts:
            vae.to(dtype=DTYPES[dname], memory_format=LAYOUTS[lname])
            x = pixels.to(DTYPES[dname]).contiguous(memory_format=LAYOUTS[lname])
            with torch.inference_mode():
                enc_ms, dist = timed(lambda x=x: vae.encode(x).latent_dist, args.iters)
                lat = dist.mode().float()
                lat_shape = tuple(lat.shape)
                z = torch.randn(lat_shape, generator=g.manual_seed(1)).to(dev)
                z4 = torch.randn((4, *lat_shape[1:]), generator=g.manual_seed(2)).to(dev)
                zs = {1: z, 4: z4}
                dec = {}
                for b, zb in zs.items():
                    zb = zb.to(DTYPES[dname]).contiguous(memory_format=LAYOUTS[lname])
                    dec[b], img = timed(
                        lambda zb=zb: vae.decode(zb, return_dict=False)[0], args.iters
                    )
                    if b == 1:
                        img1 = img
            u8 = to_uint8(img1)
            row = {
                "dtype": dname,
                "layout": lname,
                "encode_ms": enc_ms,
                "decode_ms_b1": dec[1],
                "decode_ms_b4": dec[4],
                "decode_nan": int(torch.isnan(img1).sum()),
            }
            if ref_img is None:
                ref_img, ref_lat = u8, lat
            else:
                row["decode_psnr_db"] = psnr8(u8, ref_img)
                row["decode_max_diff_8bit"] = int(
                    np.abs(u8.astype(int) - ref_img.astype(int)).max()
                )
                row["encode_rel_err"] = float((lat - ref_lat).norm() / ref_lat.norm())
            variants.append(row)
            print(json.dumps(row), flush=True)
    report["vae"] = variants
    report["latent_shape"] = lat_shape

    # ---- post: tensor -> PIL, image encode ----
    img = torch.rand(1, 3, args.size, args.size, device=dev) * 2 - 1
    report["to_pil_ms"], pil = timed(
        lambda: pipe.image_processor.postprocess(img, output_type="pil")[0], args.iters
    )
    report["to_pil_device_ms"], _ = timed(lambda: fam.to_pil(img)[0], args.iters)
    smooth = template_image(args.size)
    for fmt in ("png", "jpeg"):
        report[f"{fmt}_encode_noise_ms"], _ = timed(lambda f=fmt: encode_image(pil, f), args.iters)
        report[f"{fmt}_encode_smooth_ms"], _ = timed(
            lambda f=fmt: encode_image(smooth, f), args.iters
        )
    print(json.dumps({k: v for k, v in report.items() if k not in ("vae", "env")}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
