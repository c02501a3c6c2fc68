"""Mask-aware routing (paper §4.4, Algorithm 2): the worker's CostSpec describes its real model,
the router's mask measurement equals the worker's token masks, the router prices a batch exactly
as the worker's own load planner does, and the policy picks by predicted latency where counting
requests would not."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from instgenie.engine.costspec import cost_spec
from instgenie.engine.family import load_family
from instgenie.engine.imageio import encode_image
from instgenie.engine.masked.tokens import pixel_mask_tensor
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.scheduler.estimate import Estimator, token_ratios
from instgenie.scheduler.fits import LinearFit, Profile
from instgenie.scheduler.planner import plan_step
from instgenie.scheduler.pricing import NOMINAL_FLOPS_PER_MS, batch_flops
from instgenie.scheduler.routing import LeastLoaded, MaskAware
from instgenie.scheduler.spec import BlockSpec, CostSpec
from instgenie.scheduler.views import RouteRequest, WorkerView
from tests.conftest import FAMILIES, make_image, png_bytes, tiny_pipeline

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "sdxl-inpaint-tiny-cpu.json"


def _blob_mask(width: int, height: int, seed: int) -> Image.Image:
    """White ellipses and a stroke at unaligned pixel positions (not on any token grid)."""
    rng = np.random.default_rng(seed)
    m = Image.new("L", (width, height), 0)
    d = ImageDraw.Draw(m)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width - 8)), int(rng.integers(0, height - 8))
        d.ellipse([x0, y0, x0 + int(rng.integers(3, width // 3)),
                   y0 + int(rng.integers(3, height // 3))], fill=255)  # fmt: skip
    d.line([(1, height - 3), (width - 5, 2)], fill=255, width=1)
    return m


# ---- the worker's CostSpec describes its model ---------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_cost_spec_strides_and_widths_match_the_captured_token_grids(family: str) -> None:
    """Every block's stride gives the token count its cache really holds, at a non-square size
    (a wrong level or stride for any block fails), and its width the cached channels."""
    pipe = tiny_pipeline(family)
    spec = cost_spec(pipe)
    g = pipe.family.granule
    w, h = 3 * g, 2 * g
    key = pipe.build_template(
        TemplateSpec(image=png_bytes(make_image(w, h, seed=3)), num_inference_steps=1)
    )
    try:
        shapes = pipe.store.meta(key).block_shapes
    finally:
        pipe.store.delete(key)
    assert [b.block_id for b in spec.blocks] == sorted(shapes)
    for b in spec.blocks:
        assert shapes[b.block_id] == ((h // b.stride) * (w // b.stride), b.channels), b
    strides = {b.stride for b in spec.blocks}  # one token grid (Flux) or one per UNet level
    assert len(strides) == 1 if family == "flux-fill" else len(strides) >= 2
    assert spec.granule == g and spec.cfg == (family != "flux-fill")
    assert spec.compute == {} and spec.profile == ""  # no profile: priced in FLOPs


@pytest.mark.parametrize("family", FAMILIES)
def test_cost_spec_text_length_is_the_prompt_rows_length(family: str) -> None:
    pipe = tiny_pipeline(family)
    g = pipe.family.granule
    req = EditRequest(uid="t", image=png_bytes(make_image(2 * g, 2 * g, seed=1)),
                      mask=png_bytes(_blob_mask(2 * g, 2 * g, 0)), prompt="a hat",
                      num_inference_steps=1)  # fmt: skip
    state = pipe.preprocess(req)
    assert cost_spec(pipe).text_len == state.cond["prompt_embeds"].shape[1]
    assert state.num_rows == (2 if cost_spec(pipe).cfg else 1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_router_token_ratios_equal_the_workers_token_masks(family: str, seed: int) -> None:
    """The server measures a mask the way the worker pools it (any edited pixel marks its token):
    ratio * L is the worker's masked token count, exactly, at every stride."""
    fam = tiny_pipeline(family).family
    spec = cost_spec(tiny_pipeline(family))
    g = fam.granule
    w, h = 5 * g, 3 * g
    mask = _blob_mask(w, h, seed)
    worker = fam.token_masks(pixel_mask_tensor(mask))
    ratios = token_ratios(np.asarray(mask) >= 128, sorted({b.stride for b in spec.blocks}))
    for s, r in ratios.items():
        L = (w // s) * (h // s)
        assert r * L == pytest.approx(int(worker[L].sum()), abs=1e-9), (s, L)
    pixel = float((np.asarray(mask) >= 128).mean())
    assert min(ratios.values()) >= pixel  # pooling never shrinks a mask


# ---- the router prices a batch as the worker's planner does ----------------------------------


def _profiled_pipe(load_slope: float) -> EditPipeline:
    prof = Profile.load_file(PROFILE)
    # a positive intercept: each request's copy pays it (the worker prices loads per request)
    dram = dataclasses.replace(prof.load["dram"], slope=load_slope, intercept=0.05)
    other = LinearFit(slope=2e-5, intercept=1.5, r2=1.0, n=2)  # the rest of the step
    prof = dataclasses.replace(prof, load={"dram": dram}, other=other)
    return EditPipeline(load_family("sdxl-inpaint:tiny"), profile=prof)


class _HostHandle:
    """A device-resident cache handle that claims to live in host memory (loads are planned)."""

    def __init__(self, inner) -> None:
        self.inner, self.device = inner, torch.device("meta")

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("tier, load_slope", [("gpu", 1e-9), ("dram", 3e-7), ("dram", 1e-3)])
def test_router_step_price_equals_the_workers_plan(tier: str, load_slope: float) -> None:
    """Two masked edits (other masks) and one full-path edit in one batch: the router's
    step_ms from the CostSpec and measured masks is the latency of the plan the worker's load
    planner makes for those very request states (resident cache: no loads; host cache: loads
    cheap, comparable, absurd), plus the profile's rest of the step at the batch's rows."""
    pipe = _profiled_pipe(load_slope)
    spec = cost_spec(pipe, str(PROFILE))
    assert spec.compute and spec.profile == str(PROFILE)
    g, steps = pipe.family.granule, 2
    w, h = 4 * g, 2 * g
    image = png_bytes(make_image(w, h, seed=4))
    key = pipe.build_template(TemplateSpec(image=image, num_inference_steps=steps))
    masks = [_blob_mask(w, h, 10), _blob_mask(w, h, 11), _blob_mask(w, h, 12)]
    states = []
    for i, m in enumerate(masks):
        masked = i < 2
        req = EditRequest(uid=f"r{i}", image=None if masked else image, mask=png_bytes(m),
                          template_id=key if masked else None, prompt="p", seed=i,
                          num_inference_steps=steps)  # fmt: skip
        s = pipe.preprocess(req)
        assert s.path == ("masked" if masked else "full")
        if masked and tier == "dram":
            s.cache_handle = _HostHandle(s.cache_handle)
        states.append(s)
    worker_costs = pipe.cost_model.costs(states)
    worker_ms = plan_step(worker_costs).latency_ms
    est = Estimator(spec)
    works = [
        est.work(
            w * h,
            steps,
            None,
            token_ratios(np.asarray(m) >= 128, est.strides),
            tier if i < 2 else None,
        )  # fmt: skip
        for i, m in enumerate(masks)
    ]
    # every block's three costs, not only the plan's sum: one pricing function
    # (scheduler.pricing.step_costs) called by both, with the same CostSpec, gives equal floats
    assert pipe.cost_model.spec == cost_spec(pipe)  # the planner prices with the spec it sends
    mine = est.block_costs(w * h, works)
    assert mine == worker_costs
    assert mine.num_blocks == len(spec.blocks) and max(mine.compute_full) > 0
    assert (max(mine.load) > 0) == (tier == "dram")
    rest = 1.5 + 2e-5 * sum(s.num_rows for s in states) * w * h
    assert spec.other is not None and est.other_ms(6 * w * h) == pytest.approx(rest)
    assert est.step_ms(works) == pytest.approx(worker_ms + rest, rel=1e-9)
    assert worker_ms > 0
    pipe.store.delete(key)


def test_without_a_profile_a_step_is_priced_in_flops() -> None:
    """No fits: a masked request costs its masked FLOPs (at the nominal rate), a full-path one
    its full FLOPs; the ratio is the FLOP ratio of paper Table 1 with keys/values on all tokens."""
    spec = cost_spec(tiny_pipeline("sdxl-inpaint"))
    est = Estimator(spec)
    px, m = 256 * 256, 0.2
    masked = est.step_ms([est.work(px, 1, None, dict.fromkeys(est.strides, m), "gpu")])
    full = est.step_ms([est.work(px, 1, None, dict.fromkeys(est.strides, m), None)])
    want_masked = want_full = 0
    for d in spec.blocks:
        L = px // (d.stride * d.stride)
        want_masked += batch_flops(d, L, [round(m * L)] * 2, spec.text_len)
        want_full += batch_flops(d, L, [L] * 2, spec.text_len)
    assert masked == pytest.approx(want_masked / NOMINAL_FLOPS_PER_MS, rel=1e-12)
    assert full == pytest.approx(want_full / NOMINAL_FLOPS_PER_MS, rel=1e-12)
    assert 0.2 < masked / full < 0.6
    # guidance <= 1 runs one row instead of two: half the price
    one_row = est.step_ms([est.work(px, 1, 1.0, None, None)])
    assert one_row == pytest.approx(full / 2, rel=1e-12)


# ---- the policy ----------------------------------------------------------------------------------

SPEC = CostSpec(
    model="synthetic", granule=32, text_len=77, cfg=True, default_guidance=7.5,
    default_steps=20, cache_dtype="float16",
    blocks=[BlockSpec(block_id=i, kind="unet", channels=c, ff_macs=12 * c * c,
                      context_dim=c, mlp=0, stride=s)
            for i, (c, s) in enumerate([(320, 16), (320, 16), (640, 32), (640, 32)])],
)  # fmt: skip
PX = 1024 * 1024
RATIOS = ((16, 0.05), (32, 0.06))


def _req(template: str | None, ratios=RATIOS, steps: int = 20) -> RouteRequest:
    return RouteRequest(template_id=template, num_steps=steps, pixels=PX, mask_ratio=0.05,
                        token_ratios=ratios)  # fmt: skip


def _worker(index: int, held: list[RouteRequest], ready=("T",), max_batch: int = 8,
            cost: CostSpec | None = SPEC, slots: int = 16) -> WorkerView:  # fmt: skip
    return WorkerView(index=index, device=f"cuda:{index}", in_flight=len(held), slots=slots,
                      templates_ready=frozenset(ready), template_tiers=dict.fromkeys(ready, "gpu"),
                      requests=tuple(held), max_batch=max_batch, cost=cost)  # fmt: skip


def test_mask_aware_routes_by_predicted_latency_where_counting_requests_does_not() -> None:
    """Worker 0 holds two full-path edits, worker 1 three small-mask template edits. Counting
    requests sends the next small edit to worker 0; its predicted latency there is higher."""
    workers = [_worker(0, [_req(None), _req(None)]), _worker(1, [_req("T")] * 3)]
    new = _req("T")
    policy = MaskAware()
    c0, c1 = (policy.cost_ms(new, w) for w in workers)
    assert c1 < c0
    assert LeastLoaded().choose(new, workers) == 0
    assert policy.choose(new, workers) == 1
    est = policy.estimator(SPEC)
    held0 = [est.work(PX, 20, None, None, None)] * 2
    assert c0 == pytest.approx(20 * est.step_ms([*held0, est.work(PX, 20, None, dict(RATIOS),
                                                                   "gpu")]))  # fmt: skip


def test_mask_aware_prices_the_full_path_where_the_template_is_not_ready() -> None:
    """Template T is ready only on worker 1, which holds one edit: the new edit would run the
    full path on the idle worker 0, which is slower than sharing worker 1's step."""
    workers = [_worker(0, [], ready=()), _worker(1, [_req("T")])]
    new = _req("T")
    policy = MaskAware()
    assert policy.cost_ms(new, workers[1]) < policy.cost_ms(new, workers[0])
    assert policy.choose(new, workers) == 1
    assert LeastLoaded().choose(new, workers) == 0
    # an unregistered image runs the full path everywhere: the idle worker wins
    assert policy.choose(_req(None), workers) == 0


def test_a_worker_at_its_batch_limit_adds_the_wait_for_a_place() -> None:
    held = [_req("T")] * 3
    w = _worker(0, held, max_batch=2)
    policy = MaskAware()
    est = policy.estimator(SPEC)
    small = est.work(PX, 20, None, dict(RATIOS), "gpu")
    step_full_batch = est.step_ms([small, small])
    wait = (3 - 2 + 1) * 20 * step_full_batch / 2
    assert policy.cost_ms(_req("T"), w) == pytest.approx(wait + 20 * step_full_batch)
    # the same worker below its limit: no wait
    assert policy.cost_ms(_req("T"), _worker(0, held[:1], max_batch=2)) == pytest.approx(
        20 * step_full_batch
    )


def test_requests_about_to_finish_cost_only_their_remaining_steps() -> None:
    """Worker 0 holds a full-path edit with one step left, worker 1 a small edit just started:
    the new edit shares one step on worker 0 and then runs alone (counting requests, or pricing
    a whole lifetime with the held batch, would see a tie or prefer worker 1)."""
    done = dataclasses.replace(_req(None), steps_done=19)
    workers = [_worker(0, [done]), _worker(1, [_req("T")])]
    policy = MaskAware()
    est = policy.estimator(SPEC)
    full, small = est.work(PX, 20, None, None, None), est.work(PX, 20, None, dict(RATIOS), "gpu")
    want0 = est.step_ms([full, small]) + 19 * est.step_ms([small])
    assert policy.cost_ms(_req("T"), workers[0]) == pytest.approx(want0)
    assert policy.cost_ms(_req("T"), workers[1]) == pytest.approx(20 * est.step_ms([small] * 2))
    assert policy.choose(_req("T"), workers) == 0
    # a request with no step left (in post-processing) takes no place in the batch
    post = dataclasses.replace(_req(None), steps_done=20)
    assert policy.cost_ms(_req("T"), _worker(0, [post])) == pytest.approx(20 * est.step_ms([small]))


def test_mask_aware_respects_room_and_falls_back_without_a_cost_spec() -> None:
    policy = MaskAware()
    cheap_but_full = _worker(1, [], slots=0)
    assert policy.choose(_req("T"), [_worker(0, [_req(None)] * 4), cheap_but_full]) == 0
    assert policy.choose(_req("T"), [cheap_but_full]) is None
    unpriced = [_worker(0, [_req(None)] * 2), _worker(1, [_req("T")] * 3, cost=None)]
    assert policy.choose(_req("T"), unpriced) == LeastLoaded().choose(_req("T"), unpriced) == 0


def test_mask_size_changes_the_choice() -> None:
    """Same request counts, different masks: a large mask held on worker 0 costs more than
    small ones on worker 1; swapping the masks swaps the choice."""
    big, small = ((16, 0.6), (32, 0.6)), ((16, 0.02), (32, 0.03))
    policy = MaskAware()
    a = [_worker(0, [_req("T", big)] * 2), _worker(1, [_req("T", small)] * 2)]
    b = [_worker(0, [_req("T", small)] * 2), _worker(1, [_req("T", big)] * 2)]
    assert policy.choose(_req("T"), a) == 1
    assert policy.choose(_req("T"), b) == 0


def test_encoded_masks_measure_like_decoded_ones() -> None:
    """Runtime's mask_facts (what the server runs on an uploaded mask) agrees with token_ratios
    of the decoded mask and with the pixel mask ratio the worker reports."""
    from instgenie.config import LimitsConfig
    from instgenie.engine.imageio import mask_ratio
    from instgenie.server.runtime import mask_facts

    mask = _blob_mask(96, 64, 7)
    ratio, ratios = mask_facts(encode_image(mask, "png"), (96, 64), (96, 64), LimitsConfig(),
                               [8, 16])  # fmt: skip
    assert ratio == mask_ratio(mask)
    assert ratios == token_ratios(np.asarray(mask) >= 128, [8, 16])


@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_masks_are_measured_at_the_working_size(family: str) -> None:
    """An edit at another size than its image (OpenAI `size`, or an image not a multiple of
    the granule): the worker resizes the mask (nearest) before pooling it, so does the server
    (before: it measured the uploaded size and under-counted a downscaled mask 1.5-1.8x)."""
    from instgenie.config import LimitsConfig
    from instgenie.server.runtime import mask_facts

    fam = tiny_pipeline(family).family
    spec = cost_spec(tiny_pipeline(family))
    strides = sorted({b.stride for b in spec.blocks})
    g = fam.granule
    big, work = (8 * g, 6 * g), (4 * g, 3 * g)
    mask = _blob_mask(*big, 5)
    _, ratios = mask_facts(encode_image(mask, "png"), big, work, LimitsConfig(), strides)
    worker = fam.token_masks(pixel_mask_tensor(mask.resize(work, Image.Resampling.NEAREST)))
    for s, r in ratios.items():
        L = (work[0] // s) * (work[1] // s)
        assert r * L == pytest.approx(int(worker[L].sum()), abs=1e-9), (s, L)


def test_strength_below_one_prices_the_steps_it_runs() -> None:
    """strength < 1 runs int(steps * strength) steps; a held request whose Progress says it
    ran all of its (fewer) steps takes no place in the batch."""
    policy = MaskAware()
    est = policy.estimator(SPEC)
    assert est.work(PX, 20, None, dict(RATIOS), "gpu", strength=0.3).steps == 6
    assert est.work(PX, 20, None, dict(RATIOS), "gpu", strength=0.01).steps == 1
    small = est.work(PX, 20, None, dict(RATIOS), "gpu")
    new = dataclasses.replace(_req("T"), strength=0.5)
    assert policy.cost_ms(new, _worker(0, [])) == pytest.approx(10 * est.step_ms([small]))
    finished = dataclasses.replace(_req(None), num_steps=6, steps_done=6)  # its Progress
    assert policy.cost_ms(_req("T"), _worker(0, [finished])) == pytest.approx(
        20 * est.step_ms([small])
    )


def test_a_worker_whose_cost_spec_cannot_be_fetched_still_starts(monkeypatch) -> None:  # noqa: ANN001
    """The cost spec only informs routing: a worker that dies or times out while it is asked
    for it is not failed by that (before: the error escaped the start, and a restarted worker
    stayed `failed` for good); it is up, priced by load."""
    from types import SimpleNamespace

    from instgenie.config import Config
    from instgenie.server import pool as pool_mod
    from instgenie.worker.client import WorkerError

    def boom(timeout=None):  # noqa: ANN001, ANN202
        raise WorkerError("worker_died", "the worker exited", retryable=True)

    class FakeHandle:
        def __init__(self, config) -> None:  # noqa: ANN001
            self.pid, self.client = 1, SimpleNamespace(cost_spec=boom)

        def wait_ready(self, timeout: float) -> None:
            pass

    monkeypatch.setattr(pool_mod, "WorkerHandle", FakeHandle)
    pool = pool_mod.WorkerPool([Config()], slots=2, start_timeout_s=5)
    try:
        pool._start(pool.slots[0])
        assert pool.slots[0].state == "up" and pool.slots[0].cost is None
    finally:
        pool._executor.shutdown(wait=False)


# ---- the loop's per-request work (profile stages) ------------------------------------------------

FITTED = dataclasses.replace(SPEC, compute={
    f"unet:{c}/{mode}": LinearFit(slope=slope, intercept=0.05)
    for c in (320, 640) for mode, slope in (("cached", 2e-12), ("full", 1.8e-12))
})  # fmt: skip
STAGES = {
    "encode": LinearFit(slope=1e-4, intercept=20.0),
    "decode": LinearFit(slope=5e-5, intercept=10.0),
}
STAGED = dataclasses.replace(FITTED, stages=STAGES)


def _on(spec: CostSpec, w: WorkerView) -> WorkerView:
    return dataclasses.replace(w, cost=spec)


def test_the_loops_encode_and_decode_are_priced_between_steps() -> None:
    """Held: a quarter-size full-path edit with 5 steps left and a masked edit not started. The
    new edit's cost adds the two encodes (its own, and the held one's, which may not have run),
    the decode of the edit leaving after 5 steps, and the batched decode of both at its end;
    each at its own pixels. Without stage fits, or without a profile (nominal FLOP prices, other
    units), none of it."""
    quarter = dataclasses.replace(_req(None), pixels=PX // 4, steps_done=15)
    fresh = _req("T")
    w = _worker(0, [quarter, fresh])
    policy = MaskAware()
    est = policy.estimator(STAGED)
    near, small = (
        est.work(PX // 4, 20, None, None, None),
        est.work(PX, 20, None, dict(RATIOS), "gpu"),
    )

    def enc(px: int) -> float:
        return 1e-4 * px + 20.0

    def dec(px: int) -> float:
        return 5e-5 * px + 10.0

    steps = 5 * est.step_ms([near, small, small]) + 15 * est.step_ms([small, small])
    want = 2 * enc(PX) + steps + dec(PX // 4) + 2 * dec(PX)
    assert policy.cost_ms(_req("T"), _on(STAGED, w)) == pytest.approx(want, rel=1e-12)
    assert policy.cost_ms(_req("T"), _on(FITTED, w)) == pytest.approx(steps, rel=1e-12)
    unfitted = dataclasses.replace(STAGED, compute={})
    assert policy.estimator(unfitted).stage_ms("encode", PX) == 0.0
    # a held request that has started was encoded: only the new one's encode is priced
    started = dataclasses.replace(fresh, steps_done=1)
    got = policy.cost_ms(_req("T"), _on(STAGED, _worker(0, [quarter, started])))
    steps = 5 * est.step_ms([near, small, small]) + 14 * est.step_ms([small, small])
    assert got == pytest.approx(enc(PX) + steps + dec(PX // 4) + dec(PX) + est.step_ms([small])
                                + dec(PX), rel=1e-12)  # fmt: skip


def test_decodes_of_requests_about_to_leave_change_the_choice() -> None:
    """Worker 0 holds four small edits with one step left, worker 1 one full-path edit half
    done. By steps alone worker 0 is cheaper (four cheap steps shared once); with the loop's
    decode of the four before the new edit's second step, worker 1 is."""
    almost = dataclasses.replace(_req("T"), steps_done=19)
    busy = dataclasses.replace(_req(None), steps_done=10)
    policy = MaskAware()
    for spec, choice in ((FITTED, 0), (STAGED, 1)):
        workers = [_on(spec, _worker(0, [almost] * 4)), _on(spec, _worker(1, [busy]))]
        assert policy.choose(_req("T"), workers) == choice, spec.stages


def test_the_cost_spec_carries_stage_fits_only_where_the_loop_runs_them() -> None:
    """The profile's encode/decode fits hold up the loop's steps only where the loop runs them
    (model_stages="loop", the default); with model_stages="process" they run beside it."""
    pipe = _profiled_pipe(1e-9)
    fits = pipe.profile.stages
    assert set(fits) == {"encode", "decode"}  # the committed tiny profile has them
    spec = cost_spec(pipe, str(PROFILE))
    assert spec.stages == fits  # the profile's own fits (one LinearFit type)
    assert cost_spec(pipe, str(PROFILE), loop_stages=False).stages == {}
    assert Estimator(spec).stage_ms("decode", 128 * 128) == pytest.approx(
        fits["decode"].predict(128 * 128), rel=1e-12
    )
