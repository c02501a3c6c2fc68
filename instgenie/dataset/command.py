"""`instgenie dataset`: write the procedural editing dataset (write.py) to a directory."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_dataset_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dataset", help="write the procedural editing dataset (scenes, captions, "
                       "masks, held-out combinations)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="directory to write")
    p.add_argument("--count", type=int, default=1000, help="scenes")
    p.add_argument("--size", type=int, default=256, help="image side, pixels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already there")
    p.set_defaults(func=run)
    c = sub.add_parser(
        "train-classifier",
        help="fit the region classifier (garment colour, pattern, kind) on rendered scenes; "
        "print its accuracy on new ones",
    )
    c.add_argument("--out", type=Path, required=True, help="weights JSON to write")
    c.add_argument("--count", type=int, default=3000, help="training scenes")
    c.add_argument("--size", type=int, default=256, help="image side, pixels")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--test-count", type=int, default=400, help="fresh scenes per split to score")
    c.set_defaults(func=run_train_classifier)


def run_train_classifier(args: argparse.Namespace) -> int:
    from instgenie.dataset import classifier

    t0 = time.monotonic()
    clf = classifier.train(args.count, args.size, args.seed)
    clf.save(args.out)
    scores = {split: classifier.accuracy(clf, args.test_count, args.size, args.seed + 1 + i,
                                         split)
              for i, split in enumerate(("train", "eval"))}  # fmt: skip
    print(json.dumps({"out": str(args.out), "accuracy": scores,
                      "seconds": round(time.monotonic() - t0, 1)}))  # fmt: skip
    return 0


def run(args: argparse.Namespace) -> int:
    from instgenie.dataset.write import write

    t0 = time.monotonic()
    try:
        manifest = write(args.out, args.count, args.size, args.seed, args.overwrite)
    except (ValueError, FileExistsError) as exc:
        print(f"dataset: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), "count": manifest["count"], "size": args.size,
                      "splits": manifest["splits"],
                      "seconds": round(time.monotonic() - t0, 1)}))  # fmt: skip
    return 0
