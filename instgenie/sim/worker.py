"""One simulated GPU worker: the denoise loop of worker/loop.py and worker/batcher.py, timed by the
scheduler's own prices (Estimator, the worker's CostSpec).

    while running:
        receive()    # block only when holding nothing; each message: its encode (stage fit),
                     # then admit (an edit picks its path against its host's tiers)
        iterate()    # admit FIFO while the head has the batch's size, up to max_batch;
                     # one step of the running batch: Estimator.step_ms
        retire()     # finished edits: one VAE decode each (stage fit), then answered;
                     # a finished capture: committed to the host's DRAM tier

`loop()` is a generator that yields how long, ms, each piece of work takes (None: block until a
message arrives); the engine resumes it that much later. Not modelled: CPU pre/post-processing
(their own processes), stats and progress delays, the per-worker GPU tier (device_tier.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np

from instgenie.scheduler.estimate import Estimator, Work
from instgenie.scheduler.views import RouteRequest, WorkerView
from instgenie.sim.physics import StepPhysics
from instgenie.sim.tiers import HostTiers


@dataclass(eq=False)
class Job:
    """An edit (route set) or a template's capture run (route None) in a worker."""

    uid: int
    template: str | None
    route: RouteRequest | None
    pixels: int
    steps: int
    arrival_ms: float = 0.0
    dispatched_ms: float = -1.0
    finish_ms: float = -1.0
    worker: int = -1
    work: Work | None = None  # its path and tier, set when the loop admits it
    tier: str | None = None  # the tier it read its template's cache from (None: full path)
    steps_done: int = 0
    triggered_capture: bool = False  # its dispatch sent its template's capture ahead of it
    no_room: bool = False  # a capture run whose host had no room for it: it records nothing
    _view: RouteRequest | None = None

    @property
    def capture(self) -> bool:
        return self.route is None

    def held_route(self) -> RouteRequest:
        """What the router sees of it: its RouteRequest with the steps it has done."""
        assert self.route is not None
        if self._view is None or self._view.steps_done != self.steps_done:
            self._view = dataclasses.replace(self.route, steps_done=self.steps_done)
        return self._view


@dataclass
class Host:
    """A node: its workers share its DRAM and disk tiers and its captures."""

    name: str
    tiers: HostTiers
    nbytes: int  # cache bytes of one template
    #: template -> the worker whose capture run of it was sent and has not committed
    building: dict[str, int] = field(default_factory=dict)
    version: int = 0  # bumped when its tiers change (views are rebuilt)
    _snapshot: tuple[int, frozenset, dict] | None = None
    #: the residency its loops last reported (None: none has yet; the tiers as they are)
    reported: tuple[frozenset[str], dict[str, str]] | None = None

    def residency(self) -> tuple[frozenset[str], dict[str, str]]:
        """(templates ready, template -> tier) as the server knows them: as one of the node's
        loops last reported (worker/loop.py reports its residency between steps, so a long
        step - a capture pinning its segment - leaves the server's view stale meanwhile)."""
        return self.reported if self.reported is not None else self.live()

    def report(self) -> None:
        """A loop of this node reports the residency now."""
        self.reported = self.live()

    def live(self) -> tuple[frozenset[str], dict[str, str]]:
        """(templates ready, template -> tier) in its tiers now."""
        if self._snapshot is None or self._snapshot[0] != self.version:
            t = self.tiers
            tiers = {k: "disk" for k in t.disk.entries}
            tiers.update((k, "dram") for k in t.dram.entries)
            self._snapshot = (self.version, frozenset(tiers), tiers)
        return self._snapshot[1], self._snapshot[2]


