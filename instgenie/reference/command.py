"""`instgenie train-reference`: render the training pool and train one reference model (a GPU:
minutes; the CPU works for smoke runs). Writes FAMILY's pipeline to --out (fp16 safetensors,
diffusers layout) with training.json; `instgenie/assets/ref/FAMILY` is where `FAMILY:ref` loads
from.

Two families train side by side on one GPU from one rendered pool:

    instgenie train-reference --render-only --pool /tmp/pool.npz --scenes 16000
    instgenie train-reference --family sdxl-inpaint --pool /tmp/pool.npz --out A &
    instgenie train-reference --family flux-fill --pool /tmp/pool.npz --out B &
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path


def add_train_reference_parser(sub: argparse._SubParsersAction) -> None:
    from instgenie.reference.settings import FAMILIES, SIDE, TrainConfig

    p = sub.add_parser("train-reference", help="train a reference model (small, real weights) "
                       "on the procedural editing dataset")  # fmt: skip
    p.add_argument("--family", choices=FAMILIES, help="which model to train")
    p.add_argument("--out", type=Path, help="pipeline directory to write")
    p.add_argument("--pool", type=Path, default=None,
                   help="rendered pool (.npz): loaded when it exists, else rendered and saved "
                   "there")  # fmt: skip
    p.add_argument("--render-only", action="store_true", help="render --pool and stop")
    p.add_argument(
        "--scenes",
        type=int,
        default=16000,
        help="train-split scenes in the pool (each with its twin: twice the images)",
    )
    p.add_argument(
        "--twins",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="render each scene's re-coloured twin (pool.py; edit training)",
    )
    p.add_argument("--size", type=int, default=SIDE, help="image side, pixels")
    p.add_argument("--device", default="cuda")
    for f in dataclasses.fields(TrainConfig):
        if f.name != "family":
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default),
                           default=f.default)  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("instgenie.reference").setLevel(logging.INFO)
    from instgenie.reference import pool as pool_mod
    from instgenie.reference.settings import TrainConfig

    cfg = None
    if args.family is not None:  # checked before any pool is rendered
        names = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "family"]
        try:
            cfg = TrainConfig(family=args.family, **{n: getattr(args, n) for n in names})
        except ValueError as exc:
            print(f"train-reference: {exc}", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    if args.pool is not None and args.pool.exists():
        pool = pool_mod.load(args.pool)
    else:
        pool = pool_mod.render(args.scenes, args.size, args.seed, twins=args.twins)
        if args.pool is not None:
            pool_mod.save(pool, args.pool)
    print(json.dumps({"pool": len(pool), "seconds": round(time.monotonic() - t0, 1)}),
          flush=True)  # fmt: skip
    if args.render_only:
        return 0
    if cfg is None or args.out is None:
        print("train-reference: --family and --out are required to train", file=sys.stderr)
        return 2
    from instgenie.reference.train import train

    record = train(cfg, pool, args.out, args.device)
    print(json.dumps({k: record[k] for k in ("family", "seconds", "parameters")}
                     | {"vae_steps": record["vae"]["steps"],
                        "vae_psnr_db": record["vae"]["reconstruction_psnr_db"],
                        "steps": record["backbone"]["steps"],
                        "last_loss": record["backbone"]["curve"][-1:]}))  # fmt: skip
    return 0
