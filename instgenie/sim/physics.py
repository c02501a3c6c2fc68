"""How a served loop's step time departs from the profile's price, fitted from a served run.

The router and the simulator price a step with `Estimator.step_ms` (the worker's profile). A
served loop differs from that price in ways the profile does not measure (measured on 2 x H200,
docs/benchmarks/cluster-h200.md): a replayed CUDA graph runs at a fixed fraction of the price; the
first step of a new batch composition captures (or warms up) a graph, a fixed extra; a step with
a template's capture run in it runs eagerly (and, with staged capture copies, beside the host
threads that fill the segment); a capture's first step creates the template's DRAM segment (and,
with pinned copies, registers it as pinned memory: cache/host_template.py), and its last step
commits it (with staged copies: drains the copies and registers the pages), each of which costs
time per byte. `StepPhysics` holds those five numbers, plus the per-request time outside the loop
(pre/post-processing and HTTP), and `fit` reads them off a served run's step log
(`instgenie serve --step-log`) and its load-test report. The simulator's workers take their step
times from it (`step_ms`); the router keeps pricing with the profile alone, as it does when served.
Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from instgenie.scheduler.estimate import Estimator

#: a capture run's uid prefix in the step log (worker/names.py CAPTURE_PREFIX; sim/ imports no
#: worker module, tests/sim/test_physics.py checks they agree)
CAPTURE_UID_PREFIX = "template:"


@dataclass(frozen=True)
class StepPhysics:
    #: a step replayed from a CUDA graph takes this times its price
    replay_scale: float = 1.0
    #: the first step of a batch composition (a graph capture or warm-up) takes this much more, ms
    new_composition_ms: float = 0.0
    #: a step with a capture run in it (always eager) takes this times its price (captures
    #: priced as full-path requests)
    eager_scale: float = 1.0
    #: a capture's first step takes this much more per GB (1e9 bytes) of the template's cache
    #: (its DRAM segment is pinned), ms
    pin_ms_per_gb: float = 0.0
    #: a capture's last step takes this much more per GB of the template's cache (its commit:
    #: staged copies drained, the segment's pages registered), ms
    commit_ms_per_gb: float = 0.0
    #: spread of a step's time about the above: the standard deviation of log(duration / fitted
    #: time) of replayed and of eager steps (0: every step takes its fitted time). Used only
    #: where a simulation draws noise (Scenario.seed)
    replay_sigma: float = 0.0
    eager_sigma: float = 0.0
    #: each request's time outside the loop (pre/post-processing, HTTP), ms
    outside_ms: float = 0.0
    #: of it, after the loop is done with a request (post-processing, HTTP): the server counts
    #: the request in flight on its worker until then, ms
    post_ms: float = 0.0
    #: what it was fitted from (free text: the run, its device)
    source: str = ""

    def step_ms(self, price_ms: float, new_composition: bool, capture_bytes_first: int,
                captures: int, capture_bytes_last: int = 0) -> float:  # fmt: skip
        """One step of a batch priced `price_ms`: `captures` capture runs in it, the ones at
        their first step holding `capture_bytes_first` bytes of cache between them, the ones at
        their last step `capture_bytes_last`."""
        if captures:
            return (self.eager_scale * price_ms + self.pin_ms_per_gb * capture_bytes_first / 1e9
                    + self.commit_ms_per_gb * capture_bytes_last / 1e9)  # fmt: skip
        return self.replay_scale * price_ms + (self.new_composition_ms if new_composition else 0.0)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepPhysics:
        return cls(**json.loads(Path(path).read_text()))


def fit(
    steps: Iterable[dict],
    est: Estimator,
    pixels: int,
    num_steps: int,
    mask_ratio: float,
    template_bytes: int,
    outside_ms: float = 0.0,
    source: str = "",
    post_ms: float = 0.0,
) -> StepPhysics:
    """StepPhysics from a served run's step log (`serve --step-log` lines). Every cache-reading
        member is priced at the run's mean `mask_ratio` from DRAM, every other member (a full-path
        edit, a capture run) as the full path. A step with a capture at its first step counts
    for the segment's creation, one with a capture at its last for the commit, the others for the
    eager scale. Each number is a median over the steps of its kind,
        so a few odd steps (a process's first, compiling) do not move it."""
    replay, composed, eager, pin, commit = [], [], [], [], []
    last = num_steps - 1
    rows = _priced(steps, est, pixels, num_steps, mask_ratio)
    for r in rows:
        captures, price = r["_captures"], r["_price"]
        if captures:
            (pin if 0 in captures else commit if last in captures else eager).append(r)
        elif r["graph"] == "replay":
            replay.append(r["duration_ms"] / price)
    replay_scale = statistics.median(replay) if replay else 1.0
    eager_scale = statistics.median(r["duration_ms"] / r["_price"] for r in eager) if eager else 1.0
    for r in rows:
        if not r["_captures"] and r["graph"] in ("capture", "warmup"):
            composed.append(r["duration_ms"] - replay_scale * r["_price"])
    gb = template_bytes / 1e9
    replay_logs = [math.log(r["duration_ms"] / (replay_scale * r["_price"])) for r in rows
                   if not r["_captures"] and r["graph"] == "replay"]  # fmt: skip
    eager_logs = [math.log(r["duration_ms"] / (eager_scale * r["_price"])) for r in eager]

    def per_gb(rs: list[dict], step: int) -> float:
        """Median extra over an eager step per GB of the captures at `step`, ms (≥ 0)."""
        vals = [(r["duration_ms"] - eager_scale * r["_price"]) / (gb * r["_captures"].count(step))
                for r in rs]  # fmt: skip
        return max(0.0, statistics.median(vals)) if vals else 0.0

    return StepPhysics(
        replay_scale=replay_scale,
        new_composition_ms=max(0.0, statistics.median(composed)) if composed else 0.0,
        eager_scale=eager_scale,
        pin_ms_per_gb=per_gb(pin, 0),
        commit_ms_per_gb=per_gb(commit, last),
        replay_sigma=statistics.pstdev(replay_logs) if len(replay_logs) > 1 else 0.0,
        eager_sigma=statistics.pstdev(eager_logs) if len(eager_logs) > 1 else 0.0,
        outside_ms=outside_ms,
        post_ms=post_ms,
        source=source,
    )


def _priced(steps: Iterable[dict], est: Estimator, pixels: int, num_steps: int,
            mask_ratio: float) -> list[dict]:  # fmt: skip
    """Copies of a step log's rows with "_price" (Estimator.step_ms of the step's members: the
    cache-reading ones at `mask_ratio` from DRAM, the others on the full path) and "_captures"
    (the step index of each capture run in it)."""
    strides = sorted(est.strides)
    masked = est.work(pixels, num_steps, None, {s: mask_ratio for s in strides}, "dram")
    full = est.work(pixels, num_steps, None, None, None)
    rows = []
    for r in map(dict, steps):
        members = r["members"]
        reading = sum(r["tiers"].values())
        r["_price"] = est.step_ms([masked] * reading + [full] * (len(members) - reading))
        r["_captures"] = [s for u, s in members if u.startswith(CAPTURE_UID_PREFIX)]
        rows.append(r)
    return rows


def capture_costs(steps: Iterable[dict], est: Estimator, pixels: int, num_steps: int,
                  mask_ratio: float) -> list[float]:  # fmt: skip
    """What each template capture run of a served step log cost its loop beyond its priced
    steps, ms: over the steps it ran in, each step's duration less its price (`_priced`),
    shared equally among the captures in that step. A run is one worker's (the log interleaves
    the workers' steps, and a template is often captured on two). Only runs whose `num_steps`
    steps are all in the log count (one that started before the log, or was cut off, does
    not), and not those that started in their worker's first logged step: the registrations at
    start, whose step pays the process's cold start and which no edit is routed beside."""
    runs: dict[tuple, list[float]] = {}
    started: dict[tuple, tuple] = {}  # (worker, capture uid) -> the key of its current run
    first: dict[tuple, int] = {}  # worker -> the index of its first logged step
    for i, r in enumerate(_priced(steps, est, pixels, num_steps, mask_ratio)):
        worker = (r.get("node"), r.get("worker"))
        first.setdefault(worker, i)
        caps = [(u, s) for u, s in r["members"] if u.startswith(CAPTURE_UID_PREFIX)]
        for uid, step in caps:
            if step == 0:  # a new run; one at its worker's first step is not counted
                started[(worker, uid)] = (worker, uid, i, first[worker] == i)
            if (key := started.get((worker, uid))) is not None:
                runs.setdefault(key, []).append((r["duration_ms"] - r["_price"]) / len(caps))
    return [sum(v) for k, v in runs.items() if len(v) == num_steps and not k[-1]]


def post_ms(rows: Iterable[dict]) -> float:
    """Median time of an answered request after the loop is done with it, ms: post-processing
    plus what the client waited beyond the server's own total (HTTP)."""
    vals = [t["postprocess_ms"] + r["latency_ms"] - t["server_total_ms"]
            for r in rows if r["status"] == 200 and (t := r.get("timings"))]  # fmt: skip
    return statistics.median(vals) if vals else 0.0


def outside_ms(rows: Iterable[dict]) -> float:
    """Median time of an answered request outside the loop's modelled work, ms: pre- plus
    post-processing plus what the client waited beyond the server's own total (HTTP), over a
    load-test report's rows (`instgenie loadtest --out`, a phase's "rows")."""
    vals = [t["preprocess_ms"] + t["postprocess_ms"] + r["latency_ms"] - t["server_total_ms"]
            for r in rows if r["status"] == 200 and (t := r.get("timings"))]  # fmt: skip
    return statistics.median(vals) if vals else 0.0
