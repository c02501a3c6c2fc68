"""The supervisor's parts on their own, without processes: a child's watchdog verdicts, the request
table's ids and refusals, the template registry's retries. (The worker end to end, with real
processes dying and stalling: test_worker.py, test_worker_failures.py.)"""

from __future__ import annotations

from instgenie.config import WorkerConfig
from instgenie.messages import EditFailed, Heartbeat, RegisterTemplate, SubmitEdit
from instgenie.wire import Message
from instgenie.worker.child_processes import Child
from instgenie.worker.request_table import RequestTable
from instgenie.worker.template_registry import TemplateRegistry
from instgenie.worker.watchdog import Watchdog

W = WorkerConfig(start_timeout_s=60.0, heartbeat_timeout_s=10.0, stall_timeout_s=30.0,
                 stage_timeout_s=100.0, max_queue=2, max_template_attempts=2)  # fmt: skip


def _beat(iterations: int, in_flight: list[str], t: float, busy_since: float = 0.0) -> Heartbeat:
    busy = "decode" if busy_since else ""
    return Heartbeat(pid=1, loop_iterations=iterations, in_flight=in_flight, time=t, busy=busy,
                     busy_since=busy_since)  # fmt: skip


def test_watchdog_tells_slow_stage_calls_from_stalls() -> None:
    d = Watchdog(W)
    d.started(0.0)
    assert d.verdict(False, 59.0) == "" and d.verdict(False, 61.0) == "not ready after 60 s"
    d.ready(1.0)
    d.beat(_beat(5, ["a"], 1.0), 1.0)
    d.beat(_beat(5, ["a"], 20.0, busy_since=2.0), 20.0)  # in a decode for 18 s: progress
    assert (d.busy_s, d.busy_stage, d.running) == (18.0, "decode", 1)
    d.beat(_beat(5, ["a"], 44.0, busy_since=2.0), 44.0)  # still in it (under 100 s): progress
    assert d.verdict(True, 45.0) == ""  # no iteration for 44 s, yet busy, not stalled
    d.beat(_beat(5, ["a"], 110.0, busy_since=2.0), 110.0)  # 108 s: stuck, not busy
    assert d.busy_s == 0.0 and d.busy_stage == ""
    assert d.verdict(True, 110.0) == "no progress for 66.0 s"
    assert d.verdict(True, 121.0) == "no heartbeat for 11.0 s"
    d.beat(_beat(5, [], 121.0), 121.0)  # holding nothing is progress
    assert d.verdict(True, 121.0) == ""


def _submit(uid: str) -> SubmitEdit:
    return SubmitEdit(uid=uid, image=None, mask=b"m", prompt="p", seed=0)


def test_request_table_names_requests_uniquely_and_refuses_duplicates() -> None:
    table = RequestTable(W)
    first = table.accept(b"c1", _submit("x"))
    assert first.uid == "1:x" and first.msg.uid == "1:x"
    assert table.refusal(b"c1", _submit("x"))[0] == "invalid_request"
    assert table.refusal(b"c2", _submit("x")) is None  # another client's uid
    assert table.refusal(b"c1", _submit("")) is not None
    table.accept(b"c2", _submit("x"))
    assert table.refusal(b"c3", _submit("y")) == ("overloaded", "the worker holds 2 requests", True)
    loop = Child("loop", 0, Watchdog(W))
    first.sent(loop, "loop")
    assert loop.holding == {"1:x"} and table.stages()["loop"] == 1
    failed = EditFailed(uid="1:x", code="internal_error", message="m", retryable=False)
    assert table.close(first, failed).uid == "x" and not loop.holding  # the client's uid
    assert table.of_client(b"c1", "x") is None and len(table) == 1
    again = table.accept(b"c1", _submit("x"))  # the uid is free again: a new internal id
    assert again.uid == "3:x"
    assert table.counters["requests_accepted"] == 3 and table.counters["requests_failed"] == 1


def test_a_lost_capture_is_retried_then_fails_its_waiters() -> None:
    replies: list[tuple[bytes, Message]] = []
    registry = TemplateRegistry(W, lambda identity, msg: replies.append((identity, msg)))
    tid = "ab" * 32
    msg = RegisterTemplate(template_id=tid, image=b"i", prompt="p", seed=0)
    assert registry.register(b"c1", msg, closing=False)  # a new build
    assert not registry.register(b"c2", msg, closing=False)  # waits for the same build
    assert not registry.register(b"c3", RegisterTemplate(template_id="x", image=b"", prompt="",
                                                         seed=0), closing=False)  # fmt: skip
    assert replies.pop()[1].ok is False
    pre = Child("pre", 0, Watchdog(W))
    for attempt in (1, 2):
        (t,) = registry.queued()
        t.build_on(pre)
        assert t.attempts == attempt and pre.holding == {f"template:{tid}"}
        pre.holding.clear()  # the process died (ChildProcesses.died)
        registry.capture_lost(tid, "pre0 died")
    assert registry.queued() == [] and registry.states()["failed"] == 1
    assert [(i, r.ok) for i, r in replies] == [(b"c1", False), (b"c2", False)]
    assert replies[0][1].message == "pre0 died; gave up after 2 attempts"
