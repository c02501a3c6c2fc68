"""Routing policies: which worker gets the next request.

A policy is a pure function of the request's routing facts and a snapshot of every worker's state
(no I/O, no clocks), so it is unit-testable. The dispatcher calls `choose` only with workers that
are up and accepting; a policy returns None to say "none of these has room": the request then
waits in the server queue. Policies: `least-loaded` (the default: slot occupancy), `mask-aware`
(paper §4.4, Algorithm 2, priced by estimate.py; decision 0019), `cache-aware` (mask-aware priced
with the tier each worker's node holds the template's cache in, a miss as the full run plus its
capture; decision 0034) and `round-robin`. What they
read: views.RouteRequest (the request) and views.WorkerView (each worker).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

from instgenie.scheduler.estimate import Estimator, Work
from instgenie.scheduler.spec import CostSpec
from instgenie.scheduler.views import RouteRequest, WorkerView

__all__ = ["CacheAware", "LeastLoaded", "MaskAware", "RoundRobin", "RouteRequest", "RoutingPolicy",
           "WorkerView", "make_policy"]  # fmt: skip


def _cold(request: RouteRequest, w: WorkerView) -> int:
    """1 if the request edits a template whose cache is not ready on `w` (tie-breaks)."""
    return int(request.template_id is not None and request.template_id not in w.templates_ready)


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> int | None:
        """The index of the chosen worker among `workers`, or None if none has room."""
        ...


class RoundRobin:
    """Workers in turn, skipping full ones."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> int | None:
        if not workers:
            return None
        start = next(self._turn)
        n = len(workers)
        for k in range(n):
            w = workers[(start + k) % n]
            if w.has_room:
                return w.index
        return None


class LeastLoaded:
    """The worker with the smallest fraction of its slots in use; ties go to a worker where the
    request's template cache is resident, then to the lower index."""

    name = "least-loaded"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> int | None:
        room = [w for w in workers if w.has_room]
        if not room:
            return None

        def cost(w: WorkerView) -> tuple[float, int, int]:
            return (w.in_flight / max(1, w.slots), _cold(request, w), w.index)

        return min(room, key=cost).index


class MaskAware:
    """Paper §4.4, Algorithm 2: the worker where the request is predicted to finish first.

    Cost of worker w for request r, ms: the time until r's result is decoded on w, simulated
    step by step from what w holds. Each held request has its remaining steps (its steps minus
    the Progress it reported); at most B (WorkerConfig.max_batch) run per step, in arrival
    order, r last. First the loop encodes r and every held request that has done no step yet (an
    upper bound: such a request may be encoded already). Until r finishes: the running batch
    takes one step of estimate.Estimator.step_ms (the worker's own load planner pricing that
    batch with its fitted latency models, each request at its mask's token counts, on the full
    path where its template's cache is not ready there, with host -> GPU loads where the cache
    is not on the GPU, plus the rest of the step); a request leaves after its last step, the
    loop decodes it before the next step, and the next waiting one joins. r's cost ends with
    the decode of the requests leaving with it (one batched decode). Encode and decode are the
    profile's stage fits (0 where the worker sent none). (The paper prices one step of the
    worker's batch with r added; the simulation also counts the steps r shares with requests
    about to finish, the wait for a place, and the loop's per-request work between steps.)
    Ties go to a worker holding the template's cache, then to the lower slot occupancy and
    index. When a candidate has not reported its CostSpec, the decision is least-loaded's.
    """

    name = "mask-aware"
    needs_mask = True  # the dispatcher measures RouteRequest.token_ratios

    def __init__(self) -> None:
        self._fallback = LeastLoaded()
        self._estimators: dict[int, tuple[CostSpec, Estimator]] = {}

    def estimator(self, spec: CostSpec) -> Estimator:
        hit = self._estimators.get(id(spec))
        if hit is None or hit[0] is not spec:
            if len(self._estimators) > 64:  # specs of restarted workers
                self._estimators.clear()
            hit = self._estimators[id(spec)] = (spec, Estimator(spec))
        return hit[1]

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> int | None:
        room = [w for w in workers if w.has_room]
        if not room:
            return None
        if any(w.cost is None for w in room):
            return self._fallback.choose(request, room)

        def key(w: WorkerView) -> tuple[float, int, float, int]:
            return (self.cost_ms(request, w), _cold(request, w), w.in_flight / max(1, w.slots),
                    w.index)  # fmt: skip

        return min(room, key=key).index

    def cost_ms(self, request: RouteRequest, w: WorkerView) -> float:
        """Predicted time from now until `request`'s result is decoded on `w` (the simulation
        above), ms."""
        assert w.cost is not None
        est = self.estimator(w.cost)
        # [work, steps left]; requests with no step left are in post-processing: not in a batch
        held = [[work := self._work(est, q, w), work.steps - q.steps_done] for q in w.requests]
        new = [self._work(est, request, w), 0]
        new[1] = new[0].steps
        fresh = [q.pixels for q in w.requests if q.steps_done == 0] + [request.pixels]
        return finish_ms(est, [h for h in held if h[1] > 0], new, fresh, w.max_batch)

    @staticmethod
    def _work(est: Estimator, r: RouteRequest, w: WorkerView) -> Work:
        tier = None
        if r.template_id is not None and r.template_id in w.templates_ready:
            tier = w.template_tiers.get(r.template_id, "gpu")
        ratios = dict(r.token_ratios) if r.token_ratios else None
        if ratios is not None and any(s not in ratios for s in est.strides):
            ratios = None  # measured for other strides (another model): price all tokens
        return est.work(r.pixels, r.num_steps, r.guidance, ratios, tier, r.strength)


