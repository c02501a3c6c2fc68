"""The worker processes of one server: one per device, started in parallel, restarted on death.

A slot's worker is started by the pool's `launch` function: a local subprocess (WorkerHandle) by
default; in cluster mode (instgenie/cluster/) a Ray actor on the slot's node, whose handle has
the same interface (client, pid, address, proc.poll()/kill(), wait_ready, close). Slots are
added and removed while serving in cluster mode (`add`, `remove`: nodes that join and leave);
a slot's index is never reused, so it is an id, not a position in `slots`.

State is owned by the event loop thread (the dispatcher, health monitor and templates read and
write it there); only `start`, `close` and a restart's start-up run on other threads.
Invariants:
- A slot accepts requests only while `state == "up"` and its supervisor process is alive.
- A dead supervisor's pending requests are failed by its WorkerHandle (worker_died, retryable)
  at once; the pool then replaces the handle (restart_workers) while the slot reads "restarting".
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from instgenie.config import Config
from instgenie.scheduler.fits import fit_ms
from instgenie.scheduler.spec import CostSpec
from instgenie.scheduler.views import RouteRequest, WorkerView
from instgenie.worker.client import WorkerClient, WorkerHandle

log = logging.getLogger("instgenie.server")

#: how long a worker that is still starting gets to shut down before it is killed, seconds
#: (nothing is in flight yet)
STOP_STARTING_S = 2.0
#: where a worker's profile prices a stage call (CostSpec.stages, ms against working pixels),
#: the call overruns past this multiple of that price for the largest request the worker holds,
#: and never before STAGE_OVERRUN_FLOOR_S seconds (a loaded host's jitter); the config's
#: stage_overrun_s stays the upper bound and the limit where there is no price
STAGE_OVERRUN_FACTOR = 4.0
STAGE_OVERRUN_FLOOR_S = 5.0
LOCAL_NODE = "local"  # WorkerSlot.node of a single-host pool


@dataclass
class WorkerSlot:
    index: int  # the slot's id, 0-based (single host: the device's position in --devices)
    config: Config  # the worker's config (its device in config.model.device)
    slots: int  # most requests sent to it at once, count
    handle: WorkerHandle | None = None  # or a cluster.handle.RemoteWorkerHandle
    #: the node (host) it runs on: "local" on one host; in cluster mode the Ray node id; the
    #: workers of one node share its DRAM and disk cache tiers
    node: str = LOCAL_NODE
    node_ip: str = ""  # that node's address ("" on one host)
    state: str = "starting"  # "starting" | "up" | "restarting" | "failed" | "stopped"
    #: uid -> the dispatcher's future of each request sent and not answered (event loop only)
    pending: dict = field(default_factory=dict)
    starts: int = 0  # successful starts, count (the first one included)
    #: restarts of the worker's child processes (loop, pre, post) by its earlier supervisors,
    #: count: a supervisor's own counters die with it, so `restart` folds them in here
    child_restarts_before: int = 0
    last_error: str = ""  # why the last start failed or the worker died
    templates_ready: set[str] = field(default_factory=set)  # templates.py
    #: template id -> the fastest tier holding its cache there (templates.py)
    template_tiers: dict[str, str] = field(default_factory=dict)
    #: uid -> routing facts of each pending request (the dispatcher keeps it beside `pending`)
    routes: dict = field(default_factory=dict)
    #: uid -> the worker client's EditHandle of each request sent: its `progress` (steps done)
    #: and `num_steps` are written by the client thread as Progress arrives, only read here
    progress: dict = field(default_factory=dict)
    cost: CostSpec | None = None  # the worker's CostSpec, fetched at each (re)start
    # health.py:
    stats: dict[str, float] = field(default_factory=dict)  # last Stats answer
    stats_at: float = 0.0  # monotonic time of the last Stats answer
    steps_seen: float = -1.0  # steps_total in that answer
    steps_moved_at: float = 0.0  # monotonic: last time steps moved, or the loop held nothing
    step_cursor: int = 0  # next step-log entry to fetch

    @property
    def device(self) -> str:
        return self.config.model.device

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    @property
    def client(self) -> WorkerClient | None:
        return self.handle.client if self.handle is not None else None

    @property
    def accepting(self) -> bool:
        return self.state == "up" and self.handle is not None and self.handle.proc.poll() is None

    @property
    def child_restarts(self) -> int:
        """Restarts of child processes by the current supervisor (its `restarts_<role>_<i>`)."""
        return int(sum(v for k, v in self.stats.items() if k.startswith("restarts_")))

    @property
    def restarts(self) -> int:
        """Every restart of this worker's processes, count: its supervisor by the server, its
        loop, pre and post processes by its supervisors."""
        return max(0, self.starts - 1) + self.child_restarts_before + self.child_restarts

    def observe(self, stats: dict[str, float], now: float) -> None:
        """Record a Stats answer; the step counter must move while the loop holds requests."""
        steps = stats.get("steps_total", 0.0)
        # a loop in a VAE/prompt encode or decode (under the worker's stage limit) is working
        if steps != self.steps_seen or not stats.get("in_loop") or stats.get("loop_busy_s"):
            self.steps_moved_at = now
        self.steps_seen = steps
        self.stats, self.stats_at = stats, now

    def health(self, now: float, timeout_s: float, stall_s: float) -> tuple[bool, str]:
        """(can make progress, why not)."""
        if not self.accepting:
            return False, f"worker is {self.state}" + (
                f": {self.last_error}" if self.last_error else ""
            )
        if now - self.stats_at > timeout_s:
            return False, f"no stats answer for {now - self.stats_at:.1f} s"
        if not self.stats.get("ready"):
            return False, "worker processes are (re)starting"
        if self.stats.get("in_loop") and now - self.steps_moved_at > stall_s:
            return False, f"denoise loop made no step for {now - self.steps_moved_at:.1f} s"
        return True, ""

    def busy(self) -> tuple[str, float]:
        """(the model stage call its loop is in, e.g. "encode", seconds in it) as of the last
        stats answer; ("", 0.0) when none."""
        s = self.stats.get("loop_busy_s", 0.0)
        stage = next((k.removeprefix("loop_busy_") for k in self.stats
                      if k.startswith("loop_busy_") and k != "loop_busy_s"), "")  # fmt: skip
        return (stage or "a stage", s) if s > 0 else ("", 0.0)

    def stage_limit_s(self, stage: str, stage_overrun_s: float) -> tuple[float, float]:
        """(seconds one `stage` call may take before the worker is degraded, the call's expected
        seconds or 0.0 if unpriced): STAGE_OVERRUN_FACTOR x its expected time where the worker's
        profile prices the stage (at the largest request it holds, which is the one a
        long call most likely serves), at least STAGE_OVERRUN_FLOOR_S, at most
        `stage_overrun_s`; `stage_overrun_s` where it is unpriced."""
        fit = self.cost.stages.get(stage) if self.cost is not None and self.cost.compute else None
        if fit is None or not self.routes:
            return stage_overrun_s, 0.0
        pixels = max(r.pixels for r in self.routes.values())
        expected_s = fit_ms(fit, pixels) / 1e3
        limit = max(STAGE_OVERRUN_FACTOR * expected_s, STAGE_OVERRUN_FLOOR_S)
        return min(stage_overrun_s, limit), expected_s

    def overrun(self, stage_overrun_s: float) -> str:
        """Why the worker is degraded ("" = it is not): its loop has been in one model stage
        call for longer than it should take (`stage_limit_s`: working, but every other request
        waits)."""
        stage, s = self.busy()
        limit, expected_s = self.stage_limit_s(stage, stage_overrun_s)
        if s <= limit:
            return ""
        why = f"expected {expected_s:.1f} s" if expected_s else f"stage_overrun_s {limit:g} s"
        return f"its loop has been in one {stage} call for {s:.1f} s (over {limit:g} s: {why})"

    def forget(self, uid: str) -> None:
        self.routes.pop(uid, None)
        self.progress.pop(uid, None)

    def _held(self, uid: str) -> RouteRequest:
        route = self.routes[uid]
        handle = self.progress.get(uid)
        done = handle.progress if handle is not None else None
        if not done:
            return route
        # the steps it really runs (strength < 1 runs fewer), as its Progress says
        total = handle.num_steps or route.num_steps
        return dataclasses.replace(route, steps_done=done[-1], num_steps=total, strength=None)

    def view(self) -> WorkerView:
        return WorkerView(
            index=self.index,
            device=self.device,
            in_flight=self.in_flight,
            slots=self.slots,
            batch_size=int(self.stats.get("batch_size_last", 0)),
            queue_depth=int(self.stats.get("in_queued", 0) + self.stats.get("in_pre", 0)),
            templates_ready=frozenset(self.templates_ready),
            template_tiers=dict(self.template_tiers),
            requests=tuple(self._held(u) for u in self.pending if u in self.routes),
            max_batch=self.config.worker.max_batch,
            cost=self.cost,
            host=self.node,
        )


def launch_local(slot: WorkerSlot) -> WorkerHandle:
    """Start `slot`'s worker as a subprocess of this process (single host)."""
    return WorkerHandle(slot.config)


