"""The worker's child processes (the loop, and the pre and post processes unless the policy runs
their stages inline): their records, the channel they write to, and their lifecycle — spawn,
watchdog verdicts (watchdog.py), death, restart after `restart_backoff_s`.

A death is reported to the owner through `on_death(child, reason, held)`, after the process is
reaped, with the uids it held; a child that can never start through `on_fatal(why)`.

Invariants: a child's `holding` is exactly the uids sent to it and not yet answered, so a death
fails those and only those; a child that takes nothing for 5 s, stays silent past the heartbeat
timeout or makes no progress past the stall timeout is killed and restarted after a backoff; one
that exits EXIT_MODEL_LOAD (its model cannot be loaded) before the worker was ever ready ends the
worker (a restart would fail the same way, forever). Every child's shared-memory tensors live
under `shm_base` (a dead child's own prefix is cleaned up at its death).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import instgenie
from instgenie.config import Config, to_dict
from instgenie.errors import EXIT_MODEL_LOAD
from instgenie.ipc import Channel, ipc_address
from instgenie.messages import ChildReady, Heartbeat, StopProcess
from instgenie.tensorshm import cleanup, process_prefix
from instgenie.wire import Message
from instgenie.worker.names import shm_base
from instgenie.worker.watchdog import Watchdog

log = logging.getLogger("instgenie.worker")

PRE_DEPTH = 2  # requests handed to one pre process at a time (the rest queue here, cancellable)


@dataclass
class Child:
    role: str  # "pre" | "loop" | "post"
    index: int
    watchdog: Watchdog
    proc: subprocess.Popen | None = None
    inbox: Channel | None = None  # PUSH bound by us, one per incarnation
    ready: bool = False
    restart_at: float = 0.0  # monotonic; when proc is None: spawn at or after this
    holding: set[str] = field(default_factory=set)  # uids sent to it and not yet answered
    restarts: int = 0
    codec: bool = True  # it may run image codec work (ChildReady)

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def sent(self, uid: str) -> None:
        """`uid` (an edit or a template capture) was sent to this child; it holds it."""
        self.holding.add(uid)

    def answered(self, uid: str) -> None:
        """This child answered `uid` (or it was cancelled): it no longer holds it."""
        self.holding.discard(uid)


class ChildProcesses:
    def __init__(
        self,
        config: Config,
        *,
        inline: bool,
        may_restart: Callable[[], bool],
        on_death: Callable[[Child, str, list[str]], None],
        on_fatal: Callable[[str], None],
    ) -> None:
        self.config = config  # what every child gets
        self.w = config.worker
        self.inline = inline  # no pre/post processes: the loop runs their stages
        self.may_restart = may_restart  # False once the worker shuts down without draining
        self.on_death = on_death
        self.on_fatal = on_fatal
        #: where every child writes to us (PULL)
        self.inbox = Channel.pull(ipc_address("sup"), accept=Message, name="sup in")
        self.shm_base = shm_base(os.getpid())
        cleanup(self.shm_base)
        self.all = [self._child("loop", 0)]
        if not inline:
            self.all += [self._child("pre", i) for i in range(self.w.num_pre)]
            self.all += [self._child("post", i) for i in range(self.w.num_post)]
        self._by_pid: dict[int, Child] = {}
        self.deaths = 0
        self.was_ready = False  # every child was ready at once, at least once

    def _child(self, role: str, index: int) -> Child:
        return Child(role, index, Watchdog(self.w))

    # ---- which child ----------------------------------------------------------------------------
    @property
    def loop(self) -> Child:
        return self.all[0]

    @property
    def ready(self) -> bool:
        return all(c.ready for c in self.all)

    def of(self, pid: int) -> Child | None:
        """The child whose current incarnation is `pid`."""
        return self._by_pid.get(pid)

    def stage_children(self) -> list[Child]:
        """Where templates are registered: the pre processes (the loop under naive)."""
        return [c for c in self.all if c.role == ("loop" if self.inline else "pre")]

    def entry(self) -> Child | None:
        """Where the next edit or template capture starts, if one can take it now: the least
        loaded ready pre process holding fewer than PRE_DEPTH (the loop under naive)."""
        target = self.loop if self.inline else self.least_loaded("pre", PRE_DEPTH)
        return target if target is not None and target.ready else None

    def least_loaded(self, role: str, depth: int) -> Child | None:
        ready = [c for c in self.all if c.role == role and c.ready and len(c.holding) < depth]
        return min(ready, key=lambda c: len(c.holding), default=None)

    def send(self, child: Child, msg: Message) -> None:
        """To a ready child; one that takes nothing for 5 s is treated as dead."""
        assert child.inbox is not None
        if not child.inbox.send(msg, timeout_ms=5000):
            self.died(child, "its inbox stayed full for 5 s")

    # ---- what they report -----------------------------------------------------------------------
    def beat(self, msg: Heartbeat) -> None:
        c = self._by_pid.get(msg.pid)
        if c is not None:
            c.watchdog.beat(msg, time.monotonic())

    def mark_ready(self, msg: ChildReady) -> Child | None:
        """The child that sent `msg`, now ready (None: an incarnation already gone)."""
        c = self._by_pid.get(msg.pid)
        if c is None:
            return None
        c.ready, c.codec = True, msg.codec
        c.watchdog.ready(time.monotonic())
        log.info("%s ready (pid %d)", c.name, c.pid)
        return c

    def first_ready(self) -> bool:
        """True exactly once: the first time every child is ready."""
        if self.was_ready or not self.ready:
            return False
        self.was_ready = True
        return True

    # ---- lifecycle ------------------------------------------------------------------------------
    def watch(self) -> None:
        """Spawn children due for a (re)start; kill and reap the dead, stuck and silent."""
        now = time.monotonic()
        for c in self.all:
            if c.proc is None:
                if self.may_restart() and now >= c.restart_at:
                    self.spawn(c)
                continue
            rc = c.proc.poll()
            if rc == EXIT_MODEL_LOAD and not self.was_ready:
                self.on_fatal(f"{c.name} could not load its model (its error is logged above)")
            why = f"exited with status {rc}" if rc is not None else c.watchdog.verdict(c.ready, now)
            if why:
                self.died(c, why)

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
        c.ready = False
        c.watchdog.started(time.monotonic())
        self._by_pid[c.proc.pid] = c
        log.info("started %s (pid %d)", c.name, c.proc.pid)

    def died(self, c: Child, reason: str) -> None:
        """Kill (if needed) and reap `c`, schedule its restart, report what it held."""
        assert c.proc is not None
        pid = c.proc.pid
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.wait()
        log.error("%s (pid %d) died: %s; %s", c.name, pid, reason,
                  "restarting" if self.may_restart() else "not restarted")  # fmt: skip
        self.deaths += 1
        self._by_pid.pop(pid, None)
        cleanup(process_prefix(self.shm_base, pid))
        if c.inbox is not None:
            c.inbox.close()
        c.proc, c.inbox, c.ready = None, None, False
        c.restarts += 1
        c.restart_at = time.monotonic() + self.w.restart_backoff_s
        held = sorted(c.holding)
        c.holding.clear()
        self.on_death(c, reason, held)

    def close(self) -> None:
        """Stop every child (10 s in all, then kill), close the channels, clean up shm."""
        for c in self.all:
            if c.inbox is not None and c.proc is not None and c.proc.poll() is None:
                c.inbox.send(StopProcess(drain=False, reason="worker exit"), timeout_ms=100)
        deadline = time.monotonic() + 10
        for c in self.all:
            if c.proc is not None:
                try:
                    c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()
            if c.inbox is not None:
                c.inbox.close()
        cleanup(self.shm_base)
        self.inbox.close()
