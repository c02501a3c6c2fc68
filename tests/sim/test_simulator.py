"""The cluster simulator (instgenie/sim): its worker loop is priced exactly as the router prices an
idle worker, misses capture and fill the host's tiers, cache-aware routing captures less than
least-loaded where the catalogue does not fit one host, the ideal fleet never captures, and a
seed is one result."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from instgenie.cli import main
from instgenie.scheduler.estimate import Estimator
from instgenie.scheduler.routing import CacheAware
from instgenie.sim import workload
from instgenie.sim.catalogue import Catalogue, cache_bytes
from instgenie.sim.engine import Engine
from instgenie.sim.models import model_spec, profile_spec
from instgenie.sim.report import unloaded_ms
from instgenie.sim.scenario import Cluster, Scenario, simulate
from instgenie.sim.tiers import HostTiers

ROOT = Path(__file__).resolve().parents[2]
SDXL = profile_spec(ROOT / "profiles" / "sdxl-inpaint-full-h200.json")
PX = 1024 * 1024
NB = cache_bytes(SDXL, PX, 20, 2)
STRIDES = Estimator(SDXL).strides


def _one(template: int | None, ratio: float, n_templates: int = 4) -> Scenario:
    cat = Catalogue.zipf(n_templates, 1.0, NB, 0)
    arrival = workload.Arrival(0.0, template, ratio, tuple((s, ratio) for s in STRIDES))
    return Scenario(SDXL, Cluster(1, 1, 10 * NB, 10 * NB), cat, [arrival])


def test_an_unloaded_edit_takes_the_estimators_unloaded_price() -> None:
    """One edit of a DRAM-resident template on an idle worker: encode + 20 steps + decode, as
    Estimator prices them (and as the cache-aware router predicts on that idle worker)."""
    sc = _one(0, 0.125)
    engine = Engine(sc, CacheAware())
    view = engine.workers[0].view()
    result = engine.run()
    (job,) = result.requests
    assert job.tier == "dram" and not job.triggered_capture
    want = unloaded_ms(sc, 0.125)
    assert job.finish_ms - job.arrival_ms == pytest.approx(want, rel=1e-9)
    route = dataclasses.replace(job.route, steps_done=0)
    assert CacheAware().cost_ms(route, view) == pytest.approx(want, rel=1e-9)
    assert result.captures == 0


def test_a_miss_runs_the_full_path_beside_its_capture_and_fills_dram() -> None:
    """An edit of a template its host does not hold: its capture runs in the same batches, the
    edit takes the full path, the capture commits to DRAM; the router's price of the miss on the
    idle worker, with the capture's whole cost (capture_share 1: the loop pays all of it), is
    what the simulation takes; the default router charges the edit a share of it."""
    sc = _one(0, 0.125)
    sc = dataclasses.replace(sc, initial={})  # nothing resident
    engine = Engine(sc, CacheAware())
    view = engine.workers[0].view()
    result = engine.run()
    (job,) = result.requests
    assert job.tier is None and job.triggered_capture and result.captures == 1
    assert result.hosts[0].tiers.tier(sc.catalogue.ids[0]) == "dram"
    in_full = CacheAware()
    in_full.capture_share = 1.0
    price = in_full.cost_ms(job.route, view)
    assert job.finish_ms - job.arrival_ms == pytest.approx(price, rel=1e-9)
    assert unloaded_ms(sc, 1.0, None) < CacheAware().cost_ms(job.route, view) < price


def test_host_tiers_demote_drop_and_promote() -> None:
    t = HostTiers(dram_bytes=2 * NB, disk_bytes=2 * NB)
    for k in "abc":
        t.commit(k, NB)
    assert [t.tier(k) for k in "abc"] == ["disk", "dram", "dram"]
    t.commit("d", NB)  # b demoted; the disk drops nothing yet (a, b)
    t.commit("e", NB)  # c demoted; disk full: a dropped
    assert [t.tier(k) for k in "abcde"] == [None, "disk", "disk", "dram", "dram"]
    assert t.read("b", NB) == "disk"  # streamed for this edit, then promoted
    assert t.tier("b") == "dram" and t.tier("d") == "disk"


def _zipf_run(policy: str, ideal: bool = False, seed: int = 3) -> object:
    """2 hosts x 2 GPUs, 40 templates, each host's DRAM 10 % of the catalogue, no disk tier, at
    1.5 edits/s: most edits miss, and each miss's capture costs its loop ≈ 2.9 s beyond its
    steps (the profile's capture fit), so the fleet is loaded but not overrun."""
    cat = Catalogue.zipf(40, 1.0, NB, seed)
    rng = np.random.default_rng(seed)
    times, _ = workload.offsets_ms(rng, rate=1.5, n=160)
    arrivals = workload.make_arrivals(cat, times, "hist:traces/mask_ratios_mean011.json", 1024,
                                      1024, STRIDES, rng)  # fmt: skip
    cl = Cluster(2, 2, 4 * NB, 0, ideal=ideal)
    return simulate(Scenario(SDXL, cl, cat, arrivals, warmup_ms=0.0), policy)


def test_cache_aware_captures_less_than_least_loaded_and_the_ideal_fleet_never() -> None:
    ca, ll = _zipf_run("cache-aware"), _zipf_run("least-loaded")
    ideal = _zipf_run("cache-aware", ideal=True)

    def capture_runs(r) -> int:  # committed, and run without room (they recorded nothing)
        return r.captures + sum(h.tiers.no_room for h in r.hosts)

    assert capture_runs(ca) < capture_runs(ll)
    assert sum(j.tier is None for j in ca.requests) < sum(j.tier is None for j in ll.requests)
    assert ideal.captures == 0 and all(j.tier == "dram" for j in ideal.requests)
    assert all(j.finish_ms > j.arrival_ms for r in (ca, ll, ideal) for j in r.requests)


def test_a_seed_is_one_result() -> None:
    a, b = _zipf_run("cache-aware", seed=5), _zipf_run("cache-aware", seed=5)
    assert [(j.worker, j.finish_ms, j.tier) for j in a.requests] == [
        (j.worker, j.finish_ms, j.tier) for j in b.requests
    ]


def test_committed_block_lists_are_the_models_own() -> None:
    """models.json is what engine/costspec.py reports for the model (tiny: built here)."""
    from instgenie.engine.costspec import model_cost_spec
    from instgenie.engine.family import load_family

    real = model_cost_spec(load_family("sdxl-inpaint:tiny", "cpu", parts="none"), "float16", None)
    assert model_spec("sdxl-inpaint:tiny") == real
    assert len(SDXL.blocks) == 70 and SDXL.compute and SDXL.load["disk"]


def test_simulate_command_writes_a_report_and_a_plot(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    rc = main(["simulate", "--hosts", "2", "--gpus", "1", "--templates", "12", "--rate", "1.5",
               "--requests", "30", "--policies", "cache-aware", "least-loaded", "--out",
               str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["results"]) == {"cache-aware", "least-loaded", "ideal"}
    assert report["results"]["ideal"]["captures_total"] == 0
    assert report["capacity_rps"] > 0 and (out / "latency.png").stat().st_size > 1000
