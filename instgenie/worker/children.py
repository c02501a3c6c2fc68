"""A worker supervisor's children: their records, dispatching work to them, and their lifecycle
(spawn, watchdog, death, restart). `ChildProcesses` is a mixin of `Supervisor`; it reads and
writes the supervisor's state: `children`, `by_pid`, `flights`, `queue`, `templates`,
`to_loop`, `to_post`, `counters`, `step_offset`, `loop_steps`, `closing`, `inline`, `w`,
`config`, `inbox`, `shm_base`, `was_ready`, and calls its `finish`, `template_done` and
`give_up`.

Invariants: a child's `holding` is exactly the uids sent to it and not yet answered, so a death
fails those and only those; a child that takes nothing for 5 s, stays silent past the heartbeat
timeout or makes no progress past the stall timeout is killed and restarted after a backoff; one
that exits EXIT_MODEL_LOAD (its model cannot be loaded) before the worker was ever ready ends the
worker (a restart would fail the same way, forever).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import instgenie
from instgenie.config import to_dict
from instgenie.errors import EXIT_MODEL_LOAD
from instgenie.ipc import Channel, ipc_address
from instgenie.messages import (
    BuildTemplate,
    EditFailed,
    Finished,
    Message,
    Prepared,
    RegisterTemplate,
    Stage,
    SubmitEdit,
    TemplateReady,
    TensorBundle,
)
from instgenie.tensorshm import cleanup, process_prefix, release
from instgenie.worker.names import CAPTURE_PREFIX, capture_uid

log = logging.getLogger("instgenie.worker")

PRE_DEPTH = 2  # requests handed to one pre process at a time (the rest queue here, cancellable)


@dataclass
class Child:
    role: str  # "pre" | "loop" | "post"
    index: int
    proc: subprocess.Popen | None = None
    inbox: Channel | None = None  # PUSH bound by us, one per incarnation
    ready: bool = False
    started_at: float = 0.0  # monotonic
    restart_at: float = 0.0  # monotonic; when proc is None: spawn at or after this
    last_beat: float = 0.0
    last_iterations: int = -1
    progress_at: float = 0.0  # last time its iterations moved (or it held nothing)
    holding: set[str] = field(default_factory=set)  # uids sent to it and not yet answered
    running: int = 0  # requests its last heartbeat says it works on (the loop's batch)
    busy_s: float = 0.0  # how long its main thread has been in one model stage call (doing)
    busy_stage: str = ""  # that stage call ("encode", "decode"), "" = none
    restarts: int = 0
    codec: bool = True  # it may run image codec work (ChildReady)

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0


@dataclass
class Flight:  # one accepted request
    uid: str  # internal id "<seq>:<client uid>"
    client_uid: str
    identity: bytes
    msg: SubmitEdit  # with the internal uid
    accepted_at: float  # monotonic
    stage: str = "queued"  # "queued" | "pre" | "loop" | "post"
    holder: Child | None = None
    bundle: TensorBundle | None = None  # forwarded by us to `holder`
    preprocess_ms: float = 0.0  # pre process (+ the loop's encode, model_stages="loop")
    denoise_ms: float = 0.0
    decode_ms: float = 0.0  # the loop's VAE decode (model_stages="loop")


@dataclass
class Template:
    msg: RegisterTemplate
    state: str = "building"  # "building" | "ready" | "failed"
    waiters: list[bytes] = field(default_factory=list)
    attempts: int = 0
    message: str = ""
    holder: Child | None = None
    bundle: TensorBundle | None = None
    queued: bool = False  # a BuildTemplate waits for a ready process
    registered_at: float = field(default_factory=time.monotonic)
    build_ms: float = 0.0  # registered -> ready/failed, ms
    bytes_by_tier: dict[str, int] = field(default_factory=dict)  # from the loop's TemplateReady

    def reply(self) -> TemplateReady:
        return TemplateReady(template_id=self.msg.template_id, ok=self.state == "ready",
                             message=self.message, build_ms=self.build_ms,
                             bytes_by_tier=self.bytes_by_tier)  # fmt: skip


class ChildProcesses:
    # ---- dispatch -------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return all(c.ready for c in self.children)

    def _stage_children(self) -> list[Child]:
        """Where templates are registered: the pre processes (the loop under naive)."""
        return [c for c in self.children if c.role == ("loop" if self.inline else "pre")]

    def dispatch(self) -> None:
        loop = self.children[0]
        for t in self.templates.values():  # template captures first: edits may be waiting on them
            if t.queued:
                target = loop if self.inline else self._least_loaded("pre", PRE_DEPTH)
                if target is None or not target.ready:
                    break
                t.queued, t.holder = False, target
                t.attempts += 1
                target.holding.add(capture_uid(t.msg.template_id))
                self.send(target, BuildTemplate(template_id=t.msg.template_id))
        while self.queue:
            target = loop if self.inline else self._least_loaded("pre", PRE_DEPTH)
            if target is None or not target.ready:
                break
            flight = self.flights[self.queue.popleft()]
            flight.stage, flight.holder = ("loop" if self.inline else "pre"), target
            target.holding.add(flight.uid)
            self.send(target, flight.msg)
            self.stage_report(flight, Stage.PREPROCESS)
        while self.to_loop and loop.ready:
            msg = self.to_loop.popleft()
            self._hand_over(loop, msg)
        while self.to_post:
            post = self._least_loaded("post", 1 << 30)
            if post is None:
                break
            self._hand_over(post, self.to_post.popleft())

    def _hand_over(self, target: Child, msg: Prepared | Finished) -> None:
        owner = self.flights.get(msg.uid) or self.templates.get(msg.uid[len(CAPTURE_PREFIX) :])
        if owner is not None:
            owner.holder = target
        target.holding.add(msg.uid)
        self.send(target, msg)

    def _least_loaded(self, role: str, depth: int) -> Child | None:
        ready = [c for c in self.children if c.role == role and c.ready and len(c.holding) < depth]
        return min(ready, key=lambda c: len(c.holding), default=None)

    def send(self, child: Child, msg: Message) -> None:
        """To a ready child; one that takes nothing for 5 s is treated as dead."""
        assert child.inbox is not None
        if not child.inbox.send(msg, timeout_ms=5000):
            self.child_died(child, "its inbox stayed full for 5 s")

    # ---- children -------------------------------------------------------------------------------
    def watchdog(self) -> None:
        now = time.monotonic()
        w = self.w
        for c in self.children:
            if c.proc is None:
                if (self.closing is None or self.closing.drain) and now >= c.restart_at:
                    self.spawn(c)
                continue
            rc = c.proc.poll()
            if rc == EXIT_MODEL_LOAD and not self.was_ready:
                self.give_up(f"{c.name} could not load its model (its error is logged above)")
                self.child_died(c, f"exited with status {rc}")
            elif rc is not None:
                self.child_died(c, f"exited with status {rc}")
            elif not c.ready and now - c.started_at > w.start_timeout_s:
                self.child_died(c, f"not ready after {w.start_timeout_s:.0f} s")
            elif c.ready and now - c.last_beat > w.heartbeat_timeout_s:
                self.child_died(c, f"no heartbeat for {now - c.last_beat:.1f} s")
            elif c.ready and now - c.progress_at > w.stall_timeout_s:
                self.child_died(c, f"no progress for {now - c.progress_at:.1f} s")

    def spawn(self, c: Child) -> None:
        c.inbox = Channel.push(ipc_address(c.name), bind=True, name=f"{c.name} inbox")
        spec = {
            "role": c.role, "index": c.index, "inbox": c.inbox.address,
            "outbox": self.inbox.address, "shm_base": self.shm_base, "config": to_dict(self.config),
            "parent": os.getpid(),
        }  # fmt: skip
        env = dict(os.environ)
        root = str(Path(instgenie.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "instgenie.worker.lifeline", "child", json.dumps(spec)]
        c.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        c.started_at = c.last_beat = c.progress_at = time.monotonic()
        c.ready, c.last_iterations, c.running, c.busy_s = False, -1, 0, 0.0
        self.by_pid[c.proc.pid] = c
        log.info("started %s (pid %d)", c.name, c.proc.pid)

    def child_died(self, c: Child, reason: str) -> None:
        """Kill (if needed) and reap `c`, fail what it held, schedule its restart."""
        assert c.proc is not None
        pid = c.proc.pid
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.wait()
        again = self.closing is None or self.closing.drain
        log.error("%s (pid %d) died: %s; %s", c.name, pid, reason,
                  "restarting" if again else "not restarted")  # fmt: skip
        self.counters["child_deaths"] += 1
        self.by_pid.pop(pid, None)
        cleanup(process_prefix(self.shm_base, pid))
        if c.inbox is not None:
            c.inbox.close()
        c.proc, c.inbox, c.ready = None, None, False
        c.restarts += 1
        c.restart_at = time.monotonic() + self.w.restart_backoff_s
        if c.role == "loop":
            self.step_offset += self.loop_steps
            self.loop_steps = 0
        why = f"worker process {c.name} died ({reason}); the request may be retried"
        for uid in sorted(c.holding):
            if uid.startswith(CAPTURE_PREFIX):
                self._capture_lost(uid[len(CAPTURE_PREFIX) :], why)
                continue
            flight = self.flights.get(uid)
            if flight is not None:
                if flight.bundle is not None:
                    release(flight.bundle)
                self.finish(flight, EditFailed(uid=uid, code="worker_died", message=why,
                                               retryable=True))  # fmt: skip
        c.holding.clear()

    def _capture_lost(self, tid: str, why: str) -> None:
        t = self.templates.get(tid)
        if t is None:
            return
        if t.bundle is not None:
            release(t.bundle)
        t.holder, t.bundle = None, None
        if t.attempts >= self.w.max_template_attempts:
            self.template_done(tid, False, f"{why}; gave up after {t.attempts} attempts")
        else:
            t.queued = True
