"""Quality of the K/V cache (ExecConfig.kv_cache, decision 0052; issue 28 item 4) against the
output cache, both against the full path.

With an output cache a masked step recomputes, in every Flux block, the AdaLN norm and the
key/value projections of every image token from the cached block input, under the *edit's*
conditioning `temb` (timestep, guidance and the pooled prompt embedding modulate the norm). A
K/V cache holds the template's keys and values instead: computed under the *template's* `temb`,
and in the first block from the template's conditioning at unmasked tokens (no cache holds that
block's input: the output cache recomputes it from the edit's). That is the whole
approximation. Each case: the full path, then the masked edit on a template captured with the
output cache and on one captured with keys and values (the executor switched in place; the
template key names the layout). Same cases, seeds and metrics as bench/quality.py.

    python bench/quality_kv.py --model flux-fill:ref --out docs/benchmarks/data/quality
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


def main() -> int:
    args, pipe, clf = evaluate.experiment_setup(__doc__, "flux-fill:ref")
    ex = pipe.family.masked
    rows, t0 = [], time.monotonic()
    for i, case in enumerate(evaluate.cases(args.cases)):
        req = evaluate.edit_request(case, args.steps, None, seed=1 + i)
        image, mask = Image.fromarray(case.image), Image.fromarray(case.mask.astype(np.uint8) * 255)
        full = paste_back(pipe.run([req])[0].image, image, mask)
        row = {"id": case.id, "kind": case.kind, "ratio": round(case.ratio, 4),
               "prompt": case.prompt, "full": evaluate.adherence(clf, full, case)}  # fmt: skip
        for name in ("masked", "kv"):
            ex.set_kv_cache(name == "kv")
            spec = TemplateSpec(
                image=evaluate.png(case.image),
                prompt=case.caption,
                seed=evaluate.TEMPLATE_SEED,
                num_inference_steps=args.steps,
            )
            key = pipe.build_template(spec)
            res = pipe.run([replace(req, image=None, template_id=key)])[0]
            if res.path != "masked":
                raise RuntimeError(f"case {case.id}: the edit ran {res.path}")
            if (ex.kv is not None) != (name == "kv") or not ex.last_context.masked_blocks:
                raise RuntimeError(f"case {case.id}: {name} did not read its cache")
            out = paste_back(res.image, image, mask)
            row[name] = {**evaluate.compare(full, out, case),
                         "adherence": evaluate.adherence(clf, out, case)}  # fmt: skip
            pipe.store.delete(key)
        ex.set_kv_cache(False)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("id", "kind")}), flush=True)
    summary = {"full": {t: round(float(np.mean([r["full"][t] for r in rows])), 4)
                        for t in ("colour", "pattern", "both")}}  # fmt: skip
    for v in ("masked", "kv"):
        keys = [k for k in rows[0][v] if k.startswith(("ssim", "psnr"))]
        summary[v] = {k: round(float(np.mean([r[v][k] for r in rows])), 5) for k in keys}
        summary[v]["ssim_min"] = round(float(min(r[v]["ssim"] for r in rows)), 5)
        summary[v]["adherence"] = {t: round(float(np.mean([r[v]["adherence"][t] for r in rows])), 4)
                                   for t in ("colour", "pattern", "both")}  # fmt: skip
    evaluate.write_experiment(args.out, "kv", args, rows, summary, time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
