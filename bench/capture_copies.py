"""A template capture into the host DRAM tier, step by step, with each way its blocks reach the
segment (HostActivationStore.capture_copies, decisions 0036 and 0046): "pinned" (the fresh
segment registered at the first step, then DMA), "staged" (DMA into pinned slots, host threads
back and fill the segment, registered at commit), "direct" (synchronous pageable copies).
Optionally a masked edit of an earlier template runs in the same batch at every step, as in a
served loop (`--beside`): its latency is what a capture's stall costs other users. Not a test.

    python bench/capture_copies.py --model sdxl-inpaint:full --steps 20 --beside \\
        --out $OUT/capture_copies.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_masked_step import environment  # noqa: E402
from instgenie.cache.host_store import HostActivationStore  # noqa: E402
from instgenie.cache.shm_segment import cleanup  # noqa: E402
from instgenie.cache.tiered import TieredStore  # noqa: E402
from instgenie.engine.family import load_family  # noqa: E402
from instgenie.engine.imageio import encode_image  # noqa: E402
from instgenie.engine.pipeline import EditPipeline  # noqa: E402
from instgenie.engine.request import EditRequest  # noqa: E402
from instgenie.engine.stepbench import ratio_mask, template_image  # noqa: E402
from instgenie.engine.templates import TemplateSpec  # noqa: E402

MODES = ("pinned", "staged", "direct")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def capture(pipe: EditPipeline, seed: int, steps: int, png: bytes, beside) -> dict:
    """Step times (ms) of one capture (and of the edit `beside` it, if any)."""
    key = pipe.register_template(
        TemplateSpec(image=png, prompt="a photo of a person", seed=seed, num_inference_steps=steps)
    )
    state = pipe.capture_state(key)
    edit = beside() if beside is not None else None
    ms = []
    while not state.is_done:
        batch = [state] + ([edit] if edit is not None and not edit.is_done else [])
        _sync()
        t0 = time.perf_counter()
        pipe.denoise_step(batch)  # the last step commits (release)
        _sync()
        ms.append(round(1e3 * (time.perf_counter() - t0), 1))
    return {"key": key, "step_ms": ms, "max_ms": max(ms), "total_s": round(sum(ms) / 1e3, 3),
            "first_ms": ms[0], "last_ms": ms[-1], "tier": pipe.store.tier(key)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="sdxl-inpaint:full")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dram-gib", type=float, default=60.0)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--beside", action="store_true", help="a masked edit in every captured step")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (tiny models)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    ns = uuid.uuid4().hex[:10]
    root = Path("/tmp") / f"capture-copies-{ns}"
    tiered = TieredStore(root, ns, dram_capacity_bytes=int(args.dram_gib * (1 << 30)),
                         disk_capacity_bytes=0)  # fmt: skip
    store = HostActivationStore(tiered, root)
    pipe = EditPipeline(load_family(args.model, device=args.device), store=store)
    size = pipe.family.default_size
    png = encode_image(template_image(size), "png")
    mask = encode_image(ratio_mask(size, size, 0.2, pipe.family.granule), "png")
    out: dict = {"env": environment(torch.device(args.device)), "model": args.model,
                 "steps": args.steps, "beside": args.beside, "runs": []}  # fmt: skip
    try:
        first = capture(pipe, 0, args.steps, png, None)  # warms up; the edits' template
        out["warm_up"] = first

        def beside():
            req = EditRequest(uid=uuid.uuid4().hex, image=None, template_id=first["key"],
                              mask=mask, prompt="a red leather jacket", seed=1,
                              num_inference_steps=args.steps)  # fmt: skip
            return pipe.preprocess(req)

        for i, mode in enumerate(args.modes):
            store.capture_copies = mode
            row = capture(pipe, 1 + i, args.steps, png, beside if args.beside else None)
            row["mode"] = mode
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
            args.out.write_text(json.dumps(out, indent=1) + "\n")
            store.delete(row["key"])
    finally:
        tiered.close()
        cleanup(ns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
