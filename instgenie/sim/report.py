"""A run's numbers: latency percentiles, throughput, SLO attainment, paths and captures.

Denominators (as loadtest/report.py): requests arriving at or after the warm-up; latency
percentiles over the answered ones (arrival -> decoded, ms: server queue + worker); SLO
attainment over every measured arrival (a rejected one misses); throughput = answered measured
requests per second from the first measured arrival to the last measured answer.
"""

from __future__ import annotations

import collections

import numpy as np

from instgenie.scheduler.estimate import Estimator
from instgenie.sim.engine import Result
from instgenie.sim.scenario import Scenario

PERCENTILES = (50, 95, 99)


def unloaded_ms(scenario: Scenario, ratio: float, tier: str | None = "dram") -> float:
    """One edit alone on an idle worker, its cache in `tier` (None: the full path), its mask
    covering `ratio` of every token grid: encode + steps x step + decode, ms (the router's
    price of it on an empty worker)."""
    est = Estimator(scenario.spec)
    px = scenario.width * scenario.height
    ratios = {s: ratio for s in est.strides} if tier is not None else None
    work = est.work(px, scenario.steps, scenario.guidance, ratios, tier)
    return (est.stage_ms("encode", px) + work.steps * est.step_ms([work])
            + est.stage_ms("decode", px))  # fmt: skip


def summarize(result: Result, scenario: Scenario, slo_ms: float) -> dict:
    measured = [j for j in result.requests if j.arrival_ms >= scenario.warmup_ms]
    ok = [j for j in measured if j.finish_ms >= 0]
    # a served loop's physics also has each request's time outside the loop (pre/post, HTTP)
    outside = scenario.physics.outside_ms if scenario.physics is not None else 0.0
    lat = np.array([j.finish_ms - j.arrival_ms + outside for j in ok])
    first = min((j.arrival_ms for j in measured), default=0.0)
    last = max((j.finish_ms for j in ok), default=first)
    span_s = (last - first) / 1e3
    out: dict = {
        "policy": result.policy,
        "requests": len(measured),
        "answered": len(ok),
        "rejected": len(measured) - len(ok),
        "throughput_rps": len(ok) / span_s if span_s > 0 else None,
        "latency_ms": {f"p{q}": float(np.percentile(lat, q)) for q in PERCENTILES}
        if len(lat)
        else {},
        "mean_ms": float(lat.mean()) if len(lat) else None,
        "slo_ms": slo_ms,
        "slo_attainment": float((lat <= slo_ms).sum()) / len(measured) if measured else None,
        "queue_ms_p95": float(np.percentile([j.dispatched_ms - j.arrival_ms for j in ok], 95))
        if ok
        else None,
        "full_path": sum(1 for j in ok if j.tier is None),
        "tiers": dict(collections.Counter(str(j.tier) for j in ok)),
        "captures_triggered": sum(1 for j in measured if j.triggered_capture),
        "captures_total": result.captures,
        "promotions": sum(h.tiers.promotions for h in result.hosts),
        "gpu_busy": sum(w.busy_ms for w in result.workers) / (len(result.workers) * result.end_ms)
        if result.end_ms > 0
        else None,
        "sim_end_s": result.end_ms / 1e3,
    }
    return out


def capacity_rps(scenario: Scenario, workers: int, per_worker: int = 160) -> float:
    """The ideal fleet's saturation throughput, requests/s: one worker of `scenario`'s cluster
    with every cache in DRAM, `per_worker` of its arrivals' masks sent at once (a queue that
    never empties), answers counted between the 10th and 90th percent of them (no fill or
    drain), times `workers` (the ideal fleet's workers are alike and independent)."""
    import dataclasses

    from instgenie.sim.scenario import Cluster, simulate

    cl = scenario.cluster
    arrivals = [dataclasses.replace(a, at_ms=0.0) for a in scenario.arrivals[:per_worker]]
    one = dataclasses.replace(
        scenario, arrivals=arrivals, warmup_ms=0.0, initial=None,
        cluster=Cluster(1, 1, cl.dram_bytes, cl.disk_bytes, cl.max_batch, cl.slots, ideal=True),
    )  # fmt: skip
    done = sorted(j.finish_ms for j in simulate(one, "least-loaded").requests)
    lo, hi = int(0.1 * len(done)), int(0.9 * len(done))
    return workers * (hi - lo) / ((done[hi] - done[lo]) / 1e3)
