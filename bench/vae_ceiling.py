"""The VAE's ceiling on prompt adherence: each held-out case's edit rendered exactly, encoded
and decoded by a reference model's VAE (evaluate.vae_round_trip), read by the region classifier
where the benchmarks read an edit. No backbone runs; any VAE directory can be compared (e.g. an
earlier revision's, `git show REV:instgenie/assets/ref/FAMILY/vae/...` into a folder).

    python bench/vae_ceiling.py --vae sdxl-inpaint=instgenie/assets/ref/sdxl-inpaint/vae \
        --out docs/benchmarks/data/reference/vae-ceiling.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instgenie.dataset import classifier  # noqa: E402
from instgenie.reference import evaluate  # noqa: E402


def ceiling(vae, case_list: list[evaluate.Case], clf) -> dict:  # noqa: ANN001
    """Accuracy (colour, pattern, both) of the cases' exact targets after a round trip."""
    return evaluate.accuracy(
        [evaluate.adherence(clf, evaluate.vae_round_trip(vae, c.target), c) for c in case_list]
    )


def main() -> int:
    from diffusers import AutoencoderKL

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vae", action="append", required=True, help="NAME=DIR (repeatable)")
    p.add_argument("--cases", type=int, default=48, help="per split")
    p.add_argument("--splits", default="eval,train")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    clf = classifier.RegionClassifier.load(classifier.DEFAULT_WEIGHTS)
    splits = args.splits.split(",")
    case_lists = {s: evaluate.cases(args.cases, split=s) for s in splits}
    results = {}
    for item in args.vae:
        name, _, directory = item.partition("=")
        vae = AutoencoderKL.from_pretrained(directory, torch_dtype=torch.float32)
        results[name] = {s: ceiling(vae, case_lists[s], clf) for s in splits}
        print(name, json.dumps(results[name]), flush=True)
    record = {"vaes": dict(a.partition("=")[::2] for a in args.vae), "cases": args.cases,
              "eval_seed": evaluate.EVAL_SEED, "results": results, "torch": torch.__version__,
              "device": platform.processor() or "cpu", "command": " ".join(sys.argv)}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
