"""Admission, the server queue and routing of edits to workers.

Every edit is admitted (`admit`, synchronous: 429/503 at once) and then run (`run`). A request
runs on a worker when the routing policy finds one with a free slot; otherwise it waits in the
server queue, FIFO, bounded by ServerConfig.max_queue (beyond it: 429 + Retry-After).
Invariants (event loop thread only):
- A slot's capacity is reserved from routing until the worker's terminal answer for the request
  (done, failed or cancelled) - never released on the client's say-so, so a cancelled request
  holds its slot until the worker confirms; `slot.pending` has one entry per reservation, and
  `slot.routes` the same keys (the routing facts the mask-aware policy prices; `slot.progress`
  the steps done of those already sent).
- A worker that dies fails every pending request of it at once (worker_died, retryable) and, if
  no worker is left accepting, every waiting one (no_worker); nothing waits on a dead worker.
- ServerConfig.request_timeout_s counts from admission: a request still in the server queue at
  its deadline leaves the queue (it is never sent later) and is answered 504 timeout; one sent
  to a worker by then is cancelled there and answered 504 timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from instgenie.messages import EditDone, Progress, SubmitEdit
from instgenie.scheduler.routing import RoutingPolicy
from instgenie.scheduler.views import RouteRequest
from instgenie.server.config import ServerConfig
from instgenie.server.errors import ApiError, from_worker
from instgenie.server.pool import WorkerPool, WorkerSlot
from instgenie.wire import MessageError
from instgenie.worker.client import WorkerError

#: why a request that timed out never started
QUEUED = "it waited in the server queue the whole time: no worker slot came free"


@dataclass
class Ticket:
    uid: str  # the worker request uid (unique in this server process)
    route: RouteRequest
    admitted_at: float = field(default_factory=time.monotonic)
    slot: WorkerSlot | None = None  # set once a slot is reserved
    waiter: asyncio.Future | None = None  # resolved with the slot while queued
    dispatched_at: float = 0.0  # monotonic: sent to the worker
    #: while queued: told its new place (requests ahead of it) each time the queue moves
    on_position: Callable[[int], None] | None = None


@dataclass
class Outcome:
    done: EditDone
    worker: int  # slot index that ran it
    node: str  # the node of that worker (WorkerSlot.node)
    server_queue_ms: float  # admitted -> sent to a worker, ms
    server_total_ms: float  # admitted -> answered, ms


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        policy: RoutingPolicy,
        cfg: ServerConfig,
        ensure: Callable[[WorkerSlot, str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.cfg = cfg
        #: called right before an edit of a template is sent to a worker, so that the worker
        #: knows the template first (TemplateRegistry.ensure); None: nothing to ensure
        self.ensure = ensure
        self.waiting: deque[Ticket] = deque()
        self.draining = False
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(4)

    # ---- admission ------------------------------------------------------------------------------
    def admit(self, route: RouteRequest) -> Ticket:
        """Reserve a worker slot or a queue place; ApiError 503 (draining, no worker) or 429."""
        retry = self.cfg.retry_after_s
        if self.draining:
            raise ApiError(
                503,
                "shutting_down",
                "the server is shutting down (draining); send the request to another instance",
                retry_after_s=retry,
            )
        if not any(s.accepting for s in self.pool.slots):
            raise self._no_worker()
        ticket = Ticket(f"{self._prefix}-{next(self._ids)}", route)
        if not self.waiting:  # FIFO: nobody is ahead of it
            slot = self._route(route)
            if slot is not None:
                self._reserve(ticket, slot)
                return ticket
        if len(self.waiting) >= self.cfg.max_queue:
            raise ApiError(
                429,
                "overloaded",
                f"the server is at capacity: {self.running} "
                f"requests running and {len(self.waiting)} queued (limit "
                f"{self.cfg.max_queue}); retry after {retry} s",
                retry_after_s=retry,
            )
        ticket.waiter = asyncio.get_running_loop().create_future()
        self.waiting.append(ticket)
        return ticket

    @property
    def running(self) -> int:
        return sum(s.in_flight for s in self.pool.slots)

    def _states(self) -> str:
        return ", ".join(f"worker {s.index}: {s.state}" for s in self.pool.slots)

    def _route(self, route: RouteRequest) -> WorkerSlot | None:
        live = [s for s in self.pool.slots if s.accepting]
        # A worker that cannot make progress now (its loop child restarting and reloading the
        # model, a stalled loop, silent) gets requests only while no worker can: its in-flight
        # count just dropped (its requests failed), so by load alone it would be chosen first.
        # Queued here instead, a request goes to the first healthy worker with room.
        now = time.monotonic()
        cfg = self.cfg
        healthy = [s for s in live if s.health(now, cfg.health_timeout_s, cfg.stall_s)[0]]
        # a degraded worker (its loop overruns one stage call) gets nothing new while another
        # can take it: the request waits here for that one rather than behind the overrun
        ok = [s for s in healthy if not s.overrun(cfg.stage_overrun_s)]
        index = self.policy.choose(route, [s.view() for s in ok or healthy or live])
        return next((s for s in self.pool.slots if s.index == index), None)

    def _reserve(self, ticket: Ticket, slot: WorkerSlot) -> None:
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_consume)
        slot.pending[ticket.uid] = fut
        slot.routes[ticket.uid] = ticket.route
        ticket.slot = slot

    def pump(self) -> None:
        """Hand freed slots to queued requests, in arrival order; the ones still queued are
        told their new place."""
        moved = False
        while self.waiting:
            ticket = self.waiting[0]
            if ticket.waiter is None or ticket.waiter.done():  # its client went away
                self.waiting.popleft()
                moved = True
                continue
            slot = self._route(ticket.route)
            if slot is None:
                break
            self.waiting.popleft()
            moved = True
            self._reserve(ticket, slot)
            ticket.waiter.set_result(slot)
        if moved:
            self._tell_positions()

    def _tell_positions(self) -> None:
        for ahead, ticket in enumerate(self.waiting):
            if ticket.on_position is not None:
                ticket.on_position(ahead)

    # ---- running --------------------------------------------------------------------------------
    async def run(
        self, ticket: Ticket, fields: dict, on_progress: Callable[[Progress], None] | None = None
    ) -> Outcome:
        """Send the admitted request to its worker and wait for the result. Cancelling the
        calling task (client disconnect, DELETE) cancels the request on the worker.
        request_timeout_s counts from admission, the server queue wait included: a request
        still queued at its deadline leaves the queue and gets 504 timeout."""
        deadline = ticket.admitted_at + self.cfg.request_timeout_s
        slot = ticket.slot
        if ticket.waiter is not None:
            # asyncio.wait, not wait_for: it never swallows a cancellation that races the slot
            try:
                await asyncio.wait({ticket.waiter}, timeout=max(deadline - time.monotonic(), 0))
                if not ticket.waiter.done():  # still queued at the deadline: leave the queue
                    self.release(ticket)
                    raise self._timeout(QUEUED)
                slot = ticket.waiter.result()  # ApiError no_worker if every worker went away
            except asyncio.CancelledError:
                self.release(ticket)  # out of the queue, or the slot just handed to it freed
                raise
        assert slot is not None
        fut = slot.pending.get(ticket.uid)
        client = slot.client
        if fut is None or client is None or not slot.accepting:
            self._release(slot, ticket.uid)
            raise self._worker_gone(slot, "went away before the request started (retryable: yes)")
        if time.monotonic() >= deadline:  # a slot came at the deadline: too late to start
            self._release(slot, ticket.uid)
            raise self._timeout(QUEUED)
        loop = asyncio.get_running_loop()
        progress = None
        if on_progress is not None:
            progress = lambda p: loop.call_soon_threadsafe(on_progress, p)  # noqa: E731
        msg = SubmitEdit(uid=ticket.uid, submitted_at=time.time(), **fields)
        try:
            if self.ensure is not None and msg.template_id is not None:
                self.ensure(slot, msg.template_id)  # RegisterTemplate, if needed, goes first
            handle = client.submit(msg, on_progress=progress)
        except (RuntimeError, MessageError) as exc:  # closed client; a field of the wrong type
            self._release(slot, ticket.uid)
            raise self._worker_gone(slot, str(exc)) from None
        ticket.dispatched_at = time.monotonic()
        slot.progress[ticket.uid] = handle  # its Progress: the steps it has done (routing)
        handle.future.add_done_callback(
            lambda f: loop.call_soon_threadsafe(self._answered, slot, ticket.uid, f)
        )
        try:
            left = max(deadline - time.monotonic(), 0.0)
            done = await asyncio.wait_for(asyncio.shield(fut), left)
        except asyncio.CancelledError:
            self._cancel(slot, ticket.uid)
            raise
        except TimeoutError:
            self._cancel(slot, ticket.uid)
            raise self._timeout(f"it was sent to worker {slot.index}") from None
        except WorkerError as exc:
            raise from_worker(exc, self.cfg.retry_after_s) from None
        now = time.monotonic()
        return Outcome(
            done,
            slot.index,
            slot.node,
            1e3 * (ticket.dispatched_at - ticket.admitted_at),
            1e3 * (now - ticket.admitted_at),
        )

    def _answered(self, slot: WorkerSlot, uid: str, result: Future) -> None:
        fut = slot.pending.pop(uid, None)
        slot.forget(uid)
        if fut is not None and not fut.done():
            exc = result.exception()
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result.result())
        self.pump()

    def _cancel(self, slot: WorkerSlot, uid: str) -> None:
        """Ask the worker to drop `uid`; its slot frees when the worker confirms."""
        client = slot.client
        if uid in slot.pending and client is not None:
            try:
                client.cancel(uid)
            except RuntimeError:  # the client closed: the worker is gone, worker_down frees it
                pass

    def _release(self, slot: WorkerSlot, uid: str) -> None:
        slot.pending.pop(uid, None)
        slot.forget(uid)
        self.pump()

    def release(self, ticket: Ticket) -> None:
        """Give back an admitted ticket that will not be run."""
        if ticket.waiter is None:
            if ticket.slot is not None:
                self._release(ticket.slot, ticket.uid)
            return
        self._abandon(ticket)
        if not ticket.waiter.done():
            ticket.waiter.cancel()

    def _abandon(self, ticket: Ticket) -> None:
        """The client left while queued (or just after a slot was handed to it)."""
        waiter = ticket.waiter
        if waiter is not None and waiter.done() and not waiter.cancelled():
            if waiter.exception() is None:
                self._release(waiter.result(), ticket.uid)
        elif ticket in self.waiting:
            self.waiting.remove(ticket)
            self._tell_positions()

    # ---- failures and shutdown ------------------------------------------------------------------
    def worker_down(self, slot: WorkerSlot, reason: str) -> None:
        """Fail what `slot` held (its process is gone); fail the queue if no worker is left."""
        pending, slot.pending = slot.pending, {}
        slot.routes.clear()
        slot.progress.clear()
        err = WorkerError("worker_died", f"worker {slot.index} died: {reason}", retryable=True)
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
        if not any(s.accepting for s in self.pool.slots):
            while self.waiting:
                ticket = self.waiting.popleft()
                if ticket.waiter is not None and not ticket.waiter.done():
                    ticket.waiter.set_exception(self._no_worker())
        self.pump()

    def _timeout(self, where: str) -> ApiError:
        return ApiError(
            504,
            "timeout",
            f"the edit did not finish within request_timeout_s = {self.cfg.request_timeout_s:g} s "
            f"of its admission ({where}) and was cancelled",
        )

    def _no_worker(self) -> ApiError:
        why = f"no worker is available ({self._states()}); retry later"
        return ApiError(503, "no_worker", why, retry_after_s=self.cfg.retry_after_s)

    def _worker_gone(self, slot, why: str) -> ApiError:
        msg = f"worker {slot.index}: {why}"
        return ApiError(503, "worker_died", msg, retry_after_s=self.cfg.retry_after_s)

    @property
    def idle(self) -> bool:
        return not self.waiting and self.running == 0


def _consume(fut: asyncio.Future) -> None:
    """Mark a reservation's outcome as retrieved (its awaiting task may have been cancelled)."""
    if not fut.cancelled():
        fut.exception()
