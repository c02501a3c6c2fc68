"""Offline latency profiling (`instgenie profile`): runs the model under timers and fits the
latency models of a profile (scheduler.fits: LinearFit, Profile, the schema the load planner
and the router read): per-block compute latency with and without the cache, and load latency
per tier.

Compute: every hooked block is timed (CUDA events on the compute stream) over a grid of mask
ratios and batch sizes, once computing only masked tokens from a GPU-resident cache ("cached")
and once computing all tokens ("full"). Each block class (kind and width) gets one model per mode:
latency_ms = slope * FLOPs + intercept, FLOPs from instgenie.scheduler.pricing (paper Table 1 with
keys/values over all tokens). The rest of the step (everything outside the transformer blocks:
ResNets, norms, the scheduler; what the whole step takes beyond its blocks) gets one model,
latency_ms = slope * (batch rows * pixels) + intercept ("other"; the router adds it to a batch's
price, the load planner does not need it). Stages: the denoise loop's model work per request
outside its steps (model_stages="loop"): "encode" (prompt and VAE encode, initial noise) and
"decode" (VAE decode), latency_ms = slope * pixels + intercept at a few working sizes (the
router adds them to its simulation of a worker's loop). Load: host -> device copies of growing
sizes per tier ("dram" = pinned host memory; "disk" = reading a checksummed entry into host memory),
latency_ms = slope * bytes + intercept. The output JSON holds the fits, their R², and the raw
samples.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from instgenie.engine.costspec import family_blocks
from instgenie.scheduler.fits import MODES, STAGES, LinearFit, Profile, fit_stages
from instgenie.scheduler.fits import check_profile as check_blocks
from instgenie.scheduler.pricing import batch_flops
from instgenie.scheduler.spec import BlockSpec, block_class

__all__ = ["MODES", "STAGES", "check_profile", "family_block_dims", "fit_profile",
           "fit_stages", "profile_compute", "profile_disk_load", "profile_dram_load",
           "profile_stages", "r2_report", "stage_sizes"]  # fmt: skip


def family_block_dims(fam) -> dict[int, BlockSpec]:  # noqa: ANN001 - a loaded model family
    """Block id -> spec of every transformer block the masked executor runs."""
    return {d.block_id: d for d in family_blocks(fam)}


def check_profile(profile: Profile, fam, path: str = "profile") -> None:  # noqa: ANN001
    """scheduler.fits.check_profile against this loaded model's blocks (ValueError unless
    `profile` was fitted for the same block ids and classes)."""
    check_blocks(profile, {b: block_class(d) for b, d in family_block_dims(fam).items()}, path)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_compute(pipe, size: int, batches, ratios, warmup: int, iters: int, log=print) -> dict:
    """Samples {class: {mode: [(flops, ms), ...]}} over the (batch, ratio) grid."""
    from instgenie.engine.stepbench import StepBench

    fam = pipe.family
    dims = family_block_dims(fam)
    bench = StepBench.setup(pipe, size)
    shapes = pipe.store.meta(bench.template_key).block_shapes
    samples: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    other: list[tuple[float, float]] = []  # (batch rows * pixels, step ms - sum of block ms)
    try:
        for batch in batches:
            for ratio in ratios:
                states = bench.states(ratio, batch, masked=True)
                text_len = int(states[0].cond["prompt_embeds"].shape[1])
                for mode in MODES:
                    run = states
                    if mode == "full" and fam.masked.kv is not None:
                        # a K/V block cannot compute every token of a cache-reading row (its
                        # inputs are not cached: kv_layout.py): the full path's rows
                        run = bench.states(ratio, batch, masked=False)
                    compute_all = frozenset() if mode == "cached" else frozenset(dims)
                    per_block, step_ms = _time_blocks(pipe, run, compute_all, warmup, iters)
                    rows_px = sum(s.num_rows for s in run) * size * size
                    other.append((rows_px, max(0.0, step_ms - sum(per_block.values()))))
                    for b, ms in per_block.items():
                        L, _ = shapes[b]
                        rows = [
                            L if mode == "full" else s.token_index[L].numel()
                            for s in run
                            for _ in range(s.num_rows)
                        ]
                        flops = batch_flops(dims[b], L, rows, text_len)
                        samples[block_class(dims[b])][mode].append((flops, ms))
                log(f"profiled batch {batch} ratio {ratio}")
                del states
    finally:
        pipe.store.delete(bench.template_key)
    blocks = {b: block_class(d) for b, d in dims.items()}
    return {"samples": samples, "blocks": blocks, "other": other}


def _time_blocks(
    pipe, states, compute_all: frozenset[int], warmup: int, iters: int
) -> tuple[dict[int, float], float]:
    """({block id: median ms}, median ms of the whole step) of timed steps of `states` whose
    blocks in `compute_all` compute every token."""
    from instgenie.scheduler.step import StepPlan, members_of

    runs: dict[int, list[float]] = defaultdict(list)
    steps: list[float] = []
    snap = [(s.latents.clone(), s.step_index) for s in states]
    device = pipe.family.device
    for i in range(warmup + iters):
        for s, (lat, idx) in zip(states, snap, strict=True):
            s.latents, s.step_index = lat.clone(), idx
        plan = StepPlan(index=i, members=members_of(states), compute_all=compute_all, timed=True)
        _sync(device)
        t0 = time.perf_counter()
        pipe.prepare_reads(states)
        pipe.denoise_step(states, plan)
        _sync(device)
        if i >= warmup:
            steps.append(1e3 * (time.perf_counter() - t0))
            for b, ms in pipe.family.masked.last_context.timer.results_ms().items():
                runs[b].append(ms)
    for s, (lat, idx) in zip(states, snap, strict=True):
        s.latents, s.step_index = lat, idx
    return {b: statistics.median(v) for b, v in runs.items()}, statistics.median(steps)


def stage_sizes(size: int, granule: int) -> list[int]:
    """Working sizes (square, pixels a side) the stages are timed at: 1/2, 3/4 and all of the
    profile's size, each a whole number of granules (at least one)."""
    return sorted({max(granule, size * k // 4 // granule * granule) for k in (2, 3, 4)})


def profile_stages(pipe, sizes, warmup: int, iters: int) -> dict[str, list[tuple[int, float]]]:
    """{stage: [(pixels, median ms), ...]} of the loop's per-request model work at each working
    size: "encode" = EditPipeline.encode_inputs of one decoded edit (prompt encoders, VAE encode,
    initial noise), "decode" = EditPipeline.decode_latents of that one request. Wall time with
    the device synchronised, as the loop waits for both. Every run has its own prompt (no
    encoder output is reused)."""
    from instgenie.engine.imageio import encode_image
    from instgenie.engine.request import EditRequest
    from instgenie.engine.stepbench import ratio_mask, template_image

    device = pipe.family.device
    out: dict[str, list[tuple[int, float]]] = {s: [] for s in STAGES}
    for size in sizes:
        mask = encode_image(ratio_mask(size, size, 0.2, pipe.family.granule), "png")
        image = encode_image(template_image(size), "png")
        times: dict[str, list[float]] = {s: [] for s in STAGES}
        for i in range(warmup + iters):
            req = EditRequest(uid=f"stage{i}", image=image, mask=mask,
                              prompt=f"a stage profile {size} {i}", seed=i)  # fmt: skip
            inputs = pipe.decode_inputs(req)
            _sync(device)
            t0 = time.perf_counter()
            state = pipe.encode_inputs(inputs)
            _sync(device)
            t1 = time.perf_counter()
            pipe.decode_latents([state])
            _sync(device)
            t2 = time.perf_counter()
            if i >= warmup:
                times["encode"].append(1e3 * (t1 - t0))
                times["decode"].append(1e3 * (t2 - t1))
        for s in STAGES:
            out[s].append((size * size, statistics.median(times[s])))
    return out


def profile_dram_load(device: torch.device, sizes_mb, iters: int = 5) -> list[tuple[int, float]]:
    """(bytes, ms) of host -> device copies from pinned host memory (plain memory on CPU)."""
    out = []
    for mb in sizes_mb:
        n = int(mb * 2**20) // 2
        src = torch.randn(n, dtype=torch.float32).to(torch.bfloat16)
        if device.type == "cuda":
            src = src.pin_memory()
        dst = torch.empty(n, dtype=torch.bfloat16, device=device)
        times = []
        for i in range(iters + 1):
            if device.type == "cuda":
                a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src, non_blocking=True)
                z.record()
                z.synchronize()
                ms = a.elapsed_time(z)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                ms = 1e3 * (time.perf_counter() - t0)
            if i:
                times.append(ms)
        out.append((n * 2, statistics.median(times)))
    return out


def profile_disk_load(root: str | Path, sizes_mb, iters: int = 2) -> list[tuple[int, float]]:
    """(bytes, ms) of reading a checksummed disk entry into host memory (crc32 verified as it
    streams). The page cache is dropped for the file when the OS allows (posix_fadvise), so the
    numbers are the device's, not RAM's."""
    import hashlib
    import os

    from instgenie.cache.disk import DiskTier
    from instgenie.cache.layout import TemplateLayout

    disk = DiskTier(Path(root), None)
    out = []
    for mb in sizes_mb:
        C = 1024
        L = max(1, int(mb * 2**20) // (2 * C))
        layout = TemplateLayout(num_steps=1, rows=1, dtype="bfloat16", block_shapes=((L, C),),
                                latent_shape=(1,), latent_dtype="float32")  # fmt: skip
        buf = torch.randint(0, 255, (layout.nbytes,), dtype=torch.uint8)
        key = hashlib.sha256(f"profile-{mb}".encode()).hexdigest()
        if not disk.write(key, layout, buf):
            raise RuntimeError(f"disk tier at {root} refused a {mb} MB profile entry")
        path = disk.entries_dir / f"{key}.igc"
        times = []
        for _ in range(iters):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            t0 = time.perf_counter()
            disk.read_into(key, layout, buf)
            times.append(1e3 * (time.perf_counter() - t0))
        disk.delete(key)
        out.append((layout.nbytes, statistics.median(times)))
    return out


def fit_profile(
    model: str,
    device: torch.device,
    dtype: torch.dtype,
    size: int,
    compute: dict,
    loads: dict[str, list[tuple[int, float]]],
    meta: dict,
    stages: dict[str, list[tuple[int, float]]] | None = None,
) -> Profile:
    fits = {
        cls: {mode: LinearFit.fit([f for f, _ in pts], [t for _, t in pts])
              for mode, pts in modes.items()}
        for cls, modes in compute["samples"].items()
    }  # fmt: skip
    load_fits = {
        t: LinearFit.fit([b for b, _ in pts], [ms for _, ms in pts]) for t, pts in loads.items()
    }
    samples = {
        c: {m: [[float(f), float(t)] for f, t in pts] for m, pts in ms.items()}
        for c, ms in compute["samples"].items()
    }
    load_samples = {t: [[b, ms] for b, ms in pts] for t, pts in loads.items()}
    pts = compute.get("other") or []
    other = LinearFit.fit([x for x, _ in pts], [ms for _, ms in pts]) if pts else None
    meta = dict(meta, compute_samples=samples, load_samples=load_samples,
                other_samples=[[float(x), float(ms)] for x, ms in pts])  # fmt: skip
    prof = Profile(
        model, str(device), str(dtype).removeprefix("torch."), size, fits, load_fits,
        compute["blocks"], meta, other,
    )  # fmt: skip
    prof.set_stages(stages or {})
    return prof


def r2_report(profile: Profile) -> list[str]:
    lines = []
    for cls, fits in sorted(profile.compute.items()):
        for mode, f in fits.items():
            lines.append(
                f"compute {cls:>18} {mode:>6}: ms = {f.slope * 1e12:.4f}/TFLOP * FLOPs "
                f"+ {f.intercept:.4f}   R² = {f.r2:.4f} (n = {f.n})"
            )
    if profile.other is not None:
        f = profile.other
        lines.append(
            f"rest of the step       : ms = {f.slope * 1e6:.4f}/Mpx-row * rows*pixels "
            f"+ {f.intercept:.4f}   R² = {f.r2:.4f} (n = {f.n})"
        )
    for stage, f in sorted(profile.stages.items()):
        lines.append(
            f"stage   {stage:>18}       : ms = {f.slope * 1e6:.4f}/Mpx * pixels "
            f"+ {f.intercept:.4f}   R² = {f.r2:.4f} (n = {f.n})"
        )
    for tier, f in sorted(profile.load.items()):
        gbps = 1.0 / (f.slope * 1e6) if f.slope > 0 else float("inf")
        lines.append(
            f"load    {tier:>18}       : {gbps:.1f} GB/s marginal, {f.intercept:.4f} ms fixed   "
            f"R² = {f.r2:.4f} (n = {f.n})"
        )
    return lines


ProgressFn = Callable[[str], None]