class WorkerPool:
    def __init__(
        self,
        configs: list[Config],
        slots: int,
        start_timeout_s: float,
        launch: Callable[[WorkerSlot], WorkerHandle] = launch_local,
        nodes: list[tuple[str, str]] | None = None,
    ) -> None:
        """One slot per config; `nodes`: each slot's (node id, node address) (default: local);
        `launch` starts a slot's worker and returns its handle at once (not yet ready)."""
        if not configs:
            raise ValueError("devices: at least one worker device is required")
        self.slot_limit = slots  # requests per worker; 0: 2 x its max_batch
        self.slots: list[WorkerSlot] = []
        self._next = 0  # the next slot's index (never reused)
        for c, (node, ip) in zip(configs, nodes or [(LOCAL_NODE, "")] * len(configs),
                                 strict=True):  # fmt: skip
            self._new_slot(c, node, ip)
        self.start_timeout_s = start_timeout_s
        self.launch = launch
        #: starts and restarts run here; its threads outlive their workers (see `start`); in
        #: cluster mode slots come and go, so it is sized for a fleet, not for the first slots
        self._executor = ThreadPoolExecutor(max_workers=max(len(configs), 64),
                                            thread_name_prefix="worker")  # fmt: skip

    def _new_slot(self, config: Config, node: str, ip: str) -> WorkerSlot:
        slot = WorkerSlot(self._next, config, self.slot_limit or 2 * config.worker.max_batch,
                          node=node, node_ip=ip)  # fmt: skip
        self._next += 1
        self.slots.append(slot)
        return slot

    def add(self, config: Config, node: str, ip: str = ""):
        """A new slot on `node`, started in the background: (slot, concurrent Future of its
        start, raising what failed). Event loop thread (it changes `slots`)."""
        slot = self._new_slot(config, node, ip)
        return slot, self._executor.submit(self._start, slot)

    def remove(self, slot: WorkerSlot):
        """Take `slot` out of the pool (its node left) and stop its worker in the background
        (a concurrent Future). Event loop thread; the caller has failed its requests first."""
        if slot in self.slots:
            self.slots.remove(slot)
        handle, slot.handle = slot.handle, None
        slot.state = "removed"
        if handle is None:
            return self._executor.submit(lambda: None)
        return self._executor.submit(_close, handle, False, STOP_STARTING_S)

    def start(self) -> None:
        """Start every worker in parallel and wait for all ready handshakes; on any failure the
        started ones are closed and the first error is raised.

        Workers are started from this pool's executor threads, which live until `close`: the
        supervisor asks for SIGKILL when the *thread* that spawned it exits (PR_SET_PDEATHSIG)."""
        futures = [self._executor.submit(self._start, s) for s in self.slots]
        try:
            for fut in futures:
                while not fut.done():
                    wait([fut], timeout=0.2)  # short waits: signals interrupt start-up
                fut.result()
        except BaseException:
            self.close(drain=False, timeout=STOP_STARTING_S)
            raise

    def _start(self, slot: WorkerSlot) -> None:
        """Spawn the worker and wait for its ready handshake. The handle is published at once,
        so that `close` from another thread can stop a worker that is still starting."""
        t0 = time.monotonic()
        if slot.state == "removed":  # its node left before this (re)start ran
            raise RuntimeError(f"worker {slot.index} was removed")
        handle = self.launch(slot)
        slot.handle = handle
        try:
            handle.wait_ready(self.start_timeout_s)
        except BaseException:
            if slot.handle is handle:
                slot.handle = None
            _close(handle, drain=False, timeout=STOP_STARTING_S)
            raise
        if slot.handle is not handle:  # closed or removed meanwhile (which closes it)
            raise RuntimeError(f"worker {slot.index} was stopped while starting")
        # for the mask-aware router (before the slot is up: nothing else asks it for stats);
        # without it, routing falls back to least-loaded - never a reason to fail the worker
        why = "it reported none"
        try:
            slot.cost = handle.client.cost_spec(timeout=10.0)
        except Exception as exc:  # noqa: BLE001 - timeout, a worker that died meanwhile, ...
            slot.cost, why = None, f"{type(exc).__name__}: {exc}"
        if slot.cost is None:
            log.warning("worker %d: no cost spec (%s); mask-aware routing prices it by load",
                        slot.index, why)  # fmt: skip
        slot.state, slot.last_error = "up", ""
        slot.starts += 1
        slot.stats_at = slot.steps_moved_at = time.monotonic()
        slot.stats = {"ready": 1.0}
        where = "" if slot.node == LOCAL_NODE else f" on node {slot.node[:12]} ({slot.node_ip})"
        log.info("worker %d (%s%s, pid %d) ready in %.1f s", slot.index, slot.device, where,
                 handle.pid, time.monotonic() - t0)  # fmt: skip

    def restart(self, slot: WorkerSlot):
        """Replace a dead worker (a concurrent.futures.Future; the caller awaits it)."""
        old, slot.handle = slot.handle, None
        slot.child_restarts_before += slot.child_restarts
        slot.state, slot.stats = "restarting", {}
        slot.templates_ready.clear()
        slot.template_tiers.clear()
        slot.cost = None
        slot.step_cursor, slot.steps_seen = 0, -1.0

        def run() -> None:
            if old is not None:
                _close(old, drain=False, timeout=5)
            try:
                self._start(slot)
            except Exception as exc:
                slot.state, slot.last_error = "failed", f"restart failed: {exc}"
                log.error("worker %d restart failed: %s", slot.index, exc)

        return self._executor.submit(run)

    def close(self, drain: bool = True, timeout: float = 60.0) -> dict[int, int]:
        """Shut every worker down in parallel; {index: exit status}."""
        codes: dict[int, int] = {}

        def one(slot: WorkerSlot) -> None:
            handle, slot.handle = slot.handle, None
            slot.state = "stopped"
            if handle is not None:
                codes[slot.index] = _close(handle, drain=drain, timeout=timeout)

        threads = [threading.Thread(target=one, args=(s,)) for s in list(self.slots)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._executor.shutdown(wait=False, cancel_futures=True)
        return codes


def _close(handle: WorkerHandle, drain: bool, timeout: float) -> int:
    """Close a worker; its children die with it (worker.lifeline arms PR_SET_PDEATHSIG before
    their imports, so also during start-up)."""
    return handle.close(drain=drain, timeout=timeout)
