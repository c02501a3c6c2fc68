"""The worker supervisor: the client socket, request routing, the children and their watchdog.

    client --SubmitEdit--> sup --> pre --Prepared--> sup --> loop --Finished--> sup --> post
    client <--EditDone/EditFailed/Progress-- sup <----------------------------------------'

Every message between processes passes through here (a hub), so the supervisor always knows which
process holds a request; that is what lets it fail exactly the right requests when one dies.
Under `naive-continuous` there are no pre/post processes: SubmitEdit goes straight to the loop.

Invariants:
- Every accepted request gets exactly one terminal reply (EditDone or EditFailed), also when the
  process holding it dies (`worker_died`, retryable), stalls, or the worker shuts down.
- Request ids inside the worker are `<seq>:<client uid>` (unique for the worker's life), so a
  late message of a cancelled request never reaches a newer request that reuses the client uid.
  Client-facing messages carry the client's uid; the step log shows the internal ids.
- Bundles: a Prepared/Finished that reaches the supervisor is owned by it until forwarded; one
  whose request is gone is released at once. If the process it was forwarded to dies, it is
  released again (idempotent), and the dead process's own shm prefix is cleaned up.
- Children are restarted after `restart_backoff_s`; templates are rebuilt after a loop restart
  (the loop's device cache died with it; a host cache answers at once).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable

from instgenie.cache.budgets import is_resolved, resolve_cache
from instgenie.config import Config, from_dict
from instgenie.errors import EXIT_MODEL_LOAD
from instgenie.ipc import Channel, Server, ipc_address, poll
from instgenie.logs import setup_process
from instgenie.messages import (
    Abort,
    Accepted,
    Cancel,
    ChildReady,
    ClientToWorker,
    CostSpec,
    DropTemplate,
    EditDone,
    EditFailed,
    Finished,
    GetStats,
    GetStepLog,
    Heartbeat,
    LoopSteps,
    Message,
    Prepared,
    Progress,
    RegisterTemplate,
    Shutdown,
    Stage,
    Stats,
    StepEntry,
    StepLog,
    StopProcess,
    SubmitEdit,
    TemplateReady,
    WorkerReady,
)
from instgenie.scheduler.batching import get_policy
from instgenie.tensorshm import cleanup, release
from instgenie.worker.children import Child, ChildProcesses, Flight, Template
from instgenie.worker.names import CAPTURE_PREFIX, capture_uid, shm_base
from instgenie.worker.stats import worker_stats

log = logging.getLogger("instgenie.worker")

TICK_MS = 20  # longest wait for a message before the watchdog runs again
MAX_UID_CHARS = 256
MAX_CLIENTS = 10_000  # identities remembered for WorkerReady broadcasts
_TEMPLATE_ID = re.compile(r"[0-9a-f]{64}")


class Supervisor(ChildProcesses):
    def __init__(
        self,
        config: Config,
        address: str,
        *,
        allow_remote: bool = False,
        on_ready: Callable[[WorkerReady], None] | None = None,
    ) -> None:
        if not is_resolved(config.worker):  # `auto` cache settings: from the machine, once
            worker, cache = resolve_cache(config.worker)
            log.info("%s", cache.describe())
            config = dataclasses.replace(config, worker=worker)
        self.config = config  # what every child gets
        self.on_ready = on_ready  # called once, when every child first reports ready
        self.w = config.worker
        self.inline = get_policy(self.w.policy).inline_stages
        self.server = Server(address, allow_remote=allow_remote, accept=ClientToWorker,
                             name="worker")  # fmt: skip
        self.address = self.server.address
        self.inbox = Channel.pull(ipc_address("sup"), accept=Message, name="sup in")
        self.shm_base = shm_base(os.getpid())
        cleanup(self.shm_base)
        self.children = [Child("loop", 0)]
        if not self.inline:
            self.children += [Child("pre", i) for i in range(self.w.num_pre)]
            self.children += [Child("post", i) for i in range(self.w.num_post)]
        self.by_pid: dict[int, Child] = {}
        self.flights: dict[str, Flight] = {}
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.queue: deque[str] = deque()  # flights waiting for a pre process (or the loop)
        self.to_loop: deque[Message] = deque()  # Prepared waiting for the loop to be ready
        self.to_post: deque[Finished] = deque()
        self.templates: dict[str, Template] = {}
        self.steps: deque[StepEntry] = deque(maxlen=self.w.step_log_size)
        self.step_offset = 0  # steps of previous loop incarnations
        self.loop_steps = 0  # steps of the current incarnation
        self.clients: dict[bytes, None] = {}
        self.was_ready = False
        #: the loop's CostSpec (ChildReady; the latest loop's, kept across its restarts)
        self.cost_spec: CostSpec | None = None
        #: why this worker gave up (a child could not start before the worker was ever ready)
        self.fatal = ""
        self.closing: Shutdown | None = None
        self.seq = 0
        self.started = time.monotonic()
        self.counters = dict.fromkeys(
            "requests_accepted requests_done requests_failed requests_cancelled "
            "requests_rejected templates_registered templates_dropped child_deaths".split(),
            0,
        )
        self.latency: deque[tuple[float, float]] = deque(maxlen=2048)  # (total_ms, queue_ms)
        self.bytes_loaded = 0  # cached activations copied in by denoise steps, bytes
        self.cache_stats: dict[str, float] = {}  # the loop's host-cache counters (LoopSteps)

    # ---- main loop ------------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            while not self._finished():
                for ep in poll([self.server, self.inbox], TICK_MS):
                    for _ in range(1000):  # bounded: the other socket and the watchdog go on
                        got = ep.recv(0)
                        if got is None:
                            break
                        if ep is self.server:
                            self.on_client(*got)
                        else:
                            self.on_child(got)
                self.watchdog()
                self.dispatch()
        finally:
            self.close()
        return EXIT_MODEL_LOAD if self.fatal else 0

    def give_up(self, why: str) -> None:
        """Stop for good: a child cannot start (its model, device, dtype or profile fails to
        load) and never has in this worker's life, so restarting it would only loop."""
        if self.fatal:
            return  # another child said it first
        log.error("worker cannot start: %s", why)
        self.fatal = why
        self.closing = Shutdown(drain=False)
        self._fail_everything("worker_died", f"the worker cannot start: {why}")

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.closing is None:
            log.warning("signal %d: draining, then exiting", signum)
            self.closing = Shutdown(drain=True)
        elif signum == signal.SIGINT:  # a second Ctrl-C: stop now
            self.closing = Shutdown(drain=False)
            self._fail_everything("shutting_down", "the worker is shutting down")

    def _finished(self) -> bool:
        return (
            self.closing is not None
            and not self.flights
            and not any(t.state == "building" for t in self.templates.values())
        )

    def close(self) -> None:
        for c in self.children:
            if c.inbox is not None and c.proc is not None and c.proc.poll() is None:
                c.inbox.send(StopProcess(drain=False, reason="worker exit"), timeout_ms=100)
        deadline = time.monotonic() + 10
        for c in self.children:
            if c.proc is not None:
                try:
                    c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()
            if c.inbox is not None:
                c.inbox.close()
        for b in [*self.to_loop, *self.to_post]:
            release(b.state if isinstance(b, Prepared) else b.latents)
        cleanup(self.shm_base)
        self.inbox.close()
        self.server.close()

    # ---- client messages ------------------------------------------------------------------------
    def on_client(self, identity: bytes, msg: Message) -> None:
        self.clients[identity] = None
        if len(self.clients) > MAX_CLIENTS:
            self.clients.pop(next(iter(self.clients)))
        if isinstance(msg, SubmitEdit):
            self.submit(identity, msg)
        elif isinstance(msg, RegisterTemplate):
            self.register(identity, msg)
        elif isinstance(msg, Cancel):
            self.cancel(identity, msg.uid)
        elif isinstance(msg, DropTemplate):
            self.drop_template(msg.template_id)
        elif isinstance(msg, GetStats):
            cost = self.cost_spec if msg.cost else None
            self.server.send(identity, Stats(counters=self.stats(), cost=cost), timeout_ms=0)
        elif isinstance(msg, GetStepLog):
            entries = [e for e in self.steps if e.step >= msg.since_step]
            self.server.send(identity, StepLog(entries=entries), timeout_ms=0)
        elif isinstance(msg, Shutdown):
            log.warning("shutdown requested (drain=%s)", msg.drain)
            self.closing = msg
            if not msg.drain:
                self._fail_everything("shutting_down", "the worker is shutting down")

    def reply(self, identity: bytes, msg: Message) -> None:
        # a terminal reply may wait a little for a congested client; progress never waits
        terminal = isinstance(msg, (EditDone, EditFailed, TemplateReady))
        if not self.server.send(identity, msg, timeout_ms=200 if terminal else 0):
            log.warning("client unreachable; dropped %s", type(msg).__name__)

    def submit(self, identity: bytes, msg: SubmitEdit) -> None:
        def refuse(code: str, why: str, retryable: bool) -> None:
            self.counters["requests_rejected"] += 1
            fail = EditFailed(uid=msg.uid, code=code, message=why, retryable=retryable)
            self.reply(identity, fail)

        if self.closing is not None:
            return refuse("shutting_down", "the worker is shutting down", True)
        if not 0 < len(msg.uid) <= MAX_UID_CHARS:
            return refuse("invalid_request", f"uid: must be 1..{MAX_UID_CHARS} characters", False)
        if (identity, msg.uid) in self.by_client:
            return refuse("invalid_request", f"uid: {msg.uid!r} is already in flight", False)
        if len(self.flights) >= self.w.max_queue:
            return refuse("overloaded", f"the worker holds {len(self.flights)} requests", True)
        self.seq += 1
        uid = f"{self.seq}:{msg.uid}"
        flight = Flight(uid, msg.uid, identity, dataclasses.replace(msg, uid=uid), time.monotonic())
        self.flights[uid] = flight
        self.by_client[(identity, msg.uid)] = uid
        self.queue.append(uid)
        self.counters["requests_accepted"] += 1
        self.reply(identity, Accepted(uid=msg.uid, queue_position=len(self.queue) - 1))

    def register(self, identity: bytes, msg: RegisterTemplate) -> None:
        tid = msg.template_id
        if not _TEMPLATE_ID.fullmatch(tid):
            why = "template_id: must be 64 lowercase hex characters"
            self.reply(identity, TemplateReady(template_id=tid[:64], ok=False, message=why))
            return
        if self.closing is not None:
            why = "the worker is shutting down"
            self.reply(identity, TemplateReady(template_id=tid, ok=False, message=why))
            return
        old = self.templates.get(tid)
        if old is not None and old.msg == msg and old.state != "failed":
            if old.state == "ready":
                self.reply(identity, old.reply())
            else:
                old.waiters.append(identity)
            return
        if old is not None and old.state == "building":
            why = "template_id: being built from other content; wait for it, or use a new id"
            self.reply(identity, TemplateReady(template_id=tid, ok=False, message=why))
            return
        self.templates[tid] = Template(msg, waiters=[identity], queued=True)
        self.counters["templates_registered"] += 1
        for c in self._stage_children():  # every pre process learns the template
            if c.ready:
                self.send(c, msg)

    def drop_template(self, tid: str) -> None:
        """Forget `tid` everywhere; its cache is deleted by the loop (once no edit reads it)."""
        t = self.templates.pop(tid, None)
        if t is None:
            return
        self.counters["templates_dropped"] += 1
        t.state, t.message = "failed", "the template was deleted"
        for identity in t.waiters:
            self.reply(identity, t.reply())
        for msg in [m for m in self.to_loop if m.uid == capture_uid(tid)]:
            self.to_loop.remove(msg)  # a capture not yet forwarded never starts
            release(msg.state)
        for c in self.children:
            if c.ready and (c.role == "loop" or (c.role == "pre" and not self.inline)):
                self.send(c, DropTemplate(template_id=tid))

    def cancel(self, identity: bytes, client_uid: str) -> None:
        uid = self.by_client.get((identity, client_uid))
        if uid is None:  # finished, failed or never seen: answer anyway, in case a terminal
            # reply was lost (the client ignores replies for uids it no longer holds)
            why = "not in flight (finished or unknown)"
            msg = EditFailed(uid=client_uid, code="cancelled", message=why, retryable=False)
            self.reply(identity, msg)
            return
        flight = self.flights[uid]
        if flight.stage == "queued":
            self.queue.remove(uid)
        elif flight.holder is not None:
            self.send(flight.holder, Abort(uid=uid, reason="cancelled"))
        self.counters["requests_cancelled"] += 1
        why = "cancelled by the client"
        self.finish(flight, EditFailed(uid=uid, code="cancelled", message=why, retryable=False))

    def finish(self, flight: Flight, msg: EditDone | EditFailed) -> None:
        """The terminal reply; forget the request."""
        self.flights.pop(flight.uid, None)
        self.by_client.pop((flight.identity, flight.client_uid), None)
        if flight.holder is not None:
            flight.holder.holding.discard(flight.uid)
        if flight.bundle is not None and flight.holder is None:  # in a backlog here: ours
            self._drop_backlog(flight.uid)
        if isinstance(msg, EditDone):
            total = 1e3 * (time.monotonic() - flight.accepted_at)
            # inline (naive) runs report their own pre and denoise times in EditDone
            pre = msg.preprocess_ms or flight.preprocess_ms
            denoise = msg.denoise_ms or flight.denoise_ms
            post = msg.postprocess_ms + flight.decode_ms
            msg = dataclasses.replace(
                msg, preprocess_ms=pre, denoise_ms=denoise, postprocess_ms=post, total_ms=total,
                queue_ms=max(0.0, total - pre - denoise - post),
            )  # fmt: skip
            self.counters["requests_done"] += 1
            if msg.cache_tier is not None:
                key = f"cache_hits_{msg.cache_tier}"
                self.counters[key] = self.counters.get(key, 0) + 1
            self.latency.append((total, msg.queue_ms))
        elif msg.code != "cancelled":
            self.counters["requests_failed"] += 1
        self.reply(flight.identity, dataclasses.replace(msg, uid=flight.client_uid))

    def _drop_backlog(self, uid: str) -> None:
        for backlog in (self.to_loop, self.to_post):
            for m in [m for m in backlog if m.uid == uid]:
                backlog.remove(m)  # type: ignore[arg-type]
                release(m.state if isinstance(m, Prepared) else m.latents)

    # ---- child messages -------------------------------------------------------------------------
    def on_child(self, msg: Message) -> None:
        if isinstance(msg, Heartbeat):
            c = self.by_pid.get(msg.pid)
            if c is not None:
                now = time.monotonic()
                c.last_beat = now
                # a model stage call (ChildRuntime.doing) is progress until its time limit, then
                # the child is stuck whether or not it holds requests
                took = msg.time - msg.busy_since if msg.busy else 0.0
                busy, stuck = 0.0 < took < self.w.stage_timeout_s, took >= self.w.stage_timeout_s
                moved = msg.loop_iterations != c.last_iterations or not msg.in_flight
                if busy or (moved and not stuck):
                    c.progress_at = now
                c.last_iterations = msg.loop_iterations
                c.running = len(msg.in_flight)
                c.busy_s = took if busy else 0.0
                c.busy_stage = msg.busy if busy else ""
        elif isinstance(msg, ChildReady):
            self.child_ready(msg)
        elif isinstance(msg, Prepared):
            self.on_prepared(msg)
        elif isinstance(msg, Finished):
            self.on_finished(msg)
        elif isinstance(msg, (EditDone, EditFailed)):
            flight = self.flights.get(msg.uid)
            if flight is not None:
                self.finish(flight, msg)
        elif isinstance(msg, Progress):
            flight = self.flights.get(msg.uid)
            if flight is not None:
                self.reply(flight.identity, dataclasses.replace(msg, uid=flight.client_uid))
        elif isinstance(msg, TemplateReady):
            self.template_done(msg.template_id, msg.ok, msg.message, msg.bytes_by_tier)
        elif isinstance(msg, LoopSteps):
            for e in msg.entries:
                self.steps.append(dataclasses.replace(e, step=e.step + self.step_offset))
                self.bytes_loaded += e.bytes_loaded
            self.cache_stats.update(msg.cache)
            if msg.entries:
                self.loop_steps = msg.entries[-1].step + 1

    def child_ready(self, msg: ChildReady) -> None:
        c = self.by_pid.get(msg.pid)
        if c is None:
            return
        c.ready, c.last_beat, c.progress_at = True, time.monotonic(), time.monotonic()
        c.codec = msg.codec
        if msg.cost is not None:
            self.cost_spec = msg.cost
        log.info("%s ready (pid %d)", c.name, c.pid)
        if c.role == "pre" or self.inline:  # it must know every template before any edit
            for t in self.templates.values():
                self.send(c, t.msg)
        if c.role == "loop":
            for t in self.templates.values():  # its device cache is new: rebuild (host: no-op)
                if t.state != "failed" and not t.queued and t.holder is None:
                    t.state, t.queued, t.attempts = "building", True, 0
        if self.ready and not self.was_ready:
            self.was_ready = True
            ready = WorkerReady(pid=os.getpid(), model=self.config.model.model,
                                device=self.config.model.device)  # fmt: skip
            for identity in self.clients:
                self.reply(identity, ready)
            if self.on_ready is not None:
                self.on_ready(ready)

    def on_prepared(self, msg: Prepared) -> None:
        if msg.uid.startswith(CAPTURE_PREFIX):
            t = self.templates.get(msg.uid[len(CAPTURE_PREFIX) :])
            if t is None or t.holder is None or t.holder.role == "loop":
                release(msg.state)
                return
            t.holder.holding.discard(msg.uid)
            t.holder, t.bundle = None, msg.state
        else:
            flight = self.flights.get(msg.uid)
            if flight is None:  # cancelled meanwhile
                release(msg.state)
                return
            if flight.holder is not None:
                flight.holder.holding.discard(msg.uid)
            flight.stage, flight.holder, flight.bundle = "loop", None, msg.state
            flight.preprocess_ms = msg.preprocess_ms
        self.to_loop.append(msg)

    def on_finished(self, msg: Finished) -> None:
        flight = self.flights.get(msg.uid)
        if flight is None:
            release(msg.latents)
            return
        if flight.holder is not None:
            flight.holder.holding.discard(msg.uid)
        flight.stage, flight.holder, flight.bundle = "post", None, msg.latents
        flight.denoise_ms = msg.denoise_ms
        notes = msg.meta.notes  # model_stages="loop": the loop's encode/decode
        flight.preprocess_ms += notes.encode_ms
        flight.decode_ms = notes.decode_ms
        self.to_post.append(msg)
        self.stage_report(flight, Stage.POSTPROCESS)

    def stage_report(self, flight: Flight, stage: Stage) -> None:
        """Tell the client which stage its request entered (a Progress with `stage`)."""
        self.reply(flight.identity, Progress(uid=flight.client_uid, step=0, num_steps=0,
                                             stage=stage))  # fmt: skip

    def template_done(
        self, tid: str, ok: bool, message: str, bytes_by_tier: dict[str, int] | None = None
    ) -> None:
        t = self.templates.get(tid)
        if t is None:
            return
        if t.holder is not None:
            t.holder.holding.discard(capture_uid(tid))
        t.holder, t.bundle, t.queued = None, None, False
        t.state, t.message = ("ready" if ok else "failed"), message
        t.build_ms = 1e3 * (time.monotonic() - t.registered_at)
        t.bytes_by_tier = dict(bytes_by_tier or {})
        for identity in t.waiters:
            self.reply(identity, t.reply())
        t.waiters.clear()

    def _fail_everything(self, code: str, why: str) -> None:
        for flight in list(self.flights.values()):
            if flight.holder is not None:
                self.send(flight.holder, Abort(uid=flight.uid, reason=code))
            self.finish(flight, EditFailed(uid=flight.uid, code=code, message=why, retryable=True))
        self.queue.clear()
        for tid, t in self.templates.items():
            if t.state == "building":
                self.template_done(tid, False, why)

    # ---- stats ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return worker_stats(self)


def main(argv: list[str] | None = None) -> int:
    """python -m instgenie.worker.lifeline supervisor '<json>': {"address", "config",
    "die_with_parent", "parent"} (lifeline arms the parent-death signal before the imports)."""
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    setup_process("sup")
    sup = Supervisor(from_dict(Config, spec["config"]), spec["address"])
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
