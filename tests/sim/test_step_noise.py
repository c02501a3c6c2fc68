"""Step-time noise in the simulator (physics.replay_sigma / eager_sigma, Scenario.seed): fitted as
the spread of a served step log's steps about their fitted times; drawn per step from a seed, so
one seed is one result, another seed another, and no seed (or no spread) the fitted times."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from instgenie.scheduler.estimate import Estimator
from instgenie.scheduler.routing import LeastLoaded
from instgenie.sim import physics, workload
from instgenie.sim.catalogue import Catalogue, cache_bytes
from instgenie.sim.engine import Engine
from instgenie.sim.models import profile_spec
from instgenie.sim.physics import StepPhysics
from instgenie.sim.scenario import Cluster, Scenario

ROOT = Path(__file__).resolve().parents[2]
SDXL = profile_spec(ROOT / "profiles" / "sdxl-inpaint-full-h200.json")
EST = Estimator(SDXL)
PX = 1024 * 1024
NB = cache_bytes(SDXL, PX, 20, 2)


def test_fit_reads_the_spread_of_replayed_and_eager_steps() -> None:
    rng = np.random.default_rng(0)
    masked = EST.work(PX, 20, None, {s: 0.2 for s in EST.strides}, "dram")
    full = EST.work(PX, 20, None, None, None)
    replay_noise, eager_noise = rng.normal(0, 0.1, 200), rng.normal(0, 0.3, 100)
    rows = [{"members": [["1:e", 5]], "tiers": {"dram": 1}, "graph": "replay",
             "duration_ms": 0.6 * EST.step_ms([masked]) * math.exp(x)}
            for x in replay_noise]  # fmt: skip
    rows += [{"members": [["1:e", 5], ["template:" + "a" * 64, 7]], "tiers": {"dram": 1},
              "graph": "eager", "duration_ms": 1.7 * EST.step_ms([masked, full]) * math.exp(x)}
             for x in eager_noise]  # fmt: skip
    got = physics.fit(rows, EST, PX, 20, 0.2, NB)
    # the scales are medians; the spread is about them (a shift of the logs leaves it as is)
    assert got.replay_sigma == pytest.approx(statistics.pstdev(replay_noise), rel=1e-9)
    assert got.eager_sigma == pytest.approx(statistics.pstdev(eager_noise), rel=1e-9)
    assert got.replay_scale == pytest.approx(0.6, rel=0.05)


def _finish_times(physics_: StepPhysics, seed: int | None) -> list[float]:
    ratios = tuple((s, 0.2) for s in EST.strides)
    cat = Catalogue(("t0", "t1"), np.array([0.5, 0.5]), NB)
    arrivals = [workload.Arrival(700.0 * i, i % 2, 0.2, ratios) for i in range(12)]
    sc = Scenario(SDXL, Cluster(2, 1, NB, 0), cat, arrivals, initial={"t0": [0], "t1": [1]},
                  physics=physics_, seed=seed)  # fmt: skip
    return [j.finish_ms for j in Engine(sc, LeastLoaded()).run().requests]


def test_a_seed_is_one_draw_and_no_seed_or_no_spread_is_the_fitted_times() -> None:
    noisy = StepPhysics(replay_scale=0.6, eager_scale=1.7, replay_sigma=0.2, eager_sigma=0.3)
    fitted = _finish_times(noisy, None)
    assert _finish_times(noisy, 1) == _finish_times(noisy, 1)
    assert _finish_times(noisy, 1) != _finish_times(noisy, 2)
    assert _finish_times(noisy, 1) != fitted
    calm = dataclasses.replace(noisy, replay_sigma=0.0, eager_sigma=0.0)
    assert _finish_times(calm, 1) == fitted == _finish_times(calm, None)


def test_simulate_step_noise_draws_from_the_physics_with_the_seed(tmp_path: Path) -> None:
    from instgenie.cli import main

    StepPhysics(replay_scale=0.6, eager_scale=1.7, replay_sigma=0.2, eager_sigma=0.3,
                outside_ms=400.0).save(tmp_path / "physics.json")  # fmt: skip
    base = ["simulate", "--hosts", "2", "--gpus", "1", "--templates", "6", "--rate", "0.5",
            "--requests", "12", "--policies", "least-loaded", "--no-ideal",
            "--physics", str(tmp_path / "physics.json")]  # fmt: skip

    def p50(name: str, *extra: str) -> float:
        assert main([*base, *extra, "--out", str(tmp_path / name)]) == 0
        report = (tmp_path / name / "report.json").read_text()
        return json.loads(report)["results"]["least-loaded"]["latency_ms"]["p50"]

    fitted = p50("fitted")
    assert p50("fitted-again") == fitted  # no --step-noise: no draw
    a, b = p50("a", "--step-noise"), p50("b", "--step-noise")
    assert a == b != fitted
    with pytest.raises(SystemExit, match="--step-noise needs --physics"):
        main([*base[:-2], "--step-noise", "--out", str(tmp_path / "none")])
