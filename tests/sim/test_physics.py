"""The simulator's served-loop step physics (sim/physics.py) and the tiers' capture reservation:
a step log made with known physics is fitted back to them; a simulated step takes them; a
capture reserves DRAM at its start, never evicts an entry in use, and records nothing (and pays no
pinning) without room."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from instgenie.scheduler.estimate import Estimator
from instgenie.scheduler.routing import CacheAware, LeastLoaded
from instgenie.sim import physics, workload
from instgenie.sim.catalogue import Catalogue, cache_bytes
from instgenie.sim.engine import Engine
from instgenie.sim.models import profile_spec
from instgenie.sim.physics import StepPhysics
from instgenie.sim.scenario import Cluster, Scenario
from instgenie.sim.tiers import LRU, HostTiers

ROOT = Path(__file__).resolve().parents[2]
SDXL = profile_spec(ROOT / "profiles" / "sdxl-inpaint-full-h200.json")
EST = Estimator(SDXL)
PX = 1024 * 1024
NB = cache_bytes(SDXL, PX, 20, 2)
TRUE = StepPhysics(replay_scale=0.6, new_composition_ms=110.0, eager_scale=1.1,
                   pin_ms_per_gb=600.0, commit_ms_per_gb=50.0)  # fmt: skip


def _row(graph: str, reading: int, full: int, captures: list[int]) -> dict:
    """One served step as `serve --step-log` writes it, timed by TRUE at ratio 0.2."""
    ratios = {s: 0.2 for s in EST.strides}
    masked, fullw = EST.work(PX, 20, None, ratios, "dram"), EST.work(PX, 20, None, None, None)
    price = EST.step_ms([masked] * reading + [fullw] * (full + len(captures)))
    first, last = NB * captures.count(0), NB * captures.count(19)
    ms = TRUE.step_ms(price, graph != "replay", first, len(captures), last)
    members = ([(f"{i}:edit", 3) for i in range(reading + full)]
               + [(f"template:{i:064x}", s) for i, s in enumerate(captures)])  # fmt: skip
    return {"graph": graph, "members": members, "tiers": {"dram": reading} if reading else {},
            "duration_ms": ms}  # fmt: skip


def test_fit_recovers_the_physics_a_step_log_was_made_with() -> None:
    rows = (
        [_row("replay", n, f, []) for n in (1, 2, 3) for f in (0, 1)]
        + [_row("capture", n, 0, []) for n in (1, 2, 4)]
        + [_row("warmup", 1, 1, [])]
        + [_row("eager", n, 1, [s]) for n in (0, 1, 2) for s in (3, 7)]
        + [_row("eager", 1, 0, [0]), _row("eager", 0, 1, [0, 5]), _row("eager", 2, 0, [0])]
        + [_row("eager", 1, 0, [19]), _row("eager", 2, 1, [19, 4])]
    )  # fmt: skip
    got = physics.fit(rows, EST, PX, 20, 0.2, NB, outside_ms=480.0, source="synthetic")
    for name in ("replay_scale", "new_composition_ms", "eager_scale", "pin_ms_per_gb",
                 "commit_ms_per_gb"):  # fmt: skip
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-9), name
    assert got.outside_ms == 480.0 and got.source == "synthetic"


def test_physics_round_trips_through_a_file(tmp_path: Path) -> None:
    TRUE.save(tmp_path / "p.json")
    assert StepPhysics.load(tmp_path / "p.json") == TRUE


def test_outside_ms_is_the_median_over_answered_rows() -> None:
    def row(status: int, extra: float) -> dict:
        t = {"preprocess_ms": 100.0, "postprocess_ms": 300.0, "server_total_ms": 1000.0}
        return {"status": status, "latency_ms": 1000.0 + extra, "timings": t}

    rows = [row(200, 10.0), row(200, 20.0), row(200, 90.0), row(503, 5000.0)]
    assert physics.outside_ms(rows) == 420.0


def test_a_simulated_unloaded_edit_takes_the_physics_step_times() -> None:
    """One masked edit alone: its first step is a new composition, the other 19 replay."""
    cat = Catalogue.zipf(2, 1.0, NB, 0)
    ratios = tuple((s, 0.2) for s in EST.strides)
    sc = Scenario(SDXL, Cluster(1, 1, 4 * NB, 0), cat, [workload.Arrival(0.0, 0, 0.2, ratios)])
    (plain,) = Engine(sc, CacheAware()).run().requests
    (job,) = Engine(dataclasses.replace(sc, physics=TRUE), CacheAware()).run().requests
    step = EST.step_ms([job.work])
    stages = EST.stage_ms("encode", PX) + EST.stage_ms("decode", PX)
    assert plain.finish_ms == pytest.approx(stages + 20 * step, rel=1e-9)
    want = stages + 20 * TRUE.replay_scale * step + TRUE.new_composition_ms
    assert job.finish_ms == pytest.approx(want, rel=1e-9)


def test_a_capture_reserves_dram_at_its_start_and_never_evicts_an_entry_in_use() -> None:
    t = HostTiers(dram_bytes=2 * NB, disk_bytes=0)
    t.commit("a", NB)
    t.commit("b", NB)
    assert t.read("a", NB) == "dram" and t.read("b", NB) == "dram"  # both in use
    assert not t.reserve("c", NB) and t.no_room == 1  # no room: nothing evicted
    assert t.tier("a") == t.tier("b") == "dram"
    t.release("a")
    assert t.reserve("c", NB)  # a (not in use) is evicted at the capture's start
    assert t.tier("a") is None and t.tier("c") is None  # c readable only once committed
    assert not t.reserve("d", NB)  # b in use, c reserved
    t.commit("c", NB)
    assert t.tier("c") == "dram" and t.dram.used == 2 * NB


def test_lru_make_room_skips_entries_in_use() -> None:
    lru = LRU(3)
    for k in "xyz":
        lru.put(k, 1)
    assert lru.make_room(2, Counter({"x": 1})) == [("y", 1), ("z", 1)]
    assert list(lru.entries) == ["x"] and lru.used == 3
    assert lru.make_room(1, Counter({"x": 1})) is None and lru.used == 3


def test_the_capture_uid_prefix_is_the_workers() -> None:
    from instgenie.worker.names import CAPTURE_PREFIX

    assert physics.CAPTURE_UID_PREFIX == CAPTURE_PREFIX


def test_simulate_with_physics_is_slower_than_the_profile_and_adds_the_outside_time(
    tmp_path: Path,
) -> None:
    """`instgenie simulate --physics`: the same arrivals, steps at the served loop's times (here
    slower than the profile's prices) and each latency with the time outside the loop."""
    from instgenie.cli import main

    slow = StepPhysics(replay_scale=2.0, new_composition_ms=50.0, eager_scale=2.0,
                       pin_ms_per_gb=100.0, outside_ms=400.0, post_ms=300.0)  # fmt: skip
    slow.save(tmp_path / "physics.json")
    p50 = {}
    for name, extra in (("plain", []), ("physics", ["--physics", str(tmp_path / "physics.json")])):
        out = tmp_path / name
        args = [
            "simulate",
            "--hosts",
            "2",
            "--gpus",
            "1",
            "--templates",
            "6",
            "--rate",
            "0.5",
            "--requests",
            "12",
            "--policies",
            "cache-aware",
            "--no-ideal",
            "--out",
            str(out),
        ]
        assert main(args + extra) == 0  # fmt: skip
        report = json.loads((out / "report.json").read_text())
        p50[name] = report["results"]["cache-aware"]["latency_ms"]["p50"]
    # steps at twice their price (encode and decode unscaled), plus 400 ms outside the loop
    assert p50["physics"] > 1.5 * p50["plain"] + 400.0


