"""Prompt adherence of the masked path with and without a context region (EditRequest.
context_mask, decision 0047), against the full path, on a reference model's held-out edits.

Each case (evaluate.cases: garment / rect / brush masks, ratio <= 0.3) runs the full path, the
masked path, and the masked path with the scene's whole garment as its context region (its
tokens computed with the edit's prompt, not edited); all pasted back with the edit's mask and
scored by the region classifier (colour, pattern) in the garment pixels inside the mask, plus
SSIM against the full path and the share of tokens each masked variant computed.

    python bench/context_region.py --model sdxl-inpaint:ref --cases 24 \\
        --out docs/benchmarks/data/reference/context-sdxl.json
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
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instgenie.dataset import classifier  # noqa: E402
from instgenie.engine.imageio import paste_back  # noqa: E402
from instgenie.engine.pipeline import EditPipeline  # noqa: E402
from instgenie.engine.quality import ssim  # noqa: E402
from instgenie.engine.templates import TemplateSpec  # noqa: E402
from instgenie.reference import evaluate  # noqa: E402

VARIANTS = ("full", "masked", "context")


def run_case(pipe: EditPipeline, case: evaluate.Case, steps: int, seed: int) -> dict:
    image, mask = Image.fromarray(case.image), Image.fromarray(case.mask.astype(np.uint8) * 255)
    req = evaluate.edit_request(case, steps, None, seed)
    spec = TemplateSpec(image=evaluate.png(case.image), prompt=case.caption,
                        seed=evaluate.TEMPLATE_SEED, num_inference_steps=steps)  # fmt: skip
    key = pipe.build_template(spec)
    garment = evaluate.png((case.garment | case.mask).astype(np.uint8) * 255)
    reqs = {
        "full": req,
        "masked": dataclasses.replace(req, image=None, template_id=key),
        "context": dataclasses.replace(req, image=None, template_id=key, context_mask=garment),
    }
    out, tokens = {}, {}
    for name, r in reqs.items():
        state = pipe.preprocess(r)
        if name != "full" and state.path.value != "masked":
            raise RuntimeError(f"{case.id}: {name} ran {state.path} ({state.notes})")
        if state.token_index is not None:
            L = max(state.token_index)
            tokens[name] = round(state.token_index[L].numel() / L, 4)
        while not state.is_done:
            pipe.denoise_step([state])
        img = pipe.decode_latents([state])[0]
        out[name] = paste_back(img, image, mask)
    pipe.store.delete(key)
    return {"images": out, "tokens": tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="sdxl-inpaint:ref")
    p.add_argument("--cases", type=int, default=24)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pipe = EditPipeline.load(args.model, device=args.device)
    clf = classifier.RegionClassifier.load(classifier.DEFAULT_WEIGHTS)
    rows = []
    t0 = time.perf_counter()
    for i, case in enumerate(evaluate.cases(args.cases)):
        res = run_case(pipe, case, args.steps, seed=1 + i)
        row = {"id": case.id, "kind": case.kind, "ratio": round(case.ratio, 4),
               "garment_ratio": round(float((case.garment | case.mask).mean()), 4),
               "tokens": res["tokens"]}  # fmt: skip
        for name, img in res["images"].items():
            row[name] = evaluate.adherence(clf, img, case)
            if name != "full":
                row[f"ssim_{name}"] = round(ssim(res["images"]["full"], img), 5)
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {v: evaluate.accuracy([r[v] for r in rows]) for v in VARIANTS}
    for kind in sorted({r["kind"] for r in rows}):
        sel = [r for r in rows if r["kind"] == kind]
        summary[f"by_kind/{kind}"] = {v: evaluate.accuracy([r[v] for r in sel]) for v in VARIANTS}
    summary["ssim_mean"] = {v: round(float(np.mean([r[f"ssim_{v}"] for r in rows])), 5)
                            for v in VARIANTS[1:]}  # fmt: skip
    summary["tokens_mean"] = {v: round(float(np.mean([r["tokens"][v] for r in rows])), 4)
                              for v in VARIANTS[1:]}  # fmt: skip
    out = {"model": args.model, "cases": args.cases, "steps": args.steps,
           "device": args.device, "host": platform.machine(), "torch": torch.__version__,
           "wall_s": round(time.perf_counter() - t0, 1), "summary": summary,
           "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
