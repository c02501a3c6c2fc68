"""The worker supervisor: wires the worker's parts and routes every message between them.

    client --SubmitEdit--> sup --> pre --Prepared--> sup --> loop --Finished--> sup --> post
    client <--EditDone/EditFailed/Progress-- sup <----------------------------------------'

Every message between processes passes through here (a hub), so the supervisor always knows which
process holds a request; that is what lets it fail exactly the right requests when one dies.
Under `naive-continuous` there are no pre/post processes: SubmitEdit goes straight to the loop.

Its parts, each owning its state:
- `ClientSocket` (client_socket.py): the clients heard from, and replies to them;
- `ChildProcesses` (child_processes.py): spawn, watchdog, death and restart of pre/loop/post;
- `RequestTable` (request_table.py): the requests in flight;
- `TemplateRegistry` (template_registry.py): template builds and the clients waiting for them;
- `WorkQueues` (work_queues.py): work waiting for a process, handed over by `dispatch`;
- `LoopReports` (loop_reports.py): the loop's step log, cache counters and CostSpec.
The supervisor keeps only the worker's lifecycle (`closing`, `fatal`) and the handlers of
messages that involve several parts.

Invariants:
- Every accepted request gets exactly one terminal reply (EditDone or EditFailed), also when the
  process holding it dies (`worker_died`, retryable), stalls, or the worker shuts down.
- Client-facing messages carry the client's uid; the step log shows the internal ids.
- Bundles: a Prepared/Finished that reaches the supervisor is owned by it until forwarded; one
  whose request is gone is released at once. If the process it was forwarded to dies, it is
  released again (idempotent), and the dead process's own shm prefix is cleaned up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

from instgenie.cache.budgets import is_resolved, resolve_cache
from instgenie.config import Config, from_dict
from instgenie.curve import ServerCurve
from instgenie.errors import EXIT_MODEL_LOAD
from instgenie.ipc import Channel, Server, poll
from instgenie.logs import setup_process
from instgenie.messages import (
    Abort,
    Accepted,
    Cancel,
    ChildReady,
    DropTemplate,
    EditDone,
    EditFailed,
    Finished,
    GetStats,
    GetStepLog,
    Heartbeat,
    LoopSteps,
    Prepared,
    Progress,
    RegisterTemplate,
    Shutdown,
    Stage,
    Stats,
    StepLog,
    SubmitEdit,
    TemplateReady,
    WorkerReady,
)
from instgenie.scheduler.batching import get_policy
from instgenie.tensorshm import release
from instgenie.wire import Message
from instgenie.worker.child_processes import Child, ChildProcesses
from instgenie.worker.client_socket import ClientSocket
from instgenie.worker.loop_reports import LoopReports
from instgenie.worker.names import CAPTURE_PREFIX
from instgenie.worker.request_table import Flight, RequestTable
from instgenie.worker.stats import worker_stats
from instgenie.worker.template_registry import TemplateRegistry
from instgenie.worker.work_queues import WorkQueues

log = logging.getLogger("instgenie.worker")

TICK_MS = 20  # longest wait for a message before the watchdog runs again


class Supervisor:
    def __init__(
        self,
        config: Config,
        address: str,
        *,
        allow_remote: bool = False,
        curve: ServerCurve | None = None,
        on_ready: Callable[[WorkerReady], None] | None = None,
    ) -> None:
        if not is_resolved(config.worker):  # `auto` cache settings: from the machine, once
            worker, cache = resolve_cache(config.worker)
            log.info("%s", cache.describe())
            config = dataclasses.replace(config, worker=worker)
        self.config = config  # what every child gets
        self.on_ready = on_ready  # called once, when every child first reports ready
        #: why this worker gave up (a child could not start before the worker was ever ready)
        self.fatal = ""
        self.closing: Shutdown | None = None
        self.started = time.monotonic()
        w = config.worker
        self.clients = ClientSocket(address, allow_remote=allow_remote, curve=curve)
        self.address = self.clients.address
        self.children = ChildProcesses(
            config, inline=get_policy(w.policy).inline_stages, may_restart=self._may_restart,
            on_death=self.child_died, on_fatal=self.give_up,
        )  # fmt: skip
        self.requests = RequestTable(w)
        self.templates = TemplateRegistry(w, self.clients.reply)
        self.loop_reports = LoopReports(w)
        self.work = WorkQueues(self.children, self.requests, self.templates, self.clients.reply)

    # ---- main loop ------------------------------------------------------------------------------
    def run(self) -> int:
        self._trap_signals()
        try:
            while not self._finished():
                for ep in poll([self.clients.server, self.children.inbox], TICK_MS):
                    self._drain(ep)
                self.children.watch()
                self.work.dispatch()
        finally:
            self.close()
        return EXIT_MODEL_LOAD if self.fatal else 0

    def _drain(self, ep: Server | Channel) -> None:
        for _ in range(1000):  # bounded: the other socket and the watchdog go on
            got = ep.recv(0)
            if got is None:
                return
            if ep is self.clients.server:
                self.on_client(*got)
            else:
                self.on_child(got)

    def _finished(self) -> bool:
        return self.closing is not None and not len(self.requests) and not self.templates.building()

    def _may_restart(self) -> bool:
        return self.closing is None or self.closing.drain

    def give_up(self, why: str) -> None:
        """Stop for good: a child cannot start (its model, device, dtype or profile fails to
        load) and never has in this worker's life, so restarting it would only loop."""
        if self.fatal:
            return  # another child said it first
        log.error("worker cannot start: %s", why)
        self.fatal = why
        self.closing = Shutdown(drain=False)
        self._fail_everything("worker_died", f"the worker cannot start: {why}")

    def _trap_signals(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.closing is None:
            log.warning("signal %d: draining, then exiting", signum)
            self.closing = Shutdown(drain=True)
        elif signum == signal.SIGINT:  # a second Ctrl-C: stop now
            self.closing = Shutdown(drain=False)
            self._fail_everything("shutting_down", "the worker is shutting down")

    def _fail_everything(self, code: str, why: str) -> None:
        for flight in self.requests.all():
            if flight.holder is not None:
                self.children.send(flight.holder, Abort(uid=flight.uid, reason=code))
            self.finish(flight, EditFailed(uid=flight.uid, code=code, message=why, retryable=True))
        self.work.clear_queue()
        self.templates.fail_building(why)

    def close(self) -> None:
        self.work.release_all()
        self.children.close()
        self.clients.close()

    def stats(self) -> dict[str, float]:
        return worker_stats(self)

    def resident(self, template_id: str) -> bool:
        """The template's cache is held by this worker's stores, as the loop last reported
        (True until the loop has reported: nothing is known to be gone)."""
        if not self.loop_reports.residency_known:
            return True
        return template_id in self.loop_reports.residency

    def residency(self) -> dict[str, dict[str, int]]:
        """Stats.residency: the loop's last report, of the templates still registered here (a
        drop answered before the loop's next report is not listed)."""
        known = self.loop_reports.residency
        return {t: tiers for t, tiers in known.items() if self.templates.get(t) is not None}

    # ---- client messages ------------------------------------------------------------------------
    def on_client(self, identity: bytes, msg: Message) -> None:
        self.clients.heard(identity)
        if isinstance(msg, SubmitEdit):
            self.submit(identity, msg)
        elif isinstance(msg, RegisterTemplate):
            if self.templates.register(identity, msg, closing=self.closing is not None,
                                       resident=self.resident):  # fmt: skip
                for c in self.children.stage_children():  # every pre process learns it
                    if c.ready:
                        self.children.send(c, msg)
        elif isinstance(msg, Cancel):
            self.cancel(identity, msg.uid)
        elif isinstance(msg, DropTemplate):
            self.drop_template(msg.template_id)
        elif isinstance(msg, GetStats):
            cost = self.loop_reports.cost_spec if msg.cost else None
            stats = Stats(counters=self.stats(), cost=cost, residency=self.residency())
            self.clients.answer(identity, stats)
        elif isinstance(msg, GetStepLog):
            self.clients.answer(identity, StepLog(entries=self.loop_reports.since(msg.since_step)))
        elif isinstance(msg, Shutdown):
            log.warning("shutdown requested (drain=%s)", msg.drain)
            self.closing = msg
            if not msg.drain:
                self._fail_everything("shutting_down", "the worker is shutting down")

    def submit(self, identity: bytes, msg: SubmitEdit) -> None:
        refusal = (
            ("shutting_down", "the worker is shutting down", True)
            if self.closing is not None
            else self.requests.refusal(identity, msg)
        )
        if refusal is not None:
            code, why, retryable = refusal
            self.requests.rejected()
            fail = EditFailed(uid=msg.uid, code=code, message=why, retryable=retryable)
            self.clients.reply(identity, fail)
            return
        flight = self.requests.accept(identity, msg)
        position = self.work.queue(flight.uid)
        self.clients.reply(identity, Accepted(uid=msg.uid, queue_position=position))

    def drop_template(self, tid: str) -> None:
        """Forget `tid` everywhere; its cache is deleted by the loop (once no edit reads it)."""
        if not self.templates.drop(tid):
            return
        self.work.drop_capture(tid)
        for c in self.children.all:  # the loop and the pre processes know templates
            if c.ready and c.role != "post":
                self.children.send(c, DropTemplate(template_id=tid))

    def cancel(self, identity: bytes, client_uid: str) -> None:
        flight = self.requests.of_client(identity, client_uid)
        if flight is None:  # finished, failed or never seen: answer anyway, in case a terminal
            # reply was lost (the client ignores replies for uids it no longer holds)
            why = "not in flight (finished or unknown)"
            msg = EditFailed(uid=client_uid, code="cancelled", message=why, retryable=False)
            self.clients.reply(identity, msg)
            return
        if flight.stage == "queued":
            self.work.unqueue(flight.uid)
        elif flight.holder is not None:
            self.children.send(flight.holder, Abort(uid=flight.uid, reason="cancelled"))
        self.requests.cancelled()
        why = "cancelled by the client"
        self.finish(flight, EditFailed(uid=flight.uid, code="cancelled", message=why,
                                       retryable=False))  # fmt: skip

    def finish(self, flight: Flight, msg: EditDone | EditFailed) -> None:
        """The terminal reply; forget the request."""
        reply = self.requests.close(flight, msg)
        if flight.bundle is not None and flight.holder is None:  # in a backlog here: ours
            self.work.drop(flight.uid)
        self.clients.reply(flight.identity, reply)

    # ---- child messages -------------------------------------------------------------------------
    def on_child(self, msg: Message) -> None:
        if isinstance(msg, Heartbeat):
            self.children.beat(msg)
        elif isinstance(msg, ChildReady):
            self.child_ready(msg)
        elif isinstance(msg, Prepared):
            self.on_prepared(msg)
        elif isinstance(msg, Finished):
            self.on_finished(msg)
        elif isinstance(msg, (EditDone, EditFailed)):
            flight = self.requests.get(msg.uid)
            if flight is not None:
                self.finish(flight, msg)
        elif isinstance(msg, Progress):
            flight = self.requests.get(msg.uid)
            if flight is not None:
                self.clients.reply(flight.identity, dataclasses.replace(msg, uid=flight.client_uid))
        elif isinstance(msg, TemplateReady):
            self.templates.done(msg.template_id, msg.ok, msg.message, msg.bytes_by_tier,
                                msg.retryable)  # fmt: skip
            if msg.ok:
                self.loop_reports.template_ready(msg.template_id, msg.bytes_by_tier)
        elif isinstance(msg, LoopSteps):
            self.loop_reports.add(msg)

    def child_ready(self, msg: ChildReady) -> None:
        c = self.children.mark_ready(msg)
        if c is None:
            return
        self.loop_reports.cost_reported(msg.cost)
        if c.role == "pre" or self.children.inline:  # it must know every template before any edit
            for t in self.templates.all():
                self.children.send(c, t.msg)
        if c.role == "loop":
            self.templates.rebuild()
        if self.children.first_ready():
            ready = WorkerReady(pid=os.getpid(), model=self.config.model.model,
                                device=self.config.model.device)  # fmt: skip
            self.clients.broadcast(ready)
            if self.on_ready is not None:
                self.on_ready(ready)

    def child_died(self, c: Child, reason: str, held: list[str]) -> None:
        """`c` was reaped (ChildProcesses.died): fail what it held; a capture is tried again."""
        if c.role == "loop":
            self.loop_reports.loop_died()
        why = f"worker process {c.name} died ({reason}); the request may be retried"
        for uid in held:
            if uid.startswith(CAPTURE_PREFIX):
                self.templates.capture_lost(uid[len(CAPTURE_PREFIX) :], why)
                continue
            flight = self.requests.get(uid)
            if flight is not None:
                if flight.bundle is not None:
                    release(flight.bundle)
                self.finish(flight, EditFailed(uid=uid, code="worker_died", message=why,
                                               retryable=True))  # fmt: skip

    def on_prepared(self, msg: Prepared) -> None:
        if msg.uid.startswith(CAPTURE_PREFIX):
            t = self.templates.get(msg.uid[len(CAPTURE_PREFIX) :])
            if t is None or not t.prepared(msg):
                release(msg.state)
                return
        else:
            flight = self.requests.get(msg.uid)
            if flight is None:  # cancelled meanwhile
                release(msg.state)
                return
            flight.prepared(msg)
        self.work.to_loop(msg)

    def on_finished(self, msg: Finished) -> None:
        flight = self.requests.get(msg.uid)
        if flight is None:
            release(msg.latents)
            return
        flight.finished(msg)
        self.work.to_post(msg)
        self.clients.reply(flight.identity, flight.progress(Stage.POSTPROCESS))


def main(argv: list[str] | None = None) -> int:
    """python -m instgenie.worker.lifeline supervisor '<json>': {"address", "config",
    "die_with_parent", "parent", "curve_stdin"} (lifeline arms the parent-death signal before
    the imports). With "curve_stdin", the socket's curve keys (ServerCurve.to_dict JSON) are
    read from stdin, a pipe from the spawner, to its end: secrets never travel in argv (readable
    by every user in /proc/<pid>/cmdline) nor in the environment."""
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    setup_process("sup")
    curve = ServerCurve.from_dict(json.loads(sys.stdin.read())) if spec.get("curve_stdin") else None
    sup = Supervisor(from_dict(Config, spec["config"]), spec["address"],
                     allow_remote=curve is not None, curve=curve)  # fmt: skip
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
