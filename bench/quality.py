"""The quality benchmark of masked execution on the reference models (issue 27): held-out
templates x masks x prompts, the masked path against the full path with the same seed, with the
activation cache in the model's dtype and in fp8; SSIM / PSNR (whole, mask, edge band, raw) and
the region classifier's prompt adherence. Writes JSON and an image grid.

    python bench/quality.py --model sdxl-inpaint:ref --cases 24 --out docs/benchmarks/data/quality
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_masked_step import source_commit  # noqa: E402
from instgenie.cache.quant import FP8  # noqa: E402
from instgenie.cache.store import InMemoryStore  # noqa: E402
from instgenie.config import ExecConfig  # noqa: E402
from instgenie.dataset import classifier  # noqa: E402
from instgenie.engine.costspec import cost_spec  # noqa: E402
from instgenie.engine.pipeline import EditPipeline  # noqa: E402
from instgenie.reference import evaluate  # noqa: E402
from instgenie.scheduler import estimate  # noqa: E402
from instgenie.scheduler.fits import Profile  # noqa: E402


def pipes_for(model: str, device: str = "cpu", profile: Path | None = None,
              sparse_convs: str = "off", margins: tuple[int, ...] = (),
              fp8: bool = True) -> dict:  # fmt: skip
    """One pipeline per cache variant, sharing one loaded family: the cache on the compute
    device in the model's dtype, the same in fp8, (with a fitted profile) the cache in host
    memory with the load planner choosing the blocks that compute every token (paper Alg. 1),
    and one per compute margin (ModelConfig.compute_margin, pixels: "margin8", ...)."""
    base = EditPipeline.load(model, device=device,
                             execution=ExecConfig(sparse_convs=sparse_convs))  # fmt: skip
    dev = base.family.device
    pipes = {"cache": base}
    if fp8:
        pipes["cache_fp8"] = EditPipeline(base.family, store=InMemoryStore(dev, dtype=FP8))
    for m in margins:
        pipes[f"margin{m}"] = EditPipeline(base.family, store=InMemoryStore(dev),
                                           compute_margin=m)  # fmt: skip
    if profile is not None:
        host = InMemoryStore("cpu", pin_memory=dev.type == "cuda")
        pipes["planner"] = EditPipeline(base.family, store=host,
                                        profile=Profile.load_file(profile))  # fmt: skip
    return pipes


def computed_ratios(pipes: dict, cases: list) -> dict:
    """Per variant, the mean fraction of each token grid (by stride, pixels) its masked path
    computes over the cases: the mask dilated by the variant's compute margin."""
    strides = sorted({b.stride for b in cost_spec(pipes["cache"]).blocks})
    out = {}
    for name, pipe in pipes.items():
        per = [estimate.token_ratios(c.mask, strides, pipe.compute_margin) for c in cases]
        out[name] = {str(s): round(float(np.mean([r[s] for r in per])), 4) for s in strides}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="sdxl-inpaint:ref")
    p.add_argument("--cases", type=int, default=24)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=None, help="default: the family's")
    p.add_argument("--max-ratio", type=float, default=0.3)
    p.add_argument("--grid-rows", type=int, default=6)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--profile", type=Path, default=None,
                   help="a fitted profile (instgenie profile): the planner variant")  # fmt: skip
    p.add_argument("--tag", default="", help="suffix of the output files' names")
    p.add_argument("--margins", type=int, nargs="*", default=[],
                   help="compute margins (pixels) to run as variants of their own")  # fmt: skip
    p.add_argument("--no-fp8", action="store_true", help="skip the fp8 cache variant")
    p.add_argument("--sparse-convs", default="off", choices=("auto", "off"),
                   help="ExecConfig.sparse_convs of the masked path (UNet families)")  # fmt: skip
    p.add_argument("--capture-prompt", default="caption", choices=evaluate.CAPTURE_PROMPTS,
                   help="what each template is captured under: its caption, its scene (the "
                   "caption without the garment's colour and pattern: decision 0056), or "
                   "empty")  # fmt: skip
    args = p.parse_args()
    pipes = pipes_for(args.model, args.device, args.profile, args.sparse_convs,
                      tuple(args.margins), not args.no_fp8)  # fmt: skip
    clf = classifier.RegionClassifier.load(classifier.DEFAULT_WEIGHTS)
    cases = evaluate.cases(args.cases, max_ratio=args.max_ratio)
    rows, outs, t0 = [], [], time.monotonic()
    for i, case in enumerate(cases):
        o = evaluate.run_case(pipes, case, args.steps, args.guidance, seed=1 + i,
                              capture=args.capture_prompt)  # fmt: skip
        rows.append(evaluate.score(o, case, clf))
        if len(outs) < args.grid_rows:
            outs.append(o)
        print(json.dumps({k: rows[-1][k] for k in ("id", "kind", "ratio")}
                         | {"ssim": rows[-1]["cache"]["ssim"]}), flush=True)  # fmt: skip
    capture = "" if args.capture_prompt == "caption" else f"-{args.capture_prompt}"
    name = evaluate.output_name(args.model, capture + args.tag)  # the caption's files keep theirs
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "model": args.model, "steps": args.steps, "guidance": args.guidance,
        "sparse_convs": args.sparse_convs, "margins": args.margins,
        "capture_prompt": args.capture_prompt,
        "token_ratios": computed_ratios(pipes, cases),
        "max_ratio": args.max_ratio, "template_seed": evaluate.TEMPLATE_SEED,
        "eval_seed": evaluate.EVAL_SEED, "band_px": evaluate.BAND,
        "summary": evaluate.summary(rows, list(pipes)), "rows": rows,
        "device": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else platform.processor() or "cpu"),
        "torch": torch.__version__, "commit": source_commit(),
        "seconds": round(time.monotonic() - t0, 1), "command": " ".join(sys.argv),
    }  # fmt: skip
    (args.out / f"quality-{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    image = evaluate.grid(cases[: len(outs)], outs, "cache")
    if image is not None:
        image.save(args.out / f"quality-grid-{name}.png")
    print(json.dumps(record["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
