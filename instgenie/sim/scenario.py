"""What one simulated run is (`Scenario`) and `simulate(scenario, policy)`, its entry point.

spec = models.profile_spec("profiles/sdxl-inpaint-full-h200.json")
cat = Catalogue.zipf(200, 1.0, cache_bytes(spec, 1024 * 1024, 20, 2), seed=0)
arrivals = workload.make_arrivals(cat, times_ms, "hist:traces/mask_ratios_mean011.json",
                                  1024, 1024, strides, rng)
result = simulate(Scenario(spec, Cluster(hosts=2, gpus=1, dram_bytes=..., disk_bytes=...),
                           cat, arrivals), "cache-aware")
result.requests  # every Job: arrival, dispatch, finish (ms), worker, tier, capture
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from instgenie.scheduler.routing import RoutingPolicy, make_policy
from instgenie.scheduler.spec import CostSpec
from instgenie.sim.catalogue import Catalogue
from instgenie.sim.physics import StepPhysics
from instgenie.sim.workload import Arrival


@dataclass(frozen=True)
class Cluster:
    hosts: int  # nodes, count
    gpus: int  # workers per node (one per GPU), count
    dram_bytes: int  # each node's DRAM tier capacity, bytes
    disk_bytes: int  # each node's disk tier capacity, bytes
    max_batch: int = 8  # WorkerConfig.max_batch: most requests in one denoise step
    slots: int = 0  # ServerConfig.worker_slots: requests in flight per worker; 0 = 2 * max_batch
    max_queue: int = 0  # ServerConfig.max_queue: the server queue's bound (beyond: 429); 0 = none
    #: every template's cache in every node's DRAM, always (the ideal fleet: no capture, no disk)
    ideal: bool = False


@dataclass(frozen=True)
class Scenario:
    spec: CostSpec  # every worker's CostSpec (models.profile_spec)
    cluster: Cluster
    catalogue: Catalogue
    arrivals: Sequence[Arrival]  # time order
    width: int = 1024  # image size of every edit and template, pixels
    height: int = 1024
    steps: int = 20  # denoising steps of every edit and template
    guidance: float | None = None  # None: the model's default
    #: arrivals before this time are served but not reported (the tiers' LRU settles), ms
    warmup_ms: float = 0.0
    #: template id -> the node indices whose tiers hold its cache at the start (DRAM, in this
    #: order); None: each template registered in catalogue order, captured on the node
    #: placement.place picks (the server's registration)
    initial: dict[str, Sequence[int]] | None = None
    extra: dict = field(default_factory=dict)  # carried into the report
    #: step times of a served loop, fitted from a served run (physics.py); None: each step
    #: takes the profile's price
    physics: StepPhysics | None = None
    #: with physics: draws each step's time about its fitted one (physics' replay/eager sigmas),
    #: seeded (one seed, one result); None: every step takes its fitted time
    seed: int | None = None


def simulate(scenario: Scenario, policy: str | RoutingPolicy):  # noqa: ANN201 - engine.Result
    """Run `scenario` under the routing `policy` (a name for make_policy, or an instance)."""
    from instgenie.sim.engine import Engine

    pol = make_policy(policy) if isinstance(policy, str) else policy
    return Engine(scenario, pol).run()
