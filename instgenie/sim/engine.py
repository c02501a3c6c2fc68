"""The discrete-event engine: one clock (ms), an event heap, the server's dispatcher and the
workers' loops (worker.py).

The dispatcher is server/dispatcher.py's: an arrival is routed at once when nobody waits in the
server queue and the policy finds a worker with a free slot (RoutingPolicy.choose over every
worker's WorkerView, built as server/pool.py's WorkerSlot.view builds it), else it waits in the
FIFO queue (beyond Cluster.max_queue: rejected, 429); each answered edit frees its slot and the
queue is pumped. An edit sent to a worker whose node neither holds its template's cache nor is
capturing it gets the template's capture run sent first (issue 26: RegisterTemplate ahead of the
edit on the same socket). Views read the nodes' tiers as they are now (the server's residency
reports lag by a stats poll; not modelled). Ties in time are broken by event order: deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from instgenie.scheduler.estimate import Estimator
from instgenie.scheduler.placement import NodeView, place
from instgenie.scheduler.routing import RoutingPolicy
from instgenie.scheduler.views import RouteRequest
from instgenie.sim.scenario import Scenario
from instgenie.sim.tiers import HostTiers
from instgenie.sim.worker import Host, Job, SimWorker


@dataclass
class Result:
    policy: str
    requests: list[Job]  # every edit, arrival order (finish_ms < 0: rejected)
    captures: int  # capture runs committed during the run, count
    hosts: list[Host]
    workers: list[SimWorker]
    end_ms: float  # the last event's time, ms
    rejected: int = 0
    extra: dict = field(default_factory=dict)


class Engine:
    def __init__(self, scenario: Scenario, policy: RoutingPolicy) -> None:
        sc, cl = scenario, scenario.cluster
        self.sc = sc
        self.policy = policy
        self.est = Estimator(sc.spec)
        self.pixels = sc.width * sc.height
        nbytes = sc.catalogue.nbytes
        self.hosts = [Host(f"h{h:02d}", HostTiers(cl.dram_bytes, cl.disk_bytes, cl.ideal), nbytes)
                      for h in range(cl.hosts)]  # fmt: skip
        slots = cl.slots or 2 * cl.max_batch

        def rng(i: int) -> np.random.Generator | None:  # worker i's step noise, if drawn
            return None if sc.seed is None else np.random.default_rng([sc.seed, i])

        self.workers = [
            SimWorker(i, host, self.est, cl.max_batch, slots, sc.guidance, sc.physics, rng(i))
            for h, host in enumerate(self.hosts)
            for i in range(h * cl.gpus, (h + 1) * cl.gpus)
        ]
        self.ideal_tiers: dict[str, str] | None = None
        if cl.ideal:
            self.ideal_tiers = dict.fromkeys(sc.catalogue.ids, "dram")
            ready = frozenset(sc.catalogue.ids)
            for w in self.workers:
                w.ideal_ready = ready
        else:
            self._place_initial()
            for h in self.hosts:
                h.report()  # the server knows where registration put each template
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self._loops = {w.index: w.loop() for w in self.workers}
        self.queue: list[Job] = []  # server queue (FIFO); a list: pumped from its head
        self.qhead = 0
        self.jobs: list[Job] = []
        self.rejected = 0

    def _place_initial(self) -> None:
        """Registration: each template captured on the node placement.place picks (or where
        Scenario.initial says)."""
        sc, cl = self.sc, self.sc.cluster
        if sc.initial is not None:
            for t, nodes in sc.initial.items():
                for h in nodes:
                    self.hosts[h].tiers.commit(t, sc.catalogue.nbytes)
            return
        by_name = {h.name: h for h in self.hosts}
        for t in sc.catalogue.ids:
            views = [NodeView(h.name, cl.gpus, h.tiers.dram.capacity - h.tiers.dram.used,
                              h.tiers.templates) for h in self.hosts]  # fmt: skip
            node = place(views)
            assert node is not None
            by_name[node].tiers.commit(t, sc.catalogue.nbytes)

    # ---- events ---------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, obj: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj))

    def run(self) -> Result:
        sc = self.sc
        for i, a in enumerate(sc.arrivals):
            t = sc.catalogue.ids[a.template] if a.template is not None else None
            route = RouteRequest(template_id=t, num_steps=sc.steps, pixels=self.pixels,
                                 mask_ratio=a.mask_ratio, guidance=sc.guidance,
                                 token_ratios=a.token_ratios)  # fmt: skip
            job = Job(i, t, route, self.pixels, sc.steps, arrival_ms=a.at_ms)
            self.jobs.append(job)
            self._push(a.at_ms, "arrive", job)
        for w in self.workers:
            self._resume(w)  # runs to its first block
        while self._heap:
            self.now, _, kind, obj = heapq.heappop(self._heap)
            if kind == "arrive":
                self._arrive(obj)
            elif kind == "answer":
                self._answered(*obj)
            else:
                self._resume(obj)
        captures = sum(h.tiers.captures for h in self.hosts)
        return Result(self.policy.name, self.jobs, captures, self.hosts, self.workers, self.now,
                      self.rejected, dict(sc.extra))  # fmt: skip

    def _resume(self, w: SimWorker) -> None:
        w.blocked = False
        d = next(self._loops[w.index])
        if w.finished:
            done, w.finished = w.finished, []
            post = self.sc.physics.post_ms if self.sc.physics else 0.0
            for j in done:
                j.finish_ms = self.now
                if post > 0:  # in flight on w until post-processed and answered
                    self._push(self.now + post, "answer", (w, j))
                else:
                    del w.held[j.uid]
            if not post:
                self._pump()
        if d is None:
            w.blocked = True
        else:
            self._push(self.now + d, "resume", w)

    def _answered(self, w: SimWorker, job: Job) -> None:
        del w.held[job.uid]
        self._pump()

    # ---- the dispatcher -------------------------------------------------------------------------
    def _arrive(self, job: Job) -> None:
        if self.qhead == len(self.queue) and self._route(job):
            return
        if self.sc.cluster.max_queue and len(self.queue) - self.qhead >= self.sc.cluster.max_queue:
            self.rejected += 1
            return
        self.queue.append(job)

    def _pump(self) -> None:
        while self.qhead < len(self.queue) and self._route(self.queue[self.qhead]):
            self.qhead += 1

    def _route(self, job: Job) -> bool:
        views = [w.view(self.ideal_tiers) for w in self.workers]
        assert job.route is not None
        i = self.policy.choose(job.route, views)
        if i is None:
            return False
        self._send(self.workers[i], job)
        return True

    def _send(self, w: SimWorker, job: Job) -> None:
        job.dispatched_ms, job.worker = self.now, w.index
        w.held[job.uid] = job
        host, t = w.host, job.template
        # the server sends the capture ahead of the edit where it knows the node lacks the
        # cache (the residency last reported); where its view is stale, the edit finds the
        # cache gone on arrival and runs the full path without a capture
        held = host.tiers.ideal or (t is not None and t in host.residency()[1])
        if t is not None and not held and t not in host.building:
            host.building[t] = w.index
            job.triggered_capture = True
            self._deliver(w, Job(-1 - job.uid, t, None, job.pixels, job.steps))
        self._deliver(w, job)

    def _deliver(self, w: SimWorker, job: Job) -> None:
        w.inbox.append(job)
        if w.blocked:
            w.blocked = False
            self._push(self.now, "resume", w)
