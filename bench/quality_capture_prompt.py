"""Experiment (issue 27, the masked path's colour against the full path's): the template captured
under another prompt. A served template is captured once under the prompt it is registered with,
and every cached row (the unmasked tokens an edit attends to) carries that prompt's meaning. The
dataset's captions name the template's garment ("a person in a pink checked dress on ..."), so
every edit that asks another garment attends to rows painted under the old garment's words.
Variants, same cases and seeds as bench/quality.py, paste-back to the edit's mask in each:

- `caption`: the template's full caption (bench/quality.py's setting);
- `scene`: the caption without the garment's colour and pattern ("a person in a dress on ..."):
  what stays in every edit of the template, what an operator would register a try-on template
  with;
- `empty`: the empty prompt (the API's default for a template);
- `scene-m8`: `scene` with an 8-pixel compute margin (decision 0050).

    python bench/quality_capture_prompt.py --model flux-fill:ref --variants caption scene empty \
        --tag=-24 --out docs/benchmarks/data/quality
    python bench/quality_capture_prompt.py --cases 48 --variants caption scene scene-m8 --out ...

Each row holds the edit's prompt and what the classifier read (colour, pattern, garment) on
every path, beside the hits.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instgenie.engine.imageio import paste_back  # noqa: E402
from instgenie.engine.templates import TemplateSpec  # noqa: E402
from instgenie.reference import evaluate  # noqa: E402

VARIANTS = ("caption", "scene", "empty", "scene-m8")


def main() -> int:
    args, pipe, clf = evaluate.experiment_setup(__doc__, "sdxl-inpaint:ref", variants=VARIANTS)
    variants, rows, t0 = tuple(args.variants), [], time.monotonic()
    for i, case in enumerate(evaluate.cases(args.cases)):
        req = evaluate.edit_request(case, args.steps, None, seed=1 + i)
        image, mask = Image.fromarray(case.image), Image.fromarray(case.mask.astype(np.uint8) * 255)
        full = paste_back(pipe.run([req])[0].image, image, mask)
        row = {"id": case.id, "kind": case.kind, "ratio": round(case.ratio, 4),
               "prompt": case.prompt, "full": evaluate.adherence(clf, full, case),
               "full_read": clf.predict(np.asarray(full), case.garment & case.mask)}  # fmt: skip
        prompts = {v: evaluate.capture_prompt(case, v.removesuffix("-m8")) for v in variants}
        for name in variants:
            pipe.compute_margin = 8 if name.endswith("-m8") else 0
            key = pipe.build_template(TemplateSpec(image=evaluate.png(case.image),
                                                   prompt=prompts[name],
                                                   seed=evaluate.TEMPLATE_SEED,
                                                   num_inference_steps=args.steps))  # fmt: skip
            res = pipe.run([replace(req, image=None, template_id=key)])[0]
            if res.path != "masked":
                raise RuntimeError(f"case {case.id}: the edit ran {res.path} "
                                   f"({res.fallback_reason})")  # fmt: skip
            out = paste_back(res.image, image, mask)
            read = clf.predict(np.asarray(out), case.garment & case.mask)
            row[name] = {**evaluate.compare(full, out, case), "capture_prompt": prompts[name],
                         "adherence": evaluate.adherence(clf, out, case), "read": read}  # fmt: skip
            pipe.store.delete(key)
        rows.append(row)
        print(json.dumps({"id": case.id, "kind": case.kind, "full": row["full"]["colour"],
                          **{v: row[v]["adherence"]["colour"] for v in variants}}),
              flush=True)  # fmt: skip
    summary = {v: {t: round(float(np.mean([r[v]["adherence"][t] if v != "full" else r[v][t]
                                           for r in rows])), 4)
                   for t in ("colour", "pattern", "both")}
               for v in ("full", *variants)}  # fmt: skip
    for v in variants:
        for m in ("ssim", "ssim_mask", "psnr_mask"):
            summary[v][m] = round(float(np.mean([r[v][m] for r in rows])), 5)
    evaluate.write_experiment(args.out, "capture-prompt", args, rows, summary,
                              time.monotonic() - t0)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