class CacheAware(MaskAware):
    """Mask-aware routing priced with where each template's cache lives (issue 26): the same
    simulation of w's batches, each request on w priced with the tier w's node holds its
    template's cache in (w.template_tiers: "gpu" read in place, "dram" / "disk" copied every
    step at that tier's load fit), and a miss priced as what it causes there: the edit runs the
    full path and its template's capture run (a full-path request of the edit's size and steps,
    sent ahead of it, not decoded) joins w's batches too. A held request whose template is not
    ready on w runs the full path and has a capture beside it (priced as one more held request
    with its steps left), once per template: a new edit of that template then runs the full
    path without starting another. Each step a capture runs in costs that step's batch what the
    worker's profile says a served capture takes beyond its priced steps, per step
    (Estimator.capture_step_ms: the segment's creation, its copies, its commit, its batch run
    eagerly; measured ≈ 2.9 s over 20 steps for an SDXL 1024² template on an H200, 3x their
    price): the requests batched beside it wait for it, those after it do not. The price is
    the latency the edit adds on w: its own time until decoded plus the delay it causes the
    edits w holds (their finish times simulated with and without it: a request joining a full
    batch, or a disk read or a capture slowing its steps, costs them too). Replication follows
    from the prices: a holding node's price grows with its queue, and once it exceeds a miss
    elsewhere (full run + capture), the edit goes there and that node captures the template
    (decision 0034). Ties as mask-aware."""

    name = "cache-aware"
    #: a capture the edit would trigger serves that template's later edits on the node too: the
    #: edit is charged this share of its cost beyond its priced steps (captures already running
    #: cost their full share: that time passes whoever sent them). 1/3: on 8 x 8 simulated
    #: workers p95 2.38 s against 3.59 s charged in full and 2.30 s unpriced, p99 3.04 against
    #: 4.54 and 4.90 s; on the measured two-node runs the same routing as in full (decision 0048)
    capture_share = 1 / 3

    def cost_ms(self, request: RouteRequest, w: WorkerView) -> float:
        assert w.cost is not None
        est = self.estimator(w.cost)
        line: list[list] = []  # [work, steps left], in arrival order
        fresh: list[int] = []  # pixels of the requests the loop still has to encode
        building: set[str] = set()  # templates captured on w meanwhile
        for q in w.requests:
            work = self._work(est, q, w)
            left = work.steps - q.steps_done
            if left <= 0:
                continue  # in post-processing: not in a batch
            if _capturing(q, work, building):
                line.append([self._capture(est, q), left, False, est.capture_step_ms(q.pixels)])
                fresh += [q.pixels] if q.steps_done == 0 else []
            line.append([work, left])
            fresh += [q.pixels] if q.steps_done == 0 else []
        held = len(line)
        without = finishes(est, [list(r) for r in line], fresh, w.max_batch)
        work = self._work(est, request, w)
        if _capturing(request, work, building):
            extra = est.capture_step_ms(request.pixels) * self.capture_share
            line.append([self._capture(est, request), work.steps, False, extra])
            fresh = fresh + [request.pixels]
        line.append([work, work.steps])
        done = finishes(est, line, fresh + [request.pixels], w.max_batch)
        # the latency it adds: its own, and the delay it causes the edits held there
        added = sum(done[i] - without[i] for i in range(held) if len(line[i]) < 3)
        return done[-1] + added

    @staticmethod
    def _capture(est: Estimator, r: RouteRequest) -> Work:
        """The capture run of r's template: a full-path request of r's size and steps."""
        return est.work(r.pixels, r.num_steps, r.guidance, None, None, r.strength)


