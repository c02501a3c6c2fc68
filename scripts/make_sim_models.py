"""Regenerate instgenie/sim/models.json: each model's CostSpec without fits (its blocks, prompt
length, CFG, defaults), so that the simulator prices a worker without torch or a model.

    python scripts/make_sim_models.py   # builds each model's configs on the meta device: seconds

The blocks come from engine/costspec.py's `model_cost_spec` of the model built with every part on
the meta device (configs only, no weights), exactly the list a worker reports.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from instgenie.engine.costspec import model_cost_spec
from instgenie.engine.family import load_family

MODELS = ("sdxl-inpaint:full", "sdxl-inpaint:tiny", "flux-fill:full", "sd2-inpaint:full")
OUT = Path(__file__).resolve().parents[1] / "instgenie" / "sim" / "models.json"


def main() -> None:
    out = {}
    for model in MODELS:
        spec = model_cost_spec(load_family(model, "cpu", parts="none"), "float16", None)
        d = dataclasses.asdict(spec)
        for k in ("compute", "load", "other", "stages", "profile", "cache_dtype"):
            d.pop(k)
        out[model] = d
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
