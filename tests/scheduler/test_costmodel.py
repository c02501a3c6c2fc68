"""Profile -> per-step costs -> plan: the planner's inputs come from fitted models and block
shapes, and its decision reaches the masked blocks."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from instgenie.engine.family import load_family
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.profiling import check_profile
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.scheduler.fits import LinearFit, Profile
from tests.conftest import make_image, make_mask, png_bytes

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "sdxl-inpaint-tiny-cpu.json"


@functools.cache
def _family():
    return load_family("sdxl-inpaint:tiny")


def _profile(load_slope_ms_per_byte: float, compute_ms: float = 1.0) -> Profile:
    """A profile with flat compute (cached costs half of full) and a chosen load speed."""
    base = Profile.load_file(PROFILE)
    compute = {c: {"cached": LinearFit(0.0, compute_ms / 2, 1.0, 1),
                   "full": LinearFit(0.0, compute_ms, 1.0, 1)} for c in base.compute}  # fmt: skip
    return dataclasses.replace(
        base, compute=compute, load={"dram": LinearFit(load_slope_ms_per_byte, 0.0, 1.0, 1)}
    )


class _HostHandle:
    """Wraps a device-resident handle but claims to live in host memory: loads are planned."""

    def __init__(self, inner) -> None:
        self.inner, self.device = inner, torch.device("meta")

    def block(self, step, block_id):
        return self.inner.block(step, block_id)

    def latents(self, step):
        return self.inner.latents(step)

    def close(self) -> None:
        self.inner.close()


def _masked_state(pipe: EditPipeline):
    img, mask = png_bytes(make_image(128, 128, seed=5)), png_bytes(make_mask(128, 128))
    key = pipe.build_template(TemplateSpec(image=img, num_inference_steps=2))
    req = EditRequest(uid="c", image=None, template_id=key, mask=mask, prompt="p",
                      num_inference_steps=2)  # fmt: skip
    s = pipe.preprocess(req)
    s.cache_handle = _HostHandle(s.cache_handle)
    return s


def test_committed_tiny_profile_loads() -> None:
    prof = Profile.load_file(PROFILE)
    assert prof.model == "sdxl-inpaint:tiny" and prof.device == "cpu"
    assert set(prof.blocks) == set(range(_family().masked.num_blocks))
    assert {"cached", "full"} <= {m for fits in prof.compute.values() for m in fits}
    assert prof.load["dram"].slope > 0


@pytest.mark.parametrize(
    "slope, expect",
    [(0.0, "all-cache"), (1.0, "all-full")],  # free loads vs. absurdly slow ones (1 ms per byte)
)
def test_plan_follows_load_costs(slope: float, expect: str) -> None:
    pipe = EditPipeline(_family(), profile=_profile(slope))
    s = _masked_state(pipe)
    costs = pipe.cost_model.costs([s])
    assert costs.num_blocks == pipe.family.masked.num_blocks
    assert all(c <= f for c, f in zip(costs.compute_cached, costs.compute_full, strict=True))
    assert (max(costs.load) > 0) == (slope > 0)
    pipe.denoise_step([s])
    ctx = pipe.family.masked.last_context
    if expect == "all-cache":
        assert ctx.compute_all == frozenset()
        assert len(ctx.masked_blocks) == pipe.family.masked.num_blocks
    else:
        assert ctx.compute_all == frozenset(range(pipe.family.masked.num_blocks))
        assert ctx.masked_blocks == []
    assert pipe.cost_model.last_plan.latency_ms <= pipe.cost_model.last_plan.all_cache_ms


def test_mixed_plan_loads_only_some_blocks() -> None:
    """Loads cost about as much as the cached compute saves: the planner splits the blocks."""
    pipe = EditPipeline(_family(), profile=_profile(2e-5, compute_ms=1.0))
    s = _masked_state(pipe)
    costs = pipe.cost_model.costs([s])
    plan = pipe.cost_model.compute_all([s])
    assert 0 < len(plan) < costs.num_blocks, costs.load[:3]
    best = pipe.cost_model.last_plan
    assert best.latency_ms < min(best.all_cache_ms, best.all_full_ms)


def test_grids_the_spec_cannot_price_plan_nothing_and_the_step_runs(caplog) -> None:  # noqa: ANN001
    """A cache whose token grids are not the ones the spec derives from the working size (not
    reachable with the granule's sizes; here a spec with doubled strides) must not fail the
    step of its batch: the planner plans no compute-all block and says why."""
    from instgenie.engine.step_pricing import StepPricer

    pipe = EditPipeline(_family(), profile=_profile(1.0))
    s = _masked_state(pipe)
    spec = pipe.cost_model.spec
    wrong = dataclasses.replace(
        spec, blocks=[dataclasses.replace(b, stride=2 * b.stride) for b in spec.blocks]
    )
    pricer = StepPricer(wrong, pipe.family.device)
    with pytest.raises(ValueError, match="tokens at stride"):
        pricer.costs([s])
    with caplog.at_level("WARNING", logger="instgenie.engine"):
        assert pricer.compute_all([s]) == frozenset()
    assert "every block reads the cache" in caplog.text
    # the pipeline's own pricer, with the right grids, plans every block full at 1 ms per byte
    assert pipe.cost_model.compute_all([s]) == frozenset(range(pipe.family.masked.num_blocks))


def test_a_profile_of_another_model_is_refused() -> None:
    """Before, a worker took any profile: with more blocks it planned from another model's
    fits, with fewer every step that read a cache failed (KeyError) with its whole batch."""
    check_profile(Profile.load_file(PROFILE), _family())  # its own model: accepted
    sd2 = load_family("sd2-inpaint:tiny")
    with pytest.raises(ValueError, match=r"fitted for sdxl-inpaint:tiny .*not for this model"):
        check_profile(Profile.load_file(PROFILE), sd2)
    flux = Profile.load_file(PROFILE.parent / "flux-fill-full-h200.json")  # 57 blocks
    with pytest.raises(ValueError, match=r"flux-fill:full \(57 blocks\).*another class"):
        check_profile(flux, _family())


def test_profiling_fits_the_rest_of_the_step(tmp_path) -> None:  # noqa: ANN001
    """The profiler also times each whole step: what it takes beyond its blocks is fitted
    against batch rows * pixels (the router prices it), and survives the JSON round trip; a
    profile written before it existed loads without it."""
    from instgenie.engine.profiling import fit_profile, profile_compute

    pipe = EditPipeline(load_family("sdxl-inpaint:tiny"))
    size = 2 * pipe.family.granule
    compute = profile_compute(pipe, size, [1, 2], [0.2, 1.0], warmup=0, iters=1, log=lambda m: None)
    xs = sorted({x for x, _ in compute["other"]})
    assert len(compute["other"]) == 2 * 2 * 2  # batches x ratios x (cached, full)
    assert xs == [2 * size * size, 4 * size * size]  # CFG rows * pixels, batch 1 and 2
    assert all(ms >= 0 for _, ms in compute["other"])
    prof = fit_profile("sdxl-inpaint:tiny", torch.device("cpu"), torch.float32, size, compute,
                       {"dram": [(1 << 20, 0.1), (4 << 20, 0.3)]}, {})  # fmt: skip
    assert prof.other is not None and prof.other.n == 8
    again = Profile.from_json(prof.to_json())
    assert again.other == prof.other and len(again.meta["other_samples"]) == 8
    old = prof.to_json()
    del old["other"]
    assert Profile.from_json(old).other is None


def test_profiling_times_the_loops_encode_and_decode(monkeypatch) -> None:  # noqa: ANN001
    """The loop's per-request model work is timed at 1/2, 3/4 and all of the profile's size
    (whole granules) and fitted against pixels; what is timed is the pipeline's encode and its
    decode (each slowed here by a known 20 ms, which the samples must contain); the fits survive
    the JSON round trip, and a profile written before them loads with none."""
    import time as _time

    from instgenie.engine.profiling import STAGES, fit_stages, profile_stages, stage_sizes

    pipe = EditPipeline(load_family("sdxl-inpaint:tiny"))
    g = pipe.family.granule
    assert stage_sizes(4 * g, g) == [2 * g, 3 * g, 4 * g] and stage_sizes(g, g) == [g]
    calls = {"encode": 0, "decode": 0}
    for stage, name in (("encode", "encode_inputs"), ("decode", "decode_latents")):
        real = getattr(pipe, name)

        def slowed(*a, _real=real, _stage=stage):  # noqa: ANN002, ANN202
            calls[_stage] += 1
            _time.sleep(0.02)
            return _real(*a)

        monkeypatch.setattr(pipe, name, slowed)
    sizes = stage_sizes(4 * g, g)
    samples = profile_stages(pipe, sizes, warmup=1, iters=2)
    assert calls == {"encode": 3 * 3, "decode": 3 * 3}  # (warm-up + timed) runs per size
    assert set(samples) == set(STAGES)
    for pts in samples.values():
        assert [px for px, _ in pts] == [s * s for s in sizes]
        assert all(ms >= 20.0 for _, ms in pts), pts
    fits = fit_stages(samples)
    assert {k: f.n for k, f in fits.items()} == {"encode": 3, "decode": 3}
    prof = dataclasses.replace(Profile.load_file(PROFILE), stages=fits)
    assert Profile.from_json(prof.to_json()).stages == fits
    old = prof.to_json()
    del old["stages"]
    assert Profile.from_json(old).stages == {}