def _capturing(r: RouteRequest, work: Work, building: set[str]) -> bool:
    """True (and `building` notes it) if `r` edits a template whose cache is not ready where it
    runs (priced on the full path) and no capture of it is noted yet."""
    t = r.template_id
    if t is None or work.ratios is not None or t in building:
        return False
    building.add(t)
    return True


def finish_ms(
    est: Estimator, line: list[list], new: list, fresh: list[int], max_batch: int
) -> float:
    """MaskAware's simulation: `line` = [work, steps left] of the requests ahead of `new` (its
    [work, steps]), in arrival order, each with steps left (a third item False: a capture run,
    which leaves without a decode); `fresh`: the pixels of the requests to encode first (`new`
    included). The time until `new` is decoded, ms."""
    line = [*line, new]
    B = max_batch if max_batch > 0 else len(line)
    t = sum(est.stage_ms("encode", px) for px in fresh)

    def decode(r: list) -> float:
        return est.stage_ms("decode", r[0].pixels) if len(r) < 3 or r[2] else 0.0

    while True:
        running = line[:B]
        k = min(r[1] for r in running)  # steps until the next one leaves
        t += k * est.step_ms([r[0] for r in running])
        if any(r is new for r in running) and new[1] <= k:  # decoded with those leaving too
            return t + sum(decode(r) for r in running if r[1] <= k)
        for r in running:
            r[1] -= k
            if r[1] <= 0:
                t += decode(r)
        line = [r for r in line if r[1] > 0]


def finishes(est: Estimator, line: list[list], fresh: list[int], max_batch: int) -> list[float]:
    """finish_ms's simulation run until every request of `line` has left: each one's time until
    it is decoded (a capture's: until it leaves), ms, in `line`'s order. An entry is [work,
    steps left], or [work, steps left, decoded?, extra ms per step] (a capture: its steps cost
    their batch that much more). Mutates `line`."""
    out = [0.0] * len(line)
    todo = list(range(len(line)))
    B = max_batch if max_batch > 0 else max(1, len(line))
    t = sum(est.stage_ms("encode", px) for px in fresh)
    while todo:
        running = todo[:B]
        k = min(line[i][1] for i in running)
        extra = sum(line[i][3] for i in running if len(line[i]) > 3)
        t += k * (est.step_ms([line[i][0] for i in running]) + extra)
        leaving = []
        for i in running:
            line[i][1] -= k
            if line[i][1] <= 0:
                leaving.append(i)
        t += sum(est.stage_ms("decode", line[i][0].pixels) for i in leaving
                 if len(line[i]) < 3 or line[i][2])  # fmt: skip
        for i in leaving:
            out[i] = t  # one batched decode: all leave once it is done
        todo = [i for i in todo if line[i][1] > 0]
    return out


def make_policy(name: str) -> RoutingPolicy:
    policies = {p.name: p for p in (LeastLoaded, MaskAware, CacheAware, RoundRobin)}
    if name not in policies:
        raise ValueError(f"routing: unknown policy {name!r}; known: {', '.join(policies)}")
    return policies[name]()
