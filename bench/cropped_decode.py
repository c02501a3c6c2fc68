"""Cropped VAE decode on the reference models (decision 0044): in-mask PSNR of the crop's pixels
against the whole-image decode of the same latents, by margin and by how far the edit moved the
decoder's statistics; and CPU costs of the VAE's encode, decode, its prefix and cropped suffix.

Each case: a held-out scene captured as a template (its caption, TEMPLATE_SEED, no mask), a
masked edit of it (its own prompt and seed, `--steps`), and latents between the template's final
latents and the edit's, z = zt + lambda (z_edit - zt) (lambda 0: a replay; 1: the edit itself).
Masks: the first `--cases` evaluate.cases (garment / rect / brush, ratio <= 0.3) and one
rectangle touching the left and bottom borders. PSNR over the mask's pixels, float images in
[0, 1], whole decode as the reference; the crop's rest normalised with the template's
statistics (crop_forward.decode_suffix_crop), whatever the guard would decide.

    python bench/cropped_decode.py --out docs/benchmarks/data/cropped-decode.json
    python bench/cropped_decode.py --device cuda --quality-models --cost-models \
        sdxl-inpaint:full@1024 flux-fill:full@1024 --out $OUT/cropped-decode-gpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instgenie.engine import crop_forward as cf  # noqa: E402
from instgenie.engine.cropped_decode import crop_box  # noqa: E402
from instgenie.engine.pipeline import EditPipeline  # noqa: E402
from instgenie.engine.templates import TemplateSpec  # noqa: E402
from instgenie.reference import evaluate  # noqa: E402

LAMBDAS = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0)
MARGINS = (0, 1, 2, 4)


def border_case(case: evaluate.Case) -> evaluate.Case:
    """`case` with a rectangle on its left and bottom borders as the mask (ratio 0.175)."""
    s = case.mask.shape[0]
    mask = np.zeros_like(case.mask)
    mask[s // 2 :, : int(0.35 * s)] = True
    return dataclasses.replace(case, id=case.id + "-border", mask=mask, kind="border",
                               ratio=float(mask.mean()))  # fmt: skip


def edit_latents(pipe: EditPipeline, case: evaluate.Case, steps: int, seed: int):
    """(the working state of a masked edit of the case's template, its final latents, the
    template's final latents)."""
    spec = TemplateSpec(image=evaluate.png(case.image), prompt=case.caption,
                        seed=evaluate.TEMPLATE_SEED, num_inference_steps=steps)  # fmt: skip
    key = pipe.build_template(spec)
    req = dataclasses.replace(evaluate.edit_request(case, steps, None, seed), image=None,
                              template_id=key, paste_back=True)  # fmt: skip
    state = pipe.preprocess(req)
    assert state.path == "masked", state.notes.fallback_reason
    template = state.cache_handle.latents(state.num_steps - 1).clone()
    while not state.is_done:
        pipe.denoise_step([state])
    pipe.store.delete(key)
    return state, state.latents, template


def decoder_input(pipe: EditPipeline, state, latents: torch.Tensor) -> torch.Tensor:
    fam = pipe.family
    vae = fam.vae
    if state.size is not None:  # flux: packed
        h, w = state.size
        latents = fam.pipe._unpack_latents(latents, h, w, fam.pipe.vae_scale_factor)
        return (latents / vae.config.scaling_factor + vae.config.shift_factor).to(vae.dtype)
    return (latents / vae.config.scaling_factor).to(vae.dtype)


def psnr_in(a: torch.Tensor, b: torch.Tensor, region: np.ndarray) -> float:
    d = ((a.double() + 1) / 2).clamp(0, 1) - ((b.double() + 1) / 2).clamp(0, 1)
    mse = float((d[0] ** 2).mean(0)[torch.from_numpy(region)].mean())
    return float("inf") if mse == 0 else 10 * np.log10(1 / mse)


def quality(model: str, cases: int, steps: int) -> list[dict]:
    pipe = EditPipeline.load(model)
    vae, scale = pipe.family.vae, pipe.family.pipe.vae_scale_factor
    chosen = evaluate.cases(cases)
    rows = []
    for i, case in enumerate([*chosen, border_case(chosen[0])]):
        state, z_edit, z_tmpl = edit_latents(pipe, case, steps, seed=1 + i)
        with torch.inference_mode():
            ze, zt = decoder_input(pipe, state, z_edit), decoder_input(pipe, state, z_tmpl)
            _, template = cf.record_decode(vae, zt)
            for lam in LAMBDAS:
                z = zt + lam * (ze - zt)
                whole = vae.decode(z, return_dict=False)[0]
                x, prefix = cf.decode_prefix(vae, z)
                row = {"model": model, "case": case.id, "kind": case.kind,
                       "mask_ratio": round(case.ratio, 4), "lambda": lam,
                       "deviation": round(cf.deviation(template, prefix), 5)}  # fmt: skip
                for m in MARGINS:
                    box = crop_box(state, tuple(z.shape[-2:]), scale, m)
                    crop = cf.decode_suffix_crop(vae, x, box, template)
                    out = whole.clone()
                    rows_px, cols_px = (
                        slice(box.y0 * scale, box.y1 * scale),
                        slice(box.x0 * scale, box.x1 * scale),
                    )
                    out[..., rows_px, cols_px] = crop
                    row[f"psnr_m{m}"] = round(psnr_in(out, whole, case.mask), 2)
                    row[f"crop_fraction_m{m}"] = round(box.area / (box.height * box.width), 4)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _median_ms(fn, repeat: int, device: torch.device) -> float:
    """Median wall ms of fn() (synchronised on CUDA) after one warm-up call."""

    def timed() -> float:
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    timed()
    return 1e3 * sorted(timed() for _ in range(repeat))[repeat // 2]


def costs(model: str, side: int, repeat: int, device: str = "cpu") -> dict:
    pipe = EditPipeline.load(model, device=device)
    dev = pipe.family.device
    vae, scale = pipe.family.vae, pipe.family.pipe.vae_scale_factor
    h = side // scale
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(1, vae.config.latent_channels, h, h, generator=gen).to(dev, vae.dtype)
    image = (torch.rand(1, 3, side, side, generator=gen) * 2 - 1).to(dev, vae.dtype)

    def ms(fn) -> float:
        return _median_ms(fn, repeat, dev)

    with torch.inference_mode():
        _, state = cf.record_decode(vae, z)
        x, _ = cf.decode_prefix(vae, z)
        row = {"model": model, "side": side, "dtype": str(vae.dtype), "device": str(dev),
               "encode_ms": ms(lambda: vae.encode(image)),
               "decode_ms": ms(lambda: vae.decode(z)),
               "prefix_ms": ms(lambda: cf.decode_prefix(vae, z)),
               "suffix_whole_ms": ms(lambda: cf.decode_suffix_whole(vae, x))}  # fmt: skip
        for f in (0.1, 0.25, 0.5, 0.75, 1.0):
            s = max(1, round(h * f**0.5))
            box = cf.Box(0, s, 0, s, h, h)
            row[f"suffix_crop_{f}_ms"] = ms(lambda b=box: cf.decode_suffix_crop(vae, x, b, state))
    row = {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["sdxl-inpaint:ref", "flux-fill:ref"])
    p.add_argument("--cases", type=int, default=6)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="where the cost rows run (quality: CPU)")
    p.add_argument(
        "--quality-models",
        nargs="*",
        default=None,
        help="models of the quality rows (default: --models; none: skip them)",
    )
    p.add_argument(
        "--cost-models",
        nargs="+",
        default=None,
        metavar="MODEL@SIDE",
        help="cost rows (default: --models at 256 px, sdxl tiny@128 and ref@512)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = {"host": platform.processor() or platform.machine(), "threads": args.threads,
           "torch": torch.__version__, "steps": args.steps, "quality": [], "costs": []}  # fmt: skip
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    cost_rows = args.cost_models or [
        *(f"{m}@256" for m in args.models),
        "sdxl-inpaint:tiny@128",
        "sdxl-inpaint:ref@512",
    ]
    for spec in cost_rows:
        model, side = spec.rsplit("@", 1)
        out["costs"].append(costs(model, int(side), args.repeat, args.device))
    for model in args.models if args.quality_models is None else args.quality_models:
        out["quality"] += quality(model, args.cases, args.steps)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
