"""A capture's served cost (sim/physics.capture_costs, `instgenie profile --capture-from`): read
off a step log as what its steps took beyond their price, only for captures the log holds
whole; written into a profile, it raises the cache-aware router's price of a miss by itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from instgenie.cli import EXIT_INVALID_INPUT, main
from instgenie.scheduler.estimate import Estimator
from instgenie.scheduler.fits import Profile
from instgenie.scheduler.routing import CacheAware
from instgenie.scheduler.views import RouteRequest, WorkerView
from instgenie.sim import physics
from instgenie.sim.models import profile_spec

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "profiles" / "sdxl-inpaint-full-h200.json"
PX = 1024 * 1024


def _log(extra_ms: float, est: Estimator, steps: int = 20) -> list[dict]:
    """A served step log: an edit reading DRAM alone for 3 steps, then a capture run of `steps`
    steps beside it, each of those steps `extra_ms` over its price; a second capture cut off
    after 5 steps."""
    rows = []
    masked = est.work(PX, 20, None, {s: 0.2 for s in est.strides}, "dram")
    full = est.work(PX, 20, None, None, None)
    for i in range(3):
        rows.append({"members": [["1:e", i]], "tiers": {"dram": 1}, "graph": "replay",
                     "duration_ms": est.step_ms([masked])})  # fmt: skip
    for i in range(steps):
        rows.append({"members": [["1:e", 3 + i], ["template:" + "a" * 64, i]],
                     "tiers": {"dram": 1}, "graph": "eager",
                     "duration_ms": est.step_ms([masked, full]) + extra_ms})  # fmt: skip
    for i in range(5):
        rows.append({"members": [["template:" + "b" * 64, i]], "tiers": {}, "graph": "eager",
                     "duration_ms": est.step_ms([full]) + 999.0})  # fmt: skip
    return rows


def test_capture_costs_are_the_steps_beyond_their_price_of_whole_captures() -> None:
    est = Estimator(profile_spec(PROFILE))
    costs = physics.capture_costs(_log(150.0, est), est, PX, 20, 0.2)
    assert costs == [pytest.approx(20 * 150.0)]  # the cut-off capture does not count
    assert physics.capture_costs(_log(150.0, est, steps=19), est, PX, 20, 0.2) == []


def test_capture_runs_are_each_workers_and_a_cold_start_is_not_one() -> None:
    """The log interleaves workers: the same template captured on two of them is two runs (each
    20 steps), and a capture in a worker's first logged step (a registration at start, beside
    the process's cold start) is not counted."""
    est = Estimator(profile_spec(PROFILE))
    a = [dict(r, worker=0, node="n0") for r in _log(100.0, est)]
    b = [dict(r, worker=1, node="n1") for r in _log(200.0, est)]
    mixed = [r for pair in zip(a, b, strict=True) for r in pair]
    assert sorted(physics.capture_costs(mixed, est, PX, 20, 0.2)) == [
        pytest.approx(2000.0), pytest.approx(4000.0)]  # fmt: skip
    cold = [dict(r, worker=2, node="n2") for r in _log(500.0, est)[3:]]  # starts with a capture
    assert physics.capture_costs(cold, est, PX, 20, 0.2) == []
    assert len(physics.capture_costs(mixed + cold, est, PX, 20, 0.2)) == 2


def test_profile_capture_from_writes_the_fit_the_router_prices_a_miss_with(
    tmp_path: Path, capsys
) -> None:  # noqa: ANN001
    path = tmp_path / "p.json"
    base = Profile.load_file(PROFILE)
    path.write_text(json.dumps(dict(base.to_json(), capture=None)))
    est = Estimator(profile_spec(path))
    assert est.capture_step_ms(PX) == 0.0
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in _log(150.0, est)))
    args = ["profile", "-o", str(path), "--capture-from", str(log), "--size", "1024"]
    assert main(args) == 0, capsys.readouterr().err
    new = Profile.load_file(path)
    assert (new.compute, new.load, new.other, new.stages) == (
        base.compute, base.load, base.other, base.stages)  # fmt: skip
    assert new.capture.n == 1 and new.meta["capture_samples"] == [3000.0]
    spec = profile_spec(path)
    assert Estimator(spec).capture_step_ms(PX) == pytest.approx(3000.0 / 20)
    # the router's price of a miss on an idle worker grows by its share of the capture's cost
    req = RouteRequest(template_id="t", num_steps=20, pixels=PX,
                       token_ratios=((16, 0.2), (32, 0.2)))  # fmt: skip
    idle = dict(in_flight=0, slots=16, max_batch=8)
    before = CacheAware().cost_ms(req, WorkerView(0, "cuda:0", cost=est.spec, **idle))
    after = CacheAware().cost_ms(req, WorkerView(0, "cuda:0", cost=spec, **idle))
    assert after == pytest.approx(before + 3000.0 * CacheAware.capture_share)
    # a log without a whole capture, or no log: refused, the profile as it was
    written = path.read_bytes()
    log.write_text("".join(json.dumps(r) + "\n" for r in _log(150.0, est, steps=19)))
    assert main(args) == EXIT_INVALID_INPUT
    assert "holds no capture run of 20 steps" in capsys.readouterr().err
    assert main([*args[:4], str(tmp_path / "none.jsonl"), *args[5:]]) == EXIT_INVALID_INPUT
    assert "capture_from" in capsys.readouterr().err
    assert path.read_bytes() == written
