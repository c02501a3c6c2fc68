"""One denoising step, masked vs full: FLOPs (counted) and latency (timed). Backs
`instgenie bench-step` and bench/bench_masked_step.py.

Timing: every variant is checked to run first, warmed up, then timed over `iters` steps with CUDA
events (host clock on CPU); the median is reported. Each timed step starts from the same request
states (step index 0), so only the denoise step is in the timed region.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from instgenie.engine.imageio import encode_image
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest, RequestState
from instgenie.engine.templates import TemplateSpec

#: steps of the benchmark template and edits; only step 0 is timed
BENCH_STEPS = 2


def ratio_mask(width: int, height: int, ratio: float, granule: int) -> Image.Image:
    """A centred rectangle (white = edit) covering `ratio` of the image, its sides on the token
    grid (`granule` pixels) so that the token-level ratio equals the pixel-level one."""
    gw, gh = width // granule, height // granule
    cells = max(1, round(ratio * gw * gh))
    # of the rectangles that fit, the one closest to `cells` grid cells, then the most square
    w, h = min(
        ((w, min(gh, -(-cells // w))) for w in range(1, gw + 1)),
        key=lambda wh: (abs(wh[0] * wh[1] - cells), abs(wh[0] - wh[1])),
    )
    x0, y0 = (gw - w) // 2 * granule, (gh - h) // 2 * granule
    m = Image.new("L", (width, height), 0)
    ImageDraw.Draw(m).rectangle([x0, y0, x0 + w * granule - 1, y0 + h * granule - 1], fill=255)
    return m


def template_image(size: int) -> Image.Image:
    """A deterministic, non-constant RGB template (gradients, waves, noise)."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    arr = np.stack([x, y, 0.5 + 0.5 * np.sin(8 * (x + y))], -1) * 200
    arr += rng.normal(0, 10, arr.shape)
    return Image.fromarray(arr.clip(0, 255).astype("uint8"), "RGB")


@dataclass
class StepBench:
    pipe: EditPipeline
    size: int
    template_key: str
    image_png: bytes

    @classmethod
    def setup(cls, pipe: EditPipeline, size: int) -> StepBench:
        png = encode_image(template_image(size), "png")
        key = pipe.build_template(
            TemplateSpec(image=png, prompt="a photo", seed=0, num_inference_steps=BENCH_STEPS)
        )
        return cls(pipe, size, key, png)

    def states(self, ratio: float, batch: int, masked: bool) -> list[RequestState]:
        # family.granule = the pixel size of a token at the coarsest transformer resolution
        mask = ratio_mask(self.size, self.size, ratio, self.pipe.family.granule)
        mask = encode_image(mask, "png")
        states = []
        for i in range(batch):
            req = EditRequest(
                uid=f"b{i}", image=None if masked else self.image_png, mask=mask,
                prompt=f"an edit {i}", seed=100 + i, num_inference_steps=BENCH_STEPS,
                template_id=self.template_key if masked else None,
            )  # fmt: skip
            s = self.pipe.preprocess(req)
            assert s.path == ("masked" if masked else "full"), s.path
            states.append(s)
        return states

    def token_ratio(self, states: list[RequestState]) -> float:
        s = states[0]
        if s.token_index is None:
            return 1.0
        return min(idx.numel() / L for L, idx in s.token_index.items())

    def flops(self, states: list[RequestState]) -> int:
        snap = _snapshot(states)
        ctx = sdpa_kernel(SDPBackend.MATH) if self.pipe.family.device.type == "cpu" else _null()
        with ctx, FlopCounterMode(display=False) as fc:
            self.pipe.denoise_step(states)
        _restore(states, snap)
        return int(fc.get_total_flops())

    def time_ms(self, states: list[RequestState], warmup: int, iters: int) -> float:
        snap = _snapshot(states)
        cuda = self.pipe.family.device.type == "cuda"
        times = []
        for i in range(warmup + iters):
            _restore(states, snap)
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                self.pipe.denoise_step(states)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                self.pipe.denoise_step(states)
                ms = 1e3 * (time.perf_counter() - t0)
            if i >= warmup:
                times.append(ms)
        _restore(states, snap)
        return statistics.median(times)


def _snapshot(states: list[RequestState]) -> list[tuple[torch.Tensor, int]]:
    return [(s.latents.clone(), s.step_index) for s in states]


def _restore(states: list[RequestState], snap: list[tuple[torch.Tensor, int]]) -> None:
    for s, (lat, idx) in zip(states, snap, strict=True):
        s.latents, s.step_index = lat.clone(), idx


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def bench_step(
    pipe: EditPipeline, ratio: float, batch: int, size: int, warmup: int = 2, iters: int = 5
) -> dict:
    """Masked vs full for one (mask ratio, batch size): counted FLOPs and median step latency."""
    bench = StepBench.setup(pipe, size)
    full, masked = bench.states(ratio, batch, False), bench.states(ratio, batch, True)
    row = {
        "model": str(pipe.family.spec),
        "device": str(pipe.family.device),
        "dtype": str(pipe.family.dtype).removeprefix("torch."),
        # the kernels, layout and graphs it ran with (config.ExecConfig)
        "execution": dataclasses.asdict(pipe.family.execution),
        "size": size,
        "batch": batch,
        "mask_ratio": ratio,
        "token_ratio": round(bench.token_ratio(masked), 4),
        "flops_full": bench.flops(full),
        "flops_masked": bench.flops(masked),
        "ms_full": round(bench.time_ms(full, warmup, iters), 3),
        "ms_masked": round(bench.time_ms(masked, warmup, iters), 3),
    }
    row["flop_ratio"] = round(row["flops_masked"] / row["flops_full"], 4)
    row["speedup"] = round(row["ms_full"] / row["ms_masked"], 3)
    return row
