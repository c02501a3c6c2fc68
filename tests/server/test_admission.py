"""Issue 23 item 2: no request holds a worker hostage. Per-family pixel caps (413), admission by
cost (422), the oversize policy, cancellation at stage boundaries, degraded health and routing
around a worker whose loop overruns a stage."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from instgenie.config import LimitsConfig
from instgenie.engine.costspec import cost_spec
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.sizing import native_side, resolve_limits, working_size
from instgenie.errors import TooManyPixelsError
from instgenie.server.admission import DEFAULT_COST_BUDGET, CostAdmission
from instgenie.server.errors import ApiError
from instgenie.worker.client import WorkerError
from tests.conftest import make_image, make_mask, png_bytes
from tests.server.test_harness import ServerProcess, edit_files, image_png
from tests.worker.test_worker import FAULTS, STEP_DEADLINE_S, _config, _fields, _worker

FAMILIES = ("sd2-inpaint", "sdxl-inpaint", "flux-fill")


# ---- pixel caps and working sizes ----------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_native_sides_match_the_adapters_and_set_the_default_cap(family: str) -> None:
    pipe = EditPipeline.load(f"{family}:tiny")
    assert native_side(f"{family}:tiny") == pipe.family.default_size == 128
    assert pipe.limits.max_image_pixels == 4 * 128 * 128  # resolved from 0
    full = resolve_limits(LimitsConfig(), native_side(f"{family}:full")).max_image_pixels
    assert (
        full == {"sd2-inpaint": 512**2, "sdxl-inpaint": 1024**2, "flux-fill": 1024**2}[family] * 4
    )
    assert resolve_limits(LimitsConfig(max_image_pixels=7), 1024).max_image_pixels == 7


def test_working_size_refuses_or_resizes_to_the_native_area() -> None:
    refuse = LimitsConfig(max_image_pixels=65536)
    assert working_size(250, 130, 16, 128, refuse) == (240, 128)
    with pytest.raises(TooManyPixelsError, match="--oversize resize"):
        working_size(4096, 4096, 16, 128, refuse)
    resize = LimitsConfig(max_image_pixels=65536, oversize="resize")
    w, h = working_size(4096, 2048, 16, 128, resize)
    assert (
        (w % 16, h % 16) == (0, 0) and w * h <= 128 * 128 and abs(w / h - 2) < 0.25
    )  # granule rounding
    assert working_size(200, 200, 16, 128, resize) == (192, 192)  # under the cap: as is
    with pytest.raises(TooManyPixelsError, match="--max-input-pixels"):
        working_size(9000, 9000, 16, 128, resize)


def test_oversize_resize_returns_the_input_size_with_unmasked_pixels_kept() -> None:
    family = "sdxl-inpaint"
    image, mask = make_image(384, 256, seed=3), make_mask(384, 256)
    req = EditRequest(uid="big", image=png_bytes(image), mask=png_bytes(mask), prompt="a hat",
                      seed=1, num_inference_steps=1)  # fmt: skip
    with pytest.raises(TooManyPixelsError):  # 98304 pixels > 65536: refused by default
        EditPipeline.load(f"{family}:tiny").run([req])
    pipe = EditPipeline.load(f"{family}:tiny", limits=LimitsConfig(oversize="resize"))
    inputs = pipe.decode_inputs(req)
    assert inputs.width * inputs.height <= 128 * 128 and inputs.width > inputs.height
    out = pipe.run([req])[0].image
    assert out.size == (384, 256)
    keep = np.asarray(mask) < 128
    assert np.array_equal(np.asarray(out)[keep], np.asarray(image.convert("RGB"))[keep])


# ---- cost ----------------------------------------------------------------------------------------
def test_cost_is_priced_in_native_edits_and_refused_over_budget() -> None:
    spec = cost_spec(EditPipeline.load("sd2-inpaint:tiny"))
    adm = CostAdmission(128, 0.0, 0.0)
    assert adm.max_cost == DEFAULT_COST_BUDGET
    assert adm.price(spec, 128 * 128, None, None).units == pytest.approx(1.0)
    # linear in steps; more than linear in pixels (attention)
    p20, p40 = (adm.price(spec, 256 * 256, n, None).units for n in (20, 40))
    assert p40 == pytest.approx(2 * p20) and p20 > 4 * 20 / 50
    assert adm.check([spec], 256 * 256, 20, None) is not None  # the demo's edit: admitted
    with pytest.raises(ApiError) as e:  # the request: 4096^2, one step
        adm.check([spec], 4096 * 4096, 1, None)
    assert (e.value.status_code, e.value.code, e.value.field) == (
        422,
        "too_costly",
        "num_inference_steps",
    )
    assert "--max-request-cost" in e.value.message
    assert CostAdmission(128, 1e9, 0.0).check([spec], 4096 * 4096, 1, None) is not None
    assert adm.check([], 4096 * 4096, 1, None) is None  # no worker priced yet: not refused
    assert adm.price(spec, 128 * 128, None, None).seconds is None  # no profile: no seconds


def test_seconds_budget_applies_with_a_profile() -> None:
    from instgenie.engine.family import load_family
    from instgenie.scheduler.fits import Profile

    profile = Profile.load_file(
        str(Path(__file__).parents[2] / "profiles/sdxl-inpaint-tiny-cpu.json")
    )
    pipe = EditPipeline(load_family("sdxl-inpaint:tiny"), profile=profile)
    spec = cost_spec(pipe, "p.json")
    price = CostAdmission(128, 0.0, 0.0).price(spec, 256 * 256, 50, None)
    assert price.seconds is not None and price.seconds > 0
    with pytest.raises(ApiError, match="--max-request-seconds"):
        CostAdmission(128, 1e9, price.seconds / 2).check([spec], 256 * 256, 50, None)


# ---- stage boundaries (one worker) ---------------------------------------------------------------
def test_cancel_while_the_loop_encodes_another_drops_it_before_its_encode(tmp_path: Path) -> None:
    """A request cancelled while it waits in the loop's inbox behind a long encode is dropped
    at the next stage boundary: it is never encoded (its prompt stays uncached)."""
    gate = tmp_path / "gate"
    gate.touch()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INSTGENIE_FAULT_GATE", str(gate))
        ctx = _worker(_config(stall_timeout_s=120.0), FAULTS + ",slowenc=SLOW-ENCODE")
        h, _ = ctx.__enter__()
    try:
        c = h.client
        slow = c.edit(**_fields("slow", 1, prompt="SLOW-ENCODE"))
        _until(lambda: c.stats().get("loop_busy_encode") == 1.0, "the loop never held the encode")
        unique = "a prompt nobody else sends 41c7"
        queued = c.edit(**_fields("queued", 1, seed=5, prompt=unique))
        _until(lambda: c.stats()["in_loop"] == 2.0, "the second request never reached the loop")
        c.cancel("queued")
        with pytest.raises(WorkerError, match="cancelled"):
            queued.result(10)
        gate.unlink()
        assert slow.result(STEP_DEADLINE_S).num_steps == 1
        before = c.stats()["prompt_misses"]
        assert c.run_edit(**_fields("again", 1, seed=6, prompt=unique)).num_steps == 1
        assert c.stats()["prompt_misses"] > before  # the cancelled one never ran its encode
    finally:
        gate.unlink(missing_ok=True)
        ctx.__exit__(None, None, None)


def _until(cond, why: str, timeout: float = STEP_DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


# ---- the server: refusals, degraded health, routing, cancel (two workers) ------------------------
def test_server_refuses_the_4096_png_and_routes_around_an_overrunning_stage() -> None:
    srv = ServerProcess("--devices", "cpu,cpu", "--routing", "round-robin",
                        "--stage-overrun-s", "1", "--stall-s", "60")  # fmt: skip
    try:
        # 1. the request: a 4096^2 PNG of a few KB, one step: 413 by default, both routes
        big = png_bytes(Image.new("RGB", (4096, 4096), (90, 120, 150)))
        big_mask = png_bytes(make_mask(4096, 4096))
        assert len(big) < 100_000
        r = srv.post("/v1/edits", files=edit_files(big, big_mask),
                     data={"prompt": "x", "num_inference_steps": "1"})  # fmt: skip
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["field"]) == (413, "image_too_large", "image")
        assert (
            "the limit is 65536 pixels" in err["message"] and "--max-image-pixels" in err["message"]
        )
        r = srv.post("/v1/images/edits", data={"prompt": "x"},
                     files={"image": ("i.png", big), "mask": ("m.png", big_mask)})  # fmt: skip
        assert r.status_code == 413
        # 2. within the pixel cap, over the cost budget (256^2 at 200 steps = ~50 native edits)
        files = edit_files(image_png(size=256), png_bytes(make_mask(256, 256)))
        r = srv.post("/v1/edits", files=files, data={"prompt": "x", "num_inference_steps": "200"})
        err = r.json()["error"]
        assert (r.status_code, err["code"]) == (422, "too_costly") and "--max-request-cost" in err[
            "message"
        ]
        # 3. a held encode: the job says where it is, /health says degraded
        srv.gate.touch()
        r = srv.post("/v1/edits?async=true", files=edit_files(image_png(1)),
                     data={"prompt": "SLOW-ENCODE"})  # fmt: skip
        job = r.json()["id"]
        _until(lambda: srv.get(f"/v1/jobs/{job}").json()["stage"] == "encode", "never encoding")
        assert srv.get(f"/v1/jobs/{job}").json()["status"] == "running"
        body = _wait_degraded(srv)
        held = next(w["index"] for w in body["workers"] if w["status"] == "degraded")
        row = body["workers"][held]
        # degraded once past the 1 s limit; /health rounds busy_s to ms (1.0004 s reads 1.0)
        assert row["busy_stage"] == "encode" and row["busy_s"] >= 1 and "encode" in row["reason"]
        # round-robin would give the overrunning worker every other request: it gets none
        for i in range(2):
            t0 = time.monotonic()
            r = srv.post("/v1/edits", files=edit_files(image_png(i)), data={"prompt": "x"},
                         timeout=STEP_DEADLINE_S)  # fmt: skip
            assert r.status_code == 200 and r.json()["worker"] != held, r.text
            assert time.monotonic() - t0 < STEP_DEADLINE_S
        # 4. cancel takes effect at once; the worker drops the request at its next boundary
        t0 = time.monotonic()
        assert srv.delete(f"/v1/jobs/{job}").json()["status"] == "cancelled"
        assert time.monotonic() - t0 < 5
        srv.gate.unlink()
        _until(lambda: srv.health()[1]["status"] == "ok", "never ok again")
        assert srv.worker(held)["steps_total"] == 0  # the cancelled request ran no step
        for i in range(2):
            r = srv.post("/v1/edits", files=edit_files(image_png(i)), data={"prompt": "x"},
                         timeout=STEP_DEADLINE_S)  # fmt: skip
            assert r.status_code == 200
    finally:
        srv.gate.unlink(missing_ok=True)
        srv.stop()


def _wait_degraded(srv: ServerProcess) -> dict:
    deadline = time.monotonic() + STEP_DEADLINE_S
    while True:
        status, body = srv.health()
        if body["status"] == "degraded":
            assert status == 200
            return body
        assert time.monotonic() < deadline, f"never degraded: {body}"
        time.sleep(0.1)


# ---- degraded: beyond the stage's expected time -------------------------------------------------
def test_a_stage_overruns_past_a_multiple_of_its_profiled_time() -> None:
    from dataclasses import replace

    from instgenie.config import Config
    from instgenie.scheduler.fits import LinearFit
    from instgenie.scheduler.routing import RouteRequest
    from instgenie.server.pool import STAGE_OVERRUN_FACTOR, STAGE_OVERRUN_FLOOR_S, WorkerSlot

    spec = cost_spec(EditPipeline.load("sd2-inpaint:tiny"))
    slot = WorkerSlot(0, Config(), 4, state="up")
    slot.stats = {"loop_busy_s": 9.0, "loop_busy_encode": 1.0}
    assert slot.busy() == ("encode", 9.0)
    # no price (no cost spec, or FLOP-priced without a profile): the configured limit
    assert slot.overrun(30.0) == ""
    assert "over 8 s" in slot.overrun(8.0)
    # a profile prices the encode of a 1 MP request at 2 s: 4x that is the limit
    fit = LinearFit(slope=2e3 / 1e6, intercept=0.0)  # ms per pixel
    slot.cost = replace(spec, compute={"x": fit}, stages={"encode": fit})
    slot.routes = {"a": RouteRequest(None, 20, 256 * 256), "b": RouteRequest(None, 20, 10**6)}
    assert slot.stage_limit_s("encode", 30.0) == (STAGE_OVERRUN_FACTOR * 2.0, 2.0)
    assert "over 8 s: expected 2.0 s" in slot.overrun(30.0)  # 9 s in it: degraded
    slot.stats["loop_busy_s"] = 7.5
    assert slot.overrun(30.0) == ""
    # a cheap stage never overruns before the floor; the config stays the upper bound
    slot.routes = {"a": RouteRequest(None, 20, 256 * 256)}
    assert slot.stage_limit_s("encode", 30.0)[0] == STAGE_OVERRUN_FLOOR_S
    slot.routes = {"b": RouteRequest(None, 20, 100 * 10**6)}
    assert slot.stage_limit_s("encode", 30.0)[0] == 30.0
    assert slot.stage_limit_s("decode", 30.0) == (30.0, 0.0)  # that stage is not priced
