"""Cache-aware routing (issue 26): each request on a worker is priced with the tier its node holds
the template's cache in, a miss as the full run plus the capture it triggers; real CostSpecs from
the committed profiles (torch-free: instgenie.sim.models)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from instgenie.scheduler.estimate import Estimator
from instgenie.scheduler.fits import fit_ms
from instgenie.scheduler.pricing import cached_bytes
from instgenie.scheduler.routing import CacheAware, LeastLoaded, MaskAware, finishes, make_policy
from instgenie.scheduler.views import RouteRequest, WorkerView
from instgenie.server.config import ServerConfig, check_server_config
from instgenie.sim.models import profile_spec

PROFILES = Path(__file__).resolve().parents[2] / "profiles"
SDXL = profile_spec(PROFILES / "sdxl-inpaint-full-h200.json")
PX = 1024 * 1024
RATIOS = ((16, 0.12), (32, 0.12))


def _req(template: str | None = "t", steps_done: int = 0, ratio: float = 0.12) -> RouteRequest:
    return RouteRequest(template_id=template, num_steps=20, pixels=PX,
                        token_ratios=((16, ratio), (32, ratio)), steps_done=steps_done)  # fmt: skip


def _worker(i: int, tiers: dict[str, str], held: tuple = (), spec=SDXL) -> WorkerView:  # noqa: ANN001
    return WorkerView(index=i, device=f"cuda:{i}", in_flight=len(held), slots=16,
                      templates_ready=frozenset(tiers), template_tiers=tiers, requests=held,
                      max_batch=8, cost=spec)  # fmt: skip


def test_a_disk_read_is_priced_with_the_disk_load_fit() -> None:
    est = Estimator(SDXL)
    ratios = dict(RATIOS)
    dram, disk = (est.work(PX, 20, None, ratios, t) for t in ("dram", "disk"))
    costs = est.block_costs(PX, [disk])
    b = SDXL.blocks[0]
    L = PX // (b.stride * b.stride)
    want = fit_ms(SDXL.load["disk"], cached_bytes(L, b.channels, 2, SDXL.cache_dtype))
    assert costs.load[0] == pytest.approx(want)
    assert est.step_ms([disk]) > est.step_ms([dram])
    # a profile without a disk fit prices the disk tier with the dram fit
    no_disk = dataclasses.replace(SDXL, load={"dram": SDXL.load["dram"]})
    e2 = Estimator(no_disk)
    assert e2.step_ms([e2.work(PX, 20, None, ratios, "disk")]) == pytest.approx(
        e2.step_ms([e2.work(PX, 20, None, ratios, "dram")])
    )


def test_a_miss_costs_the_full_run_and_its_capture() -> None:
    """On idle workers: hit (dram) < disk < miss, and the miss is priced higher than mask-aware's
    full run alone by the capture sharing its batches."""
    ca, ma = CacheAware(), MaskAware()
    r = _req()
    hit = ca.cost_ms(r, _worker(0, {"t": "dram"}))
    disk = ca.cost_ms(r, _worker(1, {"t": "disk"}))
    miss = ca.cost_ms(r, _worker(2, {}))
    full_only = ma.cost_ms(r, _worker(2, {}))
    assert hit < disk < miss
    assert miss > full_only * 1.3  # a batch of two full-path requests, two encodes
    # an edit of no template has no capture: priced as mask-aware's full run
    assert ca.cost_ms(_req(None), _worker(2, {})) == pytest.approx(full_only)


def test_a_capture_in_flight_is_priced_once_per_template() -> None:
    """A held edit whose template is not ready on the worker has a capture beside it; a new edit
    of the same template starts none, one of another template starts its own."""
    ca = CacheAware()
    held = (_req("t", steps_done=3),)
    w = _worker(0, {}, held)
    same, other = ca.cost_ms(_req("t"), w), ca.cost_ms(_req("u"), w)
    assert other > same
    # the line priced: one capture of "t" (17 steps left, not decoded), the held edit, the new
    # edit (full path); the price is the new edit's finish plus the delay it adds to the held one
    est = Estimator(SDXL)
    full = est.work(PX, 20, None, None, None)
    extra = est.capture_step_ms(PX)  # the capture's cost beyond each of its steps' price
    assert 100.0 < extra < 200.0  # the profile's capture fit: ≈ 2.9 s over 20 steps at 1024²
    line = lambda: [[full, 17, False, extra], [full, 17]]  # noqa: E731
    without = finishes(est, line(), [], 8)
    done = finishes(est, [*line(), [full, 20]], [PX], 8)
    assert same == pytest.approx(done[2] + done[1] - without[1])
    # the capture's 17 steps cost every request batched beside them 17 * extra more
    plain = finishes(est, [[full, 17, False], [full, 17]], [], 8)
    assert without[1] == pytest.approx(plain[1] + 17 * extra)


def test_routes_to_the_holding_node_until_its_queue_outgrows_a_miss() -> None:
    """Replication through routing: a worker on the node holding the cache wins while its queue
    is short; once its price exceeds a miss (full run + capture) on an idle worker, the edit goes
    there (and that node captures the template); least-loaded ignores the tier. The capture's
    cost beyond its steps (the profile's capture fit, of which the edit that triggers it is
    charged capture_share) is what keeps a short queue home: charged in full, a miss would
    wait for five held edits; priced as a full-path request alone it wins against two."""
    ca = CacheAware()

    def choose(n: int, spec=SDXL) -> int:  # noqa: ANN001
        busy = _worker(0, {"t": "dram"}, tuple(_req("t") for _ in range(n)), spec)
        return ca.choose(_req("t"), [busy, _worker(1, {}, (), spec)])

    assert [choose(n) for n in (1, 2, 3, 4)] == [0, 0, 1, 1]
    # full run + capture + a third of the capture's cost beyond its steps (≈ 2.9 s / 3)
    assert 2500.0 < ca.cost_ms(_req("t"), _worker(1, {})) < 3000.0
    no_fit = dataclasses.replace(SDXL, capture=None)
    assert [choose(n, no_fit) for n in (1, 2)] == [0, 1]
    in_full = CacheAware()
    in_full.capture_share = 1.0
    busy = lambda n: _worker(0, {"t": "dram"}, tuple(_req("t") for _ in range(n)))  # noqa: E731
    assert [in_full.choose(_req("t"), [busy(n), _worker(1, {})]) for n in (4, 5)] == [0, 1]
    assert LeastLoaded().choose(_req("t"), [_worker(0, {"t": "dram"}, (_req("t"),)),
                                            _worker(1, {})]) == 1  # fmt: skip


def test_the_policy_is_known_by_name_and_to_the_server_config() -> None:
    assert isinstance(make_policy("cache-aware"), CacheAware)
    check_server_config(ServerConfig(routing="cache-aware"))
    with pytest.raises(ValueError, match="routing"):
        check_server_config(ServerConfig(routing="cache-awar"))
