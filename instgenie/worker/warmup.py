"""A denoise loop's warm-up before it reports ready (WorkerConfig.warmup, decision 0049).

A fresh worker's first edits paid its cold start: measured on two H200s (docs/benchmarks/
cluster-h200.md) the first batch's first masked step ran an eager warm-up of 0.15-1.5 s (the
masked kernels' Triton JIT, CUDA's lazy module loading, cuBLAS handles, the graph pool) and the
first VAE decode took 2.2-2.4 s, so the first two edits of each worker took 2.6-4.8 s against
1 s. The router cannot price that, and a client sees it after every restart or scale-out.

Before `ready`, the loop runs a private template through the paths serving takes, at the
family's default size (or the largest the limits allow) and WARMUP_STEPS steps: the capture run
(prompt and VAE encode, full steps, the cache writer), one masked edit alone and two masked edits
in one batch (each composition's graph warm-up, capture and replays on CUDA), the VAE decode
whole (the capture) and cropped where the crop applies (the edits; decision 0044). It runs
against a scratch in-memory store on the loop's device with its own pipeline over the same
model: the node's cache tiers, the loop's step log and its templates are untouched, and the
prompt cache and the cropped decoder's statistics are left as found (entries and counters). The
scratch store and the compositions' graphs are dropped before the device tier sizes itself from
free memory, also when the warm-up fails; the measured call costs and "this batch shape was
captured" (engine/graphs.py) are kept, so the first real composition of a warmed shape is
captured on its first call.

With model_stages="process" the loop holds the backbone alone and cannot build a request
(its prompt and VAE encoders are in the pre-processing process): it is not warmed.
"""

from __future__ import annotations

import gc
import logging
import math
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw

from instgenie.cache.store import InMemoryStore
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest, RequestState
from instgenie.engine.templates import TemplateSpec
from instgenie.messages import Path
from instgenie.scheduler import buckets

log = logging.getLogger(__name__)

#: denoising steps of the warm-up's runs: one eager call, a capture and replays per composition
WARMUP_STEPS = 4
#: the warm-up edits' mask boxes, as fractions of the side (x0, y0, x1, y1): ratios 0.2, 0.09
MASK_BOXES = ((0.3, 0.2, 0.7, 0.7), (0.1, 0.6, 0.4, 0.9))
#: the bucket captures' mask: a few tokens on every grid, below the ladder's lowest rung
TINY_BOX = (0.48, 0.48, 0.52, 0.52)


@dataclass(frozen=True)
class WarmupReport:
    """What the warm-up ran: denoising steps, requests that ran masked, decoded images, ms."""

    steps: int
    masked: int
    decoded: int
    ms: float
    #: graphs captured for serving (graph_capture "buckets": every bucket and full-path shape)
    graphs: int = 0


def wanted(setting: str, device: str) -> bool:
    """WorkerConfig.warmup: "on", "off", or "auto" (on where the model runs on CUDA: on a CPU
    there is no JIT, lazy module load or graph pool to warm)."""
    return setting == "on" or (setting == "auto" and torch.device(device).type == "cuda")


def warm_up(pipe: EditPipeline, max_batch: int) -> WarmupReport | None:
    """Run the warm-up on `pipe`'s model (see the module doc); `max_batch`: the loop's bound
    (one edit at a time when it is 1). None when it failed: logged, and the worker serves cold
    (the first request meets the fault as a typed error). Either way nothing of it is left: the
    prompt cache and the cropped decoder's statistics as found, no graph, no scratch memory."""
    t0 = time.perf_counter()
    fam = pipe.family
    report = None
    with _as_found(fam):
        try:
            steps, masked, decoded, graphs = _exercise(pipe, max_batch)
            ms = 1e3 * (time.perf_counter() - t0)
            report = WarmupReport(steps, masked, decoded, ms, graphs)
        except Exception:  # as text: a handler keeping the record must not keep its frames
            log.error("warm-up failed; serving cold\n%s", traceback.format_exc())
    # out of the except clause: its traceback (holding the scratch states) is gone
    # compositions' static buffers point into the scratch store; bucket graphs (their sources
    # released) and full-path graphs do not, and "buckets" serves from them
    graphs = fam.masked.graphs
    graphs.clear(keep_start=graphs.capture == "buckets")
    fam.masked.last_context = None  # its requests hold scratch cache handles
    gc.collect()
    if fam.device.type == "cuda":
        torch.cuda.synchronize(fam.device)
        torch.cuda.empty_cache()
    return report


