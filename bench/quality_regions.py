"""Experiment (issue 27, where the masked path's colour error sits): the masked path with its
computed region widened to the template's whole garment (the dataset's ground-truth garment
pixels, united with the edit's mask) against the plain masked path and the full path, same seeds
and cases as bench/quality.py. If the wrong colours come from the old garment's cached features
beside the new region, computing the whole garment under the edit's prompt brings them back.
Paste-back keeps only the edit's mask in every variant.

    python bench/quality_regions.py --model flux-fill:ref --out docs/benchmarks/data/quality

The widening is applied where the pipeline turns the pixel mask into token masks (the family's
`token_masks`), the same place as the compute margin (decision 0050): an experiment, not a
serving feature (a served template has no garment segmentation today).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instgenie.engine.imageio import paste_back  # noqa: E402
from instgenie.engine.templates import TemplateSpec  # noqa: E402
from instgenie.reference import evaluate  # noqa: E402


def main() -> int:
    args, pipe, clf = evaluate.experiment_setup(__doc__, "sdxl-inpaint:ref")
    token_masks, widen = pipe.family.token_masks, [None]

    def widened(mask: torch.Tensor) -> dict:
        return token_masks(mask if widen[0] is None else torch.maximum(mask, widen[0]))

    pipe.family.token_masks = widened  # this process's pipeline only
    rows, t0 = [], time.monotonic()
    for i, case in enumerate(evaluate.cases(args.cases)):
        req = evaluate.edit_request(case, args.steps, None, seed=1 + i)
        image, mask = Image.fromarray(case.image), Image.fromarray(case.mask.astype(np.uint8) * 255)
        full = paste_back(pipe.run([req])[0].image, image, mask)
        key = pipe.build_template(TemplateSpec(image=evaluate.png(case.image), prompt=case.caption,
                                               seed=evaluate.TEMPLATE_SEED,
                                               num_inference_steps=args.steps))  # fmt: skip
        row = {"id": case.id, "kind": case.kind, "ratio": round(case.ratio, 4),
               "garment_ratio": round(float((case.garment | case.mask).mean()), 4),
               "full": evaluate.adherence(clf, full, case)}  # fmt: skip
        garment = torch.from_numpy(case.garment).float()[None, None].to(pipe.family.device)
        for name, region in (("masked", None), ("garment", garment)):
            widen[0] = region
            res = pipe.run([replace(req, image=None, template_id=key)])[0]
            out = paste_back(res.image, image, mask)
            row[name] = {**evaluate.compare(full, out, case),
                         "adherence": evaluate.adherence(clf, out, case)}  # fmt: skip
        widen[0] = None
        pipe.store.delete(key)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("id", "kind")}), flush=True)
    summary = {v: {t: round(float(np.mean([r[v]["adherence"][t] if v != "full" else r[v][t]
                                           for r in rows])), 4)
                   for t in ("colour", "pattern", "both")}
               for v in ("full", "masked", "garment")}  # fmt: skip
    for v in ("masked", "garment"):
        summary[v]["ssim_mask"] = round(float(np.mean([r[v]["ssim_mask"] for r in rows])), 5)
    evaluate.write_experiment(args.out, "regions", args, rows, summary, time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
