"""A denoise loop's warm-up before it reports ready (WorkerConfig.warmup, decision 0049).

A fresh worker's first edits paid its cold start: measured on two H200s (docs/benchmarks/
cluster-h200.md) the first batch's first masked step ran an eager warm-up of 0.15-1.5 s (the
masked kernels' Triton JIT, CUDA's lazy module loading, cuBLAS handles, the graph pool) and the
first VAE decode took 2.2-2.4 s, so the first two edits of each worker took 2.6-4.8 s against
1 s. The router cannot price that, and a client sees it after every restart or scale-out.

Before `ready`, the loop runs a private template through the paths serving takes, at the
family's default size and the config's step count (WARMUP_STEPS): the capture run (prompt and
VAE encode, full steps, the cache writer), one masked edit alone and two masked edits in one
batch (each composition's graph warm-up, capture and replays on CUDA), the VAE decode whole (the
capture) and cropped (the edits). It runs against a scratch in-memory store on the loop's device
with its own pipeline over the same model: the node's cache tiers, the loop's step log and its
templates are untouched. The scratch store and the compositions' graphs are dropped before the
device tier sizes itself from free memory; the measured call costs and "this batch shape was
captured" (engine/graphs.py) are kept, so the first real composition of a warmed shape is
captured on its first call.

With model_stages="process" the loop holds the backbone alone and cannot build a request
(its prompt and VAE encoders are in the pre-processing process): it is not warmed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw

from instgenie.cache.store import InMemoryStore
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest, RequestState
from instgenie.engine.templates import TemplateSpec
from instgenie.messages import Path

log = logging.getLogger(__name__)

#: denoising steps of the warm-up's runs: one eager call, a capture and replays per composition
WARMUP_STEPS = 4
#: the warm-up edits' mask boxes, as fractions of the side (x0, y0, x1, y1): ratios 0.2, 0.09
MASK_BOXES = ((0.3, 0.2, 0.7, 0.7), (0.1, 0.6, 0.4, 0.9))


@dataclass(frozen=True)
class WarmupReport:
    """What the warm-up ran: denoising steps, requests that ran masked, decoded images, ms."""

    steps: int
    masked: int
    decoded: int
    ms: float


def wanted(setting: str, device: str) -> bool:
    """WorkerConfig.warmup: "on", "off", or "auto" (on where the model runs on CUDA: on a CPU
    there is no JIT, lazy module load or graph pool to warm)."""
    return setting == "on" or (setting == "auto" and torch.device(device).type == "cuda")


def warm_up(pipe: EditPipeline, max_batch: int) -> WarmupReport:
    """Run the warm-up on `pipe`'s model (see the module doc); raises what the model raises.
    `max_batch`: the loop's bound (one edit when it is 1)."""
    t0 = time.perf_counter()
    fam = pipe.family
    scratch = EditPipeline(fam, pipe.limits, InMemoryStore(fam.device), pipe.profile)
    side = fam.default_size
    key = scratch.register_template(
        TemplateSpec(image=_scene(side), prompt="a grey wall", num_inference_steps=WARMUP_STEPS)
    )
    steps = 0
    with torch.inference_mode():
        capture = scratch.capture_state(key)
        assert capture is not None  # a fresh scratch store holds nothing
        steps += _run(scratch, [capture])
        alone = _edit(scratch, key, 0, side)
        steps += _run(scratch, [alone])
        together = [_edit(scratch, key, i, side) for i in range(min(max_batch, len(MASK_BOXES)))]
        steps += _run(scratch, together)
        done = [capture, alone, *together]
        images = scratch.decode_latents(done)
    masked = sum(s.path is Path.MASKED for s in done[1:])
    fam.masked.graphs.clear()  # their static buffers point into the scratch store
    fam.masked.last_context = None  # its requests hold scratch cache handles
    del scratch, capture, alone, together, done
    if fam.device.type == "cuda":
        torch.cuda.synchronize(fam.device)
        torch.cuda.empty_cache()
    return WarmupReport(steps, masked, len(images), 1e3 * (time.perf_counter() - t0))


def _run(pipe: EditPipeline, batch: list[RequestState]) -> int:
    """Step `batch` to completion as one composition; the number of steps."""
    steps = 0
    while not all(s.is_done for s in batch):
        pipe.denoise_step(batch)
        steps += 1
    return steps


def _edit(pipe: EditPipeline, key: str, i: int, side: int) -> RequestState:
    req = EditRequest(uid=f"warmup-{i}", image=None, mask=_mask(side, MASK_BOXES[i]),
                      prompt="a red shirt", seed=i, num_inference_steps=WARMUP_STEPS,
                      template_id=key)  # fmt: skip
    return pipe.preprocess(req)


def _scene(side: int) -> Image.Image:
    """A side x side RGB image: a gradient with a red ellipse (ordinary numerics; no asset)."""
    img = Image.linear_gradient("L").resize((side, side)).convert("RGB")
    ImageDraw.Draw(img).ellipse((side // 4, side // 8, 3 * side // 4, 7 * side // 8),
                                fill=(180, 60, 60))  # fmt: skip
    return img


def _mask(side: int, box: tuple[float, float, float, float]) -> Image.Image:
    mask = Image.new("L", (side, side), 0)
    ImageDraw.Draw(mask).rectangle(tuple(round(f * side) for f in box), fill=255)
    return mask