class SimWorker:
    def __init__(self, index: int, host: Host, est: Estimator, max_batch: int, slots: int,
                 guidance: float | None, physics: StepPhysics | None = None,
                 rng: np.random.Generator | None = None) -> None:  # fmt: skip
        self.index = index
        #: a served loop's step times (physics.py); None: each step takes its price
        self.physics = physics
        #: draws each step's noise (physics' sigmas); None: every step takes its fitted time
        self.rng = rng
        self._last_batch: frozenset[int] = frozenset()  # uids of the last step's batch
        self.host = host
        self.est = est
        self.max_batch = max_batch
        self.slots = slots
        self.guidance = guidance
        self.inbox: deque[Job] = deque()  # sent, not yet handled by the loop
        self.waiting: deque[Job] = deque()  # encoded, not yet in the batch
        self.running: list[Job] = []
        self.held: dict[int, Job] = {}  # edits sent and not answered, oldest first
        self.blocked = False  # the loop waits for a message
        self.steps = 0  # denoising steps run, count
        self.busy_ms = 0.0  # time spent encoding, stepping, decoding, ms
        self.finished: list[Job] = []  # edits answered since the engine last looked
        self.ideal_ready: frozenset[str] | None = None  # ideal fleet: every template, DRAM

    def view(self, ideal_tiers: dict[str, str] | None = None) -> WorkerView:
        """What the server's WorkerSlot.view would give the router (server/pool.py)."""
        if self.ideal_ready is not None:
            ready, tiers = self.ideal_ready, ideal_tiers or {}
        else:
            ready, tiers = self.host.residency()
        return WorkerView(
            index=self.index,
            device=f"{self.host.name}/gpu{self.index}",
            in_flight=len(self.held),
            slots=self.slots,
            batch_size=len(self.running),
            templates_ready=ready,
            template_tiers=tiers,
            requests=tuple(j.held_route() for j in self.held.values()),
            max_batch=self.max_batch,
            cost=self.est.spec,
            host=self.host.name,
        )

    # ---- the loop ---------------------------------------------------------------------------
    def loop(self) -> Generator[float | None, None, None]:
        est = self.est
        while True:
            if not self.running and not self.waiting and not self.inbox:
                yield None  # blocks until a message arrives
            while self.inbox:  # receive(): each message encoded, then admitted
                job = self.inbox.popleft()
                yield self._spent(est.stage_ms("encode", job.pixels))
                self._admit(job)
            self._join()
            if not self.running:
                continue
            yield self._spent(self._step_ms())
            self.steps += 1
            for j in self.running:
                j.steps_done += 1
            # a capture that found no room leaves after its first step (worker/batcher.py)
            done = [j for j in self.running if _leaves(j)]
            self.running = [j for j in self.running if not _leaves(j)]
            edits = [j for j in done if not j.capture]
            for j in done:
                if j.capture:
                    self._committed(j)
                elif j.tier is not None:
                    self.host.tiers.release(j.template)  # type: ignore[arg-type]
            self.host.report()  # the step's LoopSteps carries the residency
            if edits:  # one batched decode (priced per request, as the router does)
                yield self._spent(sum(est.stage_ms("decode", j.pixels) for j in edits))
                self.finished += edits

    def _step_ms(self) -> float:
        """The running batch's next step: its price (Estimator.step_ms), as `physics` turns a
        price into a served loop's step time."""
        price = self.est.step_ms([j.work for j in self.running])  # type: ignore[misc]
        if self.physics is None:  # captures' costs beyond their steps, as the router prices them
            caps = [j for j in self.running if j.capture and not j.no_room]
            return price + sum(self.est.capture_step_ms(j.pixels) for j in caps)
        batch = frozenset(j.uid for j in self.running)
        new, self._last_batch = batch != self._last_batch, batch
        captures = [j for j in self.running if j.capture]

        def held(j: Job, step: int) -> int:  # bytes of j's cache if j is at its `step`
            return self.host.nbytes if j.steps_done == step and not j.no_room else 0

        first = sum(held(j, 0) for j in captures)
        last = sum(held(j, j.work.steps - 1) for j in captures)  # type: ignore[union-attr]
        ms = self.physics.step_ms(price, new, first, len(captures), last)
        if self.rng is not None:  # log-normal about the fitted time (its median)
            sigma = self.physics.eager_sigma if captures else self.physics.replay_sigma
            ms *= math.exp(self.rng.normal(0.0, sigma)) if sigma > 0 else 1.0
        return ms

    def _spent(self, ms: float) -> float:
        self.busy_ms += ms
        return ms

    def _admit(self, job: Job) -> None:
        """The loop's admit: a capture runs unless its host holds the cache; an edit reads its
        template's cache where its host holds it (masked path), else runs the full path."""
        host, t = self.host, job.template
        if job.capture:
            assert t is not None
            if host.tiers.tier(t) is not None:  # committed meanwhile: answered at once
                return
            job.no_room = not host.tiers.reserve(t, host.nbytes)
            job.work = self.est.work(job.pixels, job.steps, self.guidance, None, None)
        else:
            assert job.route is not None
            job.tier = host.tiers.read(t, host.nbytes) if t is not None else None
            if job.tier == "disk":  # promoted to DRAM: the host's residency changed
                host.version += 1
            r = job.route
            ratios = dict(r.token_ratios) if job.tier is not None else None
            job.work = self.est.work(job.pixels, job.steps, r.guidance, ratios, job.tier)
        self.waiting.append(job)

    def _join(self) -> None:
        """scheduler/batching.py's continuous policy: the head of the queue while it has the
        running batch's size (FIFO across sizes), up to max_batch."""
        key = self.running[0].pixels if self.running else None
        while self.waiting and len(self.running) < self.max_batch:
            head = self.waiting[0]
            if key is not None and head.pixels != key:
                break
            key = head.pixels
            self.running.append(self.waiting.popleft())

    def _committed(self, job: Job) -> None:
        host = self.host
        assert job.template is not None
        host.building.pop(job.template, None)
        if job.no_room:  # recorded nothing: the next edit routed here sends it again
            return
        host.tiers.commit(job.template, host.nbytes)
        host.tiers.captures += 1
        host.version += 1


def _leaves(job: Job) -> bool:
    """The job leaves the running batch after this step: it ran all its steps, or it is a
    capture that found no room (it records nothing)."""
    return job.steps_done >= job.work.steps or (job.capture and job.no_room)  # type: ignore[union-attr]
