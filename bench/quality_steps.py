"""Where the masked path's error comes from, by denoising step (issue 27): the masked edit with
its first k steps exact (every block computes every token, as the full path does) and the
cache read from step k on, for several k; k = num_steps leaves only the latent fill of the
unmasked region from the template's trajectory. SSIM / PSNR against the full path, after
paste-back, whole image / mask / edge band.

    python bench/quality_steps.py --model sdxl-inpaint:ref --cases 8 \
        --out docs/benchmarks/data/quality
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instgenie.engine.imageio import paste_back  # noqa: E402
from instgenie.engine.pipeline import EditPipeline  # noqa: E402
from instgenie.engine.request import EditRequest  # noqa: E402
from instgenie.engine.templates import TemplateSpec  # noqa: E402
from instgenie.reference import evaluate  # noqa: E402


def masked_with_exact_prefix(pipe: EditPipeline, req: EditRequest, k: int) -> Image.Image:
    """The masked edit, every block computing all tokens in steps < k."""
    state = pipe.preprocess(req)
    assert state.cache_handle is not None, state.notes
    every = frozenset(pipe.family.masked.block_order)
    while not state.is_done:
        pipe.prepare_reads([state])
        plan = pipe.plan_step([state], index=state.step_index)
        if state.step_index < k:
            plan = dataclasses.replace(plan, compute_all=every)
        pipe.denoise_step([state], plan)
    return pipe.postprocess([state])[0].image


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="sdxl-inpaint:ref")
    p.add_argument("--cases", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--exact", type=int, nargs="+", default=[0, 2, 5, 10, 15, 20])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    pipe = EditPipeline.load(args.model)
    rows, t0 = [], time.monotonic()
    for i, case in enumerate(evaluate.cases(args.cases)):
        image = Image.fromarray(case.image)
        mask = Image.fromarray(case.mask.astype(np.uint8) * 255)
        key = pipe.build_template(TemplateSpec(
            image=evaluate.png(case.image), prompt=case.caption, seed=evaluate.TEMPLATE_SEED,
            num_inference_steps=args.steps))  # fmt: skip
        req = EditRequest(uid=case.id, image=evaluate.png(case.image),
                          mask=evaluate.png(np.asarray(mask)), prompt=case.prompt, seed=1 + i,
                          num_inference_steps=args.steps, paste_back=False)  # fmt: skip
        full = paste_back(pipe.run([req])[0].image, image, mask)
        row = {"id": case.id, "kind": case.kind, "ratio": round(case.ratio, 4)}
        for k in args.exact:
            edit = dataclasses.replace(req, image=None, template_id=key)
            out = masked_with_exact_prefix(pipe, edit, k)
            row[str(k)] = evaluate.compare(full, paste_back(out, image, mask), case)
        pipe.store.delete(key)
        rows.append(row)
        print(json.dumps({"id": case.id, **{k: row[str(k)]["ssim"] for k in args.exact}}),
              flush=True)  # fmt: skip
    summary = {str(k): {m: round(float(np.mean([r[str(k)][m] for r in rows])), 5)
                        for m in rows[0][str(args.exact[0])]} for k in args.exact}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.model.replace(":", "-")
    record = {"model": args.model, "steps": args.steps, "exact_prefix_steps": args.exact,
              "summary": summary, "rows": rows, "torch": torch.__version__,
              "seconds": round(time.monotonic() - t0, 1),
              "command": " ".join(sys.argv)}  # fmt: skip
    (args.out / f"quality-steps-{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
