"""Statistics of one phase: throughput, latency percentiles, SLO attainment, errors by code.

Denominators are stated because they decide what a number means:
- latency percentiles are over ok requests only (client side: sent -> answered, ms);
- `slo_attainment` is over every arrival: a failed or unsent request misses the SLO;
- throughput and goodput are ok answers (within the SLO, for goodput) per second of the phase's
  wall time (its start to its last answer);
- `interior_throughput_rps` is the rate of ok answers over the phase's interior half: between
  the answers at the first and third quartile of answer times (the ramp-up, while the batch
  fills, and the drain, while it empties, excluded). In a phase offered more than the server
  can answer it is the server's saturated throughput. Answers that come in clumps (a batch
  finishing together) make its window end inside a clump: over a phase of few batches it can
  be off by up to a batch, so give it many answers.
"""

from __future__ import annotations

import collections
import json
import statistics

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from instgenie.loadtest.driver import OK, Outcome

PERCENTILES = (50, 90, 95, 99)


def _dist(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    out = {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}
    out.update(n=len(values), mean=statistics.fmean(values), max=max(values))
    return out


def _timing(ok: list[Outcome], name: str) -> list[float]:
    return [float(o.answer["timings"][name]) for o in ok if name in (o.answer["timings"] or {})]


def summarize(outcomes: list[Outcome], wall_s: float, slo_ms: float | None) -> dict:
    ok = [o for o in outcomes if o.code == OK]
    lat = [o.latency_ms for o in ok]
    sent = [o for o in outcomes if o.sent_s is not None]
    n = len(outcomes)
    last_arrival = max((o.scheduled_s for o in outcomes), default=0.0)
    out: dict = {
        "requests": n,
        "sent": len(sent),
        "ok": len(ok),
        "errors": dict(collections.Counter(o.code for o in outcomes if o.code != OK)),
        "error_status": dict(collections.Counter(str(o.status) for o in sent if o.code != OK)),
        "wall_s": wall_s,
        "offered_rps": n / last_arrival if last_arrival > 0 else None,
        "throughput_rps": len(ok) / wall_s if wall_s > 0 else None,
        "interior_throughput_rps": interior_rate([o.done_s for o in ok]),
        "latency_ms": _dist(lat),
        "send_lag_ms": _dist([1e3 * (o.sent_s - o.scheduled_s) for o in sent]),
        "server_queue_ms": _dist(_timing(ok, "server_queue_ms")),
        "worker_queue_ms": _dist(_timing(ok, "queue_ms")),
        "denoise_ms": _dist(_timing(ok, "denoise_ms")),
        "paths": dict(collections.Counter(o.answer.get("path") for o in ok)),
        "cache_tiers": dict(collections.Counter(str(o.answer.get("cache_tier")) for o in ok)),
        "workers": dict(collections.Counter(str(o.answer.get("worker")) for o in ok)),
        "mask_ratio_requested_mean": (
            statistics.fmean(o.mask_ratio_requested for o in outcomes) if outcomes else None
        ),
        "mask_ratio_served_mean": (
            statistics.fmean(float(o.answer["mask_ratio"]) for o in ok) if ok else None
        ),
    }
    if slo_ms is not None:
        within = sum(1 for v in lat if v <= slo_ms)
        out["slo_ms"] = slo_ms
        out["slo_attainment"] = within / n if n else None
        out["goodput_rps"] = within / wall_s if wall_s > 0 else None
    return out


def interior_rate(done_s: list[float], least: int = 8) -> float | None:
    """Answers per second between the answers at the first and third quartile of `done_s`
    (offsets, s): (k3 - k1) answers over their span. None under `least` answers or no span."""
    if len(done_s) < least:
        return None
    done = sorted(done_s)
    k1, k3 = len(done) // 4, (3 * len(done)) // 4
    span = done[k3] - done[k1]
    return (k3 - k1) / span if span > 0 else None


#: the server's step histogram (server/metrics.py), by worker and by how the step's backbone ran
STEP_METRIC = "instgenie_step_seconds"


def step_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """graph mode -> (steps, seconds) summed over workers, from a /metrics scrape."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for family in text_string_to_metric_families(metrics_text):
        if family.name != STEP_METRIC:
            continue
        for sample in family.samples:
            slot = {f"{STEP_METRIC}_count": 0, f"{STEP_METRIC}_sum": 1}.get(sample.name)
            if slot is not None:
                out[sample.labels.get("graph", "")][slot] += sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def step_modes(before: dict, after: dict) -> dict:
    """The steps run between two scrapes, by graph mode: {"n", "mean_ms", "share"} each."""
    diff = {k: (n - before.get(k, (0, 0))[0], sec - before.get(k, (0, 0))[1])
            for k, (n, sec) in after.items()}  # fmt: skip
    diff = {k: v for k, v in diff.items() if v[0] > 0}  # none, or counters that went back
    total = sum(n for n, _ in diff.values())
    return {
        k: {"n": int(n), "mean_ms": 1e3 * sec / n, "share": n / total}
        for k, (n, sec) in sorted(diff.items())
    }


def load_named(args: list[str]) -> list[tuple[str, dict]]:
    """NAME=PATH arguments -> (name, report) pairs of `instgenie loadtest --out` reports
    (the bench/report_*.py scripts)."""
    out = []
    for arg in args:
        name, _, path = arg.partition("=")
        with open(path, encoding="utf-8") as f:
            out.append((name, json.load(f)))
    return out


def one_line(label: str, s: dict) -> str:
    """A human summary of one phase (stderr)."""
    lat = s["latency_ms"]
    parts = [f"{label}: {s['ok']}/{s['requests']} ok"]
    if s["throughput_rps"] is not None:
        parts.append(f"{s['throughput_rps']:.2f} req/s")
    if s.get("interior_throughput_rps") is not None:
        parts.append(f"interior {s['interior_throughput_rps']:.2f} req/s")
    if lat["n"]:
        parts.append(
            f"latency p50 {lat['p50']:.0f} / p95 {lat['p95']:.0f} / p99 {lat['p99']:.0f} ms"
        )
    if "slo_attainment" in s and s["slo_attainment"] is not None:
        parts.append(f"SLO {s['slo_ms']:g} ms met by {100 * s['slo_attainment']:.1f}%")
    if s["errors"]:
        parts.append("errors " + ", ".join(f"{k} x{v}" for k, v in sorted(s["errors"].items())))
    if s.get("steps"):
        parts.append("steps " + ", ".join(f"{k} {v['n']} x {v['mean_ms']:.0f} ms"
                                          for k, v in s["steps"].items()))  # fmt: skip
    return "; ".join(parts)
