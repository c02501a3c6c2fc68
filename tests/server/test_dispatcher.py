"""The server's dispatcher (admission, server queue, request timeout) against a fake worker: a
real WorkerSlot whose client records what it is sent and answers only when the test says so.
No processes, no model: each test runs its own event loop for about a second.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from instgenie.config import Config, LimitsConfig
from instgenie.messages import EditDone, Path, Stats
from instgenie.scheduler.routing import LeastLoaded, RouteRequest
from instgenie.server.config import ServerConfig
from instgenie.server.dispatcher import Dispatcher
from instgenie.server.errors import ApiError
from instgenie.server.pool import WorkerSlot
from instgenie.worker.client import WorkerError

ROUTE = RouteRequest(template_id=None, num_steps=2, pixels=64 * 64)
FIELDS = dict(image=b"img", mask=b"mask", prompt="a cat", seed=0)
#: how much later than its deadline a 504 may arrive (event loop wake-up on a loaded machine)
MARGIN_S = 0.3
#: a guard around each awaited run, so a request that is never answered fails the test
#: instead of hanging it
HANG_S = 5.0


class FakeClient:
    """A worker that accepts everything and answers nothing until the test does."""

    def __init__(self) -> None:
        self.submitted: dict[str, Future] = {}  # uid -> the handle's future, in order
        self.handles: dict[str, SimpleNamespace] = {}  # uid -> the handle (its progress list)
        self.cancelled: list[str] = []

    def submit(self, msg, on_progress=None):
        handle = SimpleNamespace(uid=msg.uid, future=Future(), progress=[], num_steps=None)
        self.submitted[msg.uid] = handle.future
        self.handles[msg.uid] = handle
        return handle

    def cancel(self, uid: str) -> None:
        self.cancelled.append(uid)


def _dispatcher(slots: int, timeout_s: float, max_queue: int = 4):
    client = FakeClient()
    slot = WorkerSlot(0, Config(), slots, state="up")
    proc = SimpleNamespace(poll=lambda: None)  # a live supervisor process
    slot.handle = SimpleNamespace(proc=proc, client=client, pid=1, address="ipc://fake")
    pool = SimpleNamespace(slots=[slot])
    cfg = ServerConfig(request_timeout_s=timeout_s, max_queue=max_queue)
    return Dispatcher(pool, LeastLoaded(), cfg), slot, client


def _done(uid: str) -> EditDone:
    return EditDone(uid=uid, data=b"out", output_format="png", width=64, height=64,
                    mask_ratio=0.5, num_steps=2, path=Path.FULL)  # fmt: skip


async def _timed_run(d: Dispatcher, ticket) -> tuple[BaseException | None, float]:
    """(the exception `run` ended with, seconds from admission to the answer)."""
    try:
        await asyncio.wait_for(d.run(ticket, FIELDS), HANG_S)
    except TimeoutError:
        pytest.fail(f"request {ticket.uid} got no answer within {HANG_S} s (it hangs)")
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc, time.monotonic() - ticket.admitted_at
    return None, time.monotonic() - ticket.admitted_at


def _assert_timeout(exc: BaseException | None, took: float, timeout_s: float) -> None:
    assert isinstance(exc, ApiError), exc
    assert (exc.status_code, exc.code) == (504, "timeout")
    assert timeout_s - 0.05 <= took <= timeout_s + MARGIN_S, took
    assert "request_timeout_s" in exc.message


def test_a_request_no_worker_slot_can_take_gets_504_timeout_and_leaves_the_queue() -> None:
    """A worker with no slot (what --max-batch 0 made: 2 x 0 slots) never takes the request:
    it must still be answered 504 timeout within request_timeout_s, and leave the queue."""

    async def main() -> None:
        d, slot, client = _dispatcher(slots=0, timeout_s=0.5)
        ticket = d.admit(ROUTE)
        assert ticket.waiter is not None and list(d.waiting) == [ticket]  # queued
        exc, took = await _timed_run(d, ticket)
        _assert_timeout(exc, took, 0.5)
        assert "server queue" in exc.message
        assert not d.waiting and d.idle  # queue depth back to 0; drain would not wait on it
        assert client.submitted == {} and slot.pending == {}

    asyncio.run(main())


def test_a_queued_request_that_timed_out_is_never_sent_later() -> None:
    """One slot, held by A (its worker never answers); B waits in the server queue. Both get
    504 at their deadline; when the worker later confirms A's cancellation, the freed slot is
    not handed to B (already answered) but to the next request."""

    async def main() -> None:
        d, slot, client = _dispatcher(slots=1, timeout_s=0.5)
        a, b = d.admit(ROUTE), d.admit(ROUTE)
        assert a.waiter is None and a.slot is slot and list(d.waiting) == [b]
        (exc_a, took_a), (exc_b, took_b) = await asyncio.gather(_timed_run(d, a), _timed_run(d, b))
        _assert_timeout(exc_a, took_a, 0.5)
        _assert_timeout(exc_b, took_b, 0.5)
        assert "server queue" in exc_b.message and "worker 0" in exc_a.message
        assert not d.waiting
        assert list(client.submitted) == [a.uid] and client.cancelled == [a.uid]
        assert slot.in_flight == 1  # A's slot stays reserved until the worker confirms
        client.submitted[a.uid].set_exception(WorkerError("cancelled", "cancelled"))
        await asyncio.sleep(0.05)  # the answer reaches the event loop (call_soon_threadsafe)
        assert slot.in_flight == 0 and list(client.submitted) == [a.uid]  # B was not sent
        c = d.admit(ROUTE)
        assert c.waiter is None and c.slot is slot  # the slot is free for new work

    asyncio.run(main())


def test_the_request_timeout_counts_from_admission_queue_wait_included() -> None:
    """B waits 0.6 s in the server queue, then is sent to a worker that never answers: its 504
    comes at 1 s from admission (request_timeout_s), not 1 s after it was sent."""

    async def main() -> None:
        d, slot, client = _dispatcher(slots=1, timeout_s=1.0)
        a, b = d.admit(ROUTE), d.admit(ROUTE)
        run_a = asyncio.create_task(d.run(a, FIELDS))
        run_b = asyncio.create_task(_timed_run(d, b))
        await asyncio.sleep(0.6)
        client.submitted[a.uid].set_result(_done(a.uid))  # A finishes: its slot goes to B
        outcome = await run_a
        assert outcome.done.uid == a.uid
        exc_b, took_b = await run_b
        assert list(client.submitted) == [a.uid, b.uid]  # B did run on the worker
        _assert_timeout(exc_b, took_b, 1.0)
        assert "worker 0" in exc_b.message
        assert client.cancelled == [b.uid]  # and was cancelled there

    asyncio.run(main())


def test_a_client_leaving_while_queued_frees_its_place() -> None:
    """Cancelling the run of a queued request (client disconnect, DELETE) takes it out of the
    queue at once; the slot freed later is not handed to it."""

    async def main() -> None:
        d, slot, client = _dispatcher(slots=1, timeout_s=30.0)
        a, b = d.admit(ROUTE), d.admit(ROUTE)
        run_a = asyncio.create_task(d.run(a, FIELDS))
        run_b = asyncio.create_task(d.run(b, FIELDS))
        await asyncio.sleep(0.05)
        run_b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run_b
        assert not d.waiting and b.waiter.cancelled()
        client.submitted[a.uid].set_result(_done(a.uid))
        assert (await run_a).done.uid == a.uid
        await asyncio.sleep(0.05)
        assert list(client.submitted) == [a.uid] and slot.in_flight == 0 and d.idle

    asyncio.run(main())


def test_a_queue_timeout_is_counted_and_the_queue_gauge_returns_to_zero() -> None:
    """Through Runtime (the HTTP routes' path): the 504 is counted in
    instgenie_edit_failures_total{code="timeout"} and instgenie_queue_depth reads 0 after."""
    from instgenie.server.runtime import EditSpec, Runtime

    async def main() -> None:
        d, slot, _ = _dispatcher(slots=0, timeout_s=0.3)
        rt = Runtime(d.pool, d.cfg, LimitsConfig())
        spec = EditSpec(dict(FIELDS), ROUTE, None, 0)
        ticket = rt.admit(spec)
        assert "instgenie_queue_depth 1.0" in rt.metrics.render().decode()
        with pytest.raises(ApiError) as info:
            await asyncio.wait_for(rt.execute(ticket, spec), HANG_S)
        assert info.value.code == "timeout"
        text = rt.metrics.render().decode()
        assert 'instgenie_edit_failures_total{code="timeout"} 1.0' in text
        assert "instgenie_queue_depth 0.0" in text
        rt.health._executor.shutdown()

    asyncio.run(main())


def _pool_of_two():
    """Two fake workers; the test sets what each one's last stats answer said."""
    slots = []
    for i in range(2):
        slot = WorkerSlot(i, Config(), 8, state="up")
        proc = SimpleNamespace(poll=lambda: None)
        slot.handle = SimpleNamespace(proc=proc, client=FakeClient(), pid=1, address=f"ipc://{i}")
        slots.append(slot)
    return Dispatcher(SimpleNamespace(slots=slots), LeastLoaded(), ServerConfig()), slots


def test_routing_avoids_a_worker_that_cannot_make_progress() -> None:
    """Worker 0's loop is restarting (its requests just failed: in_flight 0), worker 1 is
    healthy and busy: new requests go to worker 1 (before: all to worker 0, by load). Once
    worker 0 is healthy again it gets them; with no healthy worker, any live one does."""

    async def scenario() -> None:
        d, (w0, w1) = _pool_of_two()
        now = time.monotonic()
        w0.observe({"ready": 0.0, "in_loop": 0.0}, now)  # (re)starting its processes
        w1.observe({"ready": 1.0, "in_loop": 3.0, "steps_total": 10.0}, now)
        assert [d.admit(ROUTE).slot.index for _ in range(5)] == [1] * 5
        w0.observe({"ready": 1.0, "in_loop": 0.0, "steps_total": 0.0}, now)
        assert d.admit(ROUTE).slot.index == 0
        # a stalled loop: it holds requests and its step counter has not moved for stall_s
        w0.observe({"ready": 1.0, "in_loop": 1.0, "steps_total": 5.0}, now)
        w0.steps_moved_at = now - 2 * d.cfg.stall_s
        w1.pending.clear()
        assert d.admit(ROUTE).slot.index == 1
        w1.observe({"ready": 0.0}, now)  # both unhealthy: the least loaded live worker
        w0.pending.clear()
        assert d.admit(ROUTE).slot.index == 0

    asyncio.run(scenario())


def test_the_routing_view_carries_each_held_requests_progress() -> None:
    """The mask-aware policy prices what a worker holds by the steps each request has left:
    the worker's view lists reserved and sent requests with the steps their Progress reported,
    and forgets them once answered."""

    async def main() -> None:
        d, slot, client = _dispatcher(slots=2, timeout_s=5)
        tickets = [d.admit(ROUTE), d.admit(ROUTE)]
        assert [r.steps_done for r in slot.view().requests] == [0, 0]  # reserved, not sent
        runs = [asyncio.create_task(d.run(t, FIELDS)) for t in tickets]
        while len(client.submitted) < 2:
            await asyncio.sleep(0.01)
        first, second = (client.handles[t.uid] for t in tickets)
        first.progress.extend([1, 2])  # what the client thread appends as Progress arrives
        second.num_steps = 1  # strength < 1: it runs 1 of its 2 steps
        second.progress.append(1)
        held = slot.view().requests
        assert [(r.steps_done, r.num_steps) for r in held] == [(2, 2), (1, 1)]
        first.future.set_result(_done(tickets[0].uid))
        await asyncio.wait_for(runs[0], HANG_S)
        assert [r.steps_done for r in slot.view().requests] == [1]
        second.future.set_result(_done(tickets[1].uid))
        await asyncio.wait_for(runs[1], HANG_S)
        assert slot.view().requests == () and slot.routes == {} and slot.progress == {}

    asyncio.run(main())


def test_a_queued_request_moves_when_a_worker_turns_healthy() -> None:
    """Worker 0 is restarting, worker 1 healthy and full: the request waits in the server queue.
    When the health poll sees worker 0 healthy again the queue is pumped at once (before: it
    waited for some request to finish, however long that took)."""
    from instgenie.server.health import HealthMonitor
    from instgenie.server.metrics import Metrics

    async def scenario() -> None:
        d, (w0, w1) = _pool_of_two()
        now = time.monotonic()
        w0.observe({"ready": 0.0, "in_loop": 0.0}, now)
        w1.observe({"ready": 1.0, "in_loop": 0.0}, now)
        held = [d.admit(ROUTE) for _ in range(w1.slots)]  # worker 1 full
        assert {t.slot.index for t in held} == {1}
        queued = d.admit(ROUTE)
        assert queued.waiter is not None and not queued.waiter.done()
        answer = Stats(counters={"ready": 1.0, "in_loop": 0.0})
        w0.handle.client.report = lambda timeout=None: answer
        monitor = HealthMonitor(d.pool, d.cfg, Metrics(), lambda s, r: None, lambda s: d.pump())
        await monitor._poll(w0)
        assert queued.waiter.done() and queued.waiter.result() is w0

    asyncio.run(scenario())


def test_queued_requests_are_told_their_place_as_the_queue_moves() -> None:
    """One slot, held by A; B, C and D queue. Each move of the queue (A answered, C's client
    gone) tells the ones still queued how many are ahead of them."""

    async def main() -> None:
        d, slot, client = _dispatcher(slots=1, timeout_s=30)
        a = d.admit(ROUTE)
        queued = [d.admit(ROUTE) for _ in range(3)]
        told: dict[str, list[int]] = {t.uid: [] for t in queued}
        for t in queued:
            t.on_position = told[t.uid].append
        b, c, e = queued
        run_a = asyncio.ensure_future(d.run(a, FIELDS))
        await asyncio.sleep(0)
        client.submitted[a.uid].set_result(_done(a.uid))  # A answered: B takes the slot
        await run_a
        await asyncio.sleep(0.01)
        assert b.slot is slot and list(d.waiting) == [c, e]
        assert told == {b.uid: [], c.uid: [0], e.uid: [1]}
        d.release(c)  # C's client left while queued
        assert list(d.waiting) == [e] and told[e.uid] == [1, 0]

    asyncio.run(main())


@pytest.mark.parametrize("margin", [0, 8])
def test_the_router_measures_masks_dilated_by_the_workers_compute_margin(margin: int) -> None:
    """Mask-aware routing prices the tokens a worker computes: with a compute margin (decision
    0050, sent in its CostSpec) the measured token ratios are those of the dilated mask."""
    import dataclasses

    import numpy as np
    from PIL import Image

    from instgenie.engine.imageio import encode_image
    from instgenie.scheduler.estimate import token_ratios
    from instgenie.server.runtime import EditSpec, Runtime
    from tests.scheduler.test_routing_cost import SPEC

    mask = np.zeros((128, 96), dtype=bool)
    mask[40:60, 30:50] = True
    data = encode_image(Image.fromarray(mask.astype(np.uint8) * 255), "png")

    async def main() -> None:
        d, slot, _ = _dispatcher(slots=1, timeout_s=1.0)
        slot.cost = dataclasses.replace(SPEC, compute_margin=margin)
        rt = Runtime(d.pool, ServerConfig(routing="mask-aware"), LimitsConfig())
        spec = EditSpec(dict(FIELDS, mask=data), ROUTE, None, 0, (96, 128), (96, 128))
        await rt.measure_mask([spec])
        rt.health._executor.shutdown()
        return spec.route

    route = asyncio.run(main())
    assert dict(route.token_ratios) == token_ratios(mask, [16, 32], margin)
    plain = token_ratios(mask, [16, 32])
    assert (dict(route.token_ratios)[16] > plain[16]) == (margin > 0)
    assert route.mask_ratio == pytest.approx(mask.mean())  # the edit's own pixels, undilated