def test_the_servers_view_is_stale_through_a_long_step() -> None:
    """One node whose DRAM holds one template (t0, resident). An edit of t1 triggers its capture,
    which evicts t0 when it starts and then pins for seconds in its first step. An edit of t0
    sent meanwhile: the server still sees t0 resident (the loop reports between steps), so it
    sends no capture; the edit finds t0 gone and runs the full path. With no pinning stall the
    step ends (and reports) before the second edit, which then triggers t0's capture."""
    ratios = tuple((s, 0.2) for s in EST.strides)
    cat = Catalogue(("t0", "t1"), np.array([0.5, 0.5]), NB)
    arrivals = [workload.Arrival(0.0, 1, 0.2, ratios), workload.Arrival(3000.0, 0, 0.2, ratios)]
    base = Scenario(SDXL, Cluster(1, 1, NB, 0), cat, arrivals, initial={"t0": [0]})
    for pin, stale in ((1000.0, True), (0.0, False)):
        sc = dataclasses.replace(base, physics=dataclasses.replace(TRUE, pin_ms_per_gb=pin))
        first, second = Engine(sc, CacheAware()).run().requests
        assert first.tier is None and first.triggered_capture
        assert second.tier is None and second.triggered_capture is not stale


def test_an_entry_counts_as_used_when_its_edit_releases_it() -> None:
    """cache/index.py stamps an entry at release too: an entry read first but released last is
    the most recently used, so a capture evicts the other one."""
    t = HostTiers(dram_bytes=2 * NB, disk_bytes=0)
    t.commit("a", NB)
    t.commit("b", NB)
    t.read("a", NB)
    t.read("b", NB)
    t.release("b")
    t.release("a")  # a's edit ends last
    assert t.reserve("c", NB)
    assert t.tier("a") == "dram" and t.tier("b") is None


def test_an_edit_stays_in_flight_until_post_processed() -> None:
    """physics.post_ms: the server counts an edit on its worker until it is answered, so
    least-loaded routing sends an edit that arrives meanwhile to the other worker."""
    ratios = tuple((s, 0.2) for s in EST.strides)
    cat = Catalogue(("t0",), np.array([1.0]), NB)
    first = [workload.Arrival(0.0, 0, 0.2, ratios)]
    base = Scenario(SDXL, Cluster(1, 2, 2 * NB, 0), cat, first, initial={"t0": [0]})
    (done,) = Engine(base, LeastLoaded()).run().requests
    second = [*first, workload.Arrival(done.finish_ms + 100.0, 0, 0.2, ratios)]
    for post, worker in ((1000.0, 1), (0.0, 0)):
        sc = dataclasses.replace(base, arrivals=second,
                                 physics=StepPhysics(post_ms=post))  # fmt: skip
        _, later = Engine(sc, LeastLoaded()).run().requests
        assert later.worker == worker