@contextmanager
def _as_found(fam) -> Iterator[None]:
    """The family's caches and counters that requests read, left as they were on exit."""
    with ExitStack() as stack:
        stack.enter_context(fam.prompts.untracked())
        cropped = fam.cropped
        if cropped is not None:
            stack.enter_context(cropped.states.untracked())
            counts = cropped.counts.copy()
            stack.callback(lambda: setattr(cropped, "counts", counts))
        yield


def _exercise(pipe: EditPipeline, max_batch: int) -> tuple[int, int, int, int]:
    """(denoising steps, edits that ran masked, images decoded, graphs captured for serving)
    of the warm-up's runs."""
    fam = pipe.family
    scratch = EditPipeline(fam, pipe.limits, InMemoryStore(fam.device), pipe.profile,
                           compute_margin=pipe.compute_margin)  # fmt: skip
    side, steps = _size(pipe), min(WARMUP_STEPS, pipe.limits.max_steps)
    key = scratch.register_template(
        TemplateSpec(image=_scene(side), prompt="a grey wall", num_inference_steps=steps)
    )
    ran = 0
    with torch.inference_mode():
        capture = scratch.capture_state(key)
        assert capture is not None  # a fresh scratch store holds nothing
        ran += _run(scratch, [capture])
        alone = _edit(scratch, key, "alone", MASK_BOXES[0], side, steps)
        ran += _run(scratch, [alone])
        together = [_edit(scratch, key, f"batched-{i}", box, side, steps)
                    for i, box in enumerate(MASK_BOXES[:max_batch])]  # fmt: skip
        ran += _run(scratch, together)
        done = [capture, alone, *together]
        images = scratch.decode_latents(done)
        graphs = _capture_buckets(scratch, key, side, steps, max_batch)
    return ran, sum(s.path is Path.MASKED for s in done[1:]), len(images), graphs


def _capture_buckets(pipe: EditPipeline, key: str, side: int, steps: int, max_batch: int) -> int:
    """graph_capture "buckets" on CUDA: capture what serving replays (engine/bucket_graphs.py)
    — for 1..min(max_batch, buckets.MAX_REQUESTS) requests, the full-path graph of that many
    rows and a masked graph at every rung of the bucket ladder (edits with a tiny mask, the
    rung forced up). The number of graphs (graph-form entries without CUDA) it added; 0 under
    any other policy."""
    ex = pipe.family.masked
    graphs = ex.graphs
    cuda = pipe.family.device.type == "cuda"
    if graphs.capture != "buckets" or graphs.mode == "off" or not (cuda or graphs.force_static):
        return 0  # (force_static: the graph form without CUDA, tests)
    before = graphs.start_graphs()
    graphs.warming = True
    try:
        for n in range(1, min(max_batch, buckets.MAX_REQUESTS) + 1):
            full = [_edit(pipe, key, f"full-{n}-{i}", MASK_BOXES[0], side, steps, masked=False)
                    for i in range(n)]  # fmt: skip
            _run(pipe, full)  # call 1 warms the shape up, call 2 captures it
            states: list[RequestState] = []
            for rung in range(len(buckets.RUNGS)):
                if not states or all(s.is_done for s in states):
                    states = [_edit(pipe, key, f"bucket-{n}-{rung}-{i}", TINY_BOX, side, steps)
                              for i in range(n)]  # fmt: skip
                ex.bucket_min_rung = rung
                pipe.denoise_step(states)
    finally:
        graphs.warming = False
        ex.bucket_min_rung = 0
    return graphs.start_graphs() - before


def _size(pipe: EditPipeline) -> int:
    """The family's default side, or the largest multiple of its granule within the
    limits' pixel cap when that is smaller."""
    fam, cap = pipe.family, pipe.limits.max_image_pixels
    side = fam.default_size
    if side * side > cap:
        side = max(fam.granule, math.isqrt(cap) // fam.granule * fam.granule)
    return side


def _run(pipe: EditPipeline, batch: list[RequestState]) -> int:
    """Step `batch` to completion as one composition; the number of steps."""
    steps = 0
    while not all(s.is_done for s in batch):
        pipe.denoise_step(batch)
        steps += 1
    return steps


def _edit(pipe: EditPipeline, key: str, name: str, box: tuple, side: int, steps: int,
          masked: bool = True):  # fmt: skip
    """An edit of the scratch template (`masked` False: on the full path)."""
    req = EditRequest(uid=f"warmup-{name}", image=None, mask=_mask(side, box),
                      prompt="a red shirt", seed=len(name), num_inference_steps=steps,
                      template_id=key)  # fmt: skip
    return pipe.preprocess(req, select_path=masked)


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
