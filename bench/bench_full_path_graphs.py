"""GPU benchmark: CUDA graphs of full-path batches under continuous batching, keyed by shape
(executor.run_backbone: a batch without a step context replays any graph of its shapes) against
the keying before it (by members: every join or leave a new composition, emulated here by
putting the members back into the key). Six staggered full-path edits (a join every third
iteration), SDXL-inpaint `full` 1024², 12 steps, max batch 8, capture policy "auto"; runs
alternate new / old, the first two warm up. Not a test. Results:
docs/benchmarks/full-path-graphs-h100.md.

    python bench/bench_full_path_graphs.py
"""

from __future__ import annotations

import collections
import statistics
import time

import torch
from PIL import Image, ImageDraw

from instgenie.engine.graphs import StepGraphs
from instgenie.engine.masked import executor as ex
from instgenie.engine.masked.context import composition_key
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.scheduler.batching import get_policy
from instgenie.worker.batcher import Batcher

SIDE, STEPS, EDITS, JOIN_EVERY = 1024, 12, 6, 3

_run_backbone, _graphs_run, _current = ex.MaskedExecutor.run_backbone, StepGraphs.run, {}


def _remember_batch(self, batch, plan, fn, *args, **kwargs):
    _current["batch"] = batch
    return _run_backbone(self, batch, plan, fn, *args, **kwargs)


def _keyed_by_members(self, key, ctx, *args, **kwargs):
    """The keying before: a context-less batch keyed by its members too."""
    if ctx is None:
        key = (composition_key(_current["batch"]), *key[1:])
    return _graphs_run(self, key, ctx, *args, **kwargs)


def _request(i: int, image: Image.Image) -> EditRequest:
    mask = Image.new("L", (SIDE, SIDE), 0)
    ImageDraw.Draw(mask).rectangle((100 + 20 * (i % 10), 100, 500, 600), fill=255)
    return EditRequest(uid=f"r{i}", image=image, mask=mask, prompt=f"a hat {i}", seed=i,
                       num_inference_steps=STEPS)  # fmt: skip


def main() -> None:
    pipe = EditPipeline.load("sdxl-inpaint:full", device="cuda")
    print(torch.cuda.get_device_name(0), torch.__version__)
    image = Image.linear_gradient("L").resize((SIDE, SIDE)).convert("RGB")
    ex.MaskedExecutor.run_backbone = _remember_batch
    for run, variant in enumerate(["new", "old", "new", "old"]):  # runs 0-1 warm up
        StepGraphs.run = _keyed_by_members if variant == "old" else _graphs_run
        pipe.family.masked.graphs.clear()
        batcher = Batcher(pipe, get_policy("continuous"), 8)
        pending = [pipe.preprocess(_request(10 * run + i, image)) for i in range(EDITS)]
        it, t0 = 0, time.perf_counter()
        while pending or not batcher.idle:
            if pending and it % JOIN_EVERY == 0:
                batcher.submit(pending.pop(0))
            batcher.iterate()
            it += 1
        torch.cuda.synchronize()
        ms = collections.defaultdict(list)
        for e in batcher.records:
            ms[e.graph].append(e.duration_ms)
        kinds = "; ".join(f"{k} {len(v)} x {statistics.median(v):.0f} ms" for k, v in ms.items())
        print(f"run {run} ({variant}): {len(batcher.records)} steps in "
              f"{time.perf_counter() - t0:.2f} s; {kinds}")  # fmt: skip


if __name__ == "__main__":
    main()
