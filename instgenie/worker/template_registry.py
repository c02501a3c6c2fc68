"""The worker's templates: each registered template's build (its capture run), the clients waiting
for it, and its state — building, ready or failed.

Invariants: every client that registered a template gets exactly one TemplateReady per
registration (at once when it is ready or refused, else when its build ends); a capture is tried
at most `max_template_attempts` times when the process running it dies; after a loop restart
every template not failed is built again (the loop's device cache died with it; a host cache
answers at once).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from instgenie.config import WorkerConfig
from instgenie.messages import Prepared, RegisterTemplate, TemplateReady, TensorBundle
from instgenie.tensorshm import release
from instgenie.wire import Message
from instgenie.worker.child_processes import Child
from instgenie.worker.names import capture_uid

_TEMPLATE_ID = re.compile(r"[0-9a-f]{64}")


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
    retryable: bool = False  # failed for a reason that may pass (TemplateReady.retryable)

    @property
    def capture_uid(self) -> str:
        return capture_uid(self.msg.template_id)

    def reply(self) -> TemplateReady:
        return TemplateReady(template_id=self.msg.template_id, ok=self.state == "ready",
                             message=self.message, build_ms=self.build_ms,
                             bytes_by_tier=self.bytes_by_tier,
                             retryable=self.retryable and self.state == "failed")  # fmt: skip

    def build_on(self, target: Child) -> None:
        """Its capture (BuildTemplate) was sent to `target`: one more attempt."""
        self.queued, self.holder = False, target
        self.attempts += 1
        target.sent(self.capture_uid)

    def sent(self, target: Child) -> None:
        """Its capture's Prepared was forwarded to `target` (the loop)."""
        self.holder = target
        target.sent(self.capture_uid)

    def prepared(self, msg: Prepared) -> bool:
        """Its pre process answered; False when the bundle is stale (not ours to forward)."""
        if self.holder is None or self.holder.role == "loop":
            return False
        self.holder.answered(msg.uid)
        self.holder, self.bundle = None, msg.state
        return True


class TemplateRegistry:
    def __init__(self, w: WorkerConfig, reply: Callable[[bytes, Message], None]) -> None:
        self.max_attempts = w.max_template_attempts
        self.reply = reply  # to a client
        self._templates: dict[str, Template] = {}
        self.counters = {"templates_registered": 0, "templates_dropped": 0}

    def get(self, tid: str) -> Template | None:
        return self._templates.get(tid)

    def all(self) -> list[Template]:
        return list(self._templates.values())

    def queued(self) -> list[Template]:
        """Templates whose capture waits for a process, in registration order."""
        return [t for t in self._templates.values() if t.queued]

    def building(self) -> bool:
        return any(t.state == "building" for t in self._templates.values())

    def register(
        self,
        identity: bytes,
        msg: RegisterTemplate,
        closing: bool,
        resident: Callable[[str], bool] | None = None,
    ) -> bool:
        """Answer at once, or wait for a build; True when a new build starts (the processes
        that run captures must learn `msg`). `resident(tid)`: whether the template's cache is
        still held by this worker's stores (the loop's residency report); a template built
        here whose cache has since left them (evicted from the node's tiers) is captured again
        when it is registered again, rather than answered ready with no cache behind it."""
        tid = msg.template_id
        if not _TEMPLATE_ID.fullmatch(tid):
            why = "template_id: must be 64 lowercase hex characters"
            self.reply(identity, TemplateReady(template_id=tid[:64], ok=False, message=why))
            return False
        if closing:
            why = "the worker is shutting down"
            self.reply(identity, TemplateReady(template_id=tid, ok=False, message=why))
            return False
        old = self._templates.get(tid)
        evicted = (
            old is not None
            and old.state == "ready"
            and resident is not None
            and (not resident(tid))
        )
        if old is not None and old.msg == msg and old.state != "failed" and not evicted:
            if old.state == "ready":
                self.reply(identity, old.reply())
            else:
                old.waiters.append(identity)
            return False
        if old is not None and old.state == "building":
            why = "template_id: being built from other content; wait for it, or use a new id"
            self.reply(identity, TemplateReady(template_id=tid, ok=False, message=why))
            return False
        self._templates[tid] = Template(msg, waiters=[identity], queued=True)
        self.counters["templates_registered"] += 1
        return True

    def drop(self, tid: str) -> bool:
        """Forget `tid`, failing its waiters; False when it was not registered."""
        t = self._templates.pop(tid, None)
        if t is None:
            return False
        self.counters["templates_dropped"] += 1
        t.state, t.message = "failed", "the template was deleted"
        for identity in t.waiters:
            self.reply(identity, t.reply())
        return True

    def done(
        self,
        tid: str,
        ok: bool,
        message: str,
        bytes_by_tier: dict[str, int] | None = None,
        retryable: bool = False,
    ) -> None:
        """Its build ended (ok or not): answer every waiter."""
        t = self._templates.get(tid)
        if t is None:
            return
        if t.holder is not None:
            t.holder.answered(capture_uid(tid))
        t.holder, t.bundle, t.queued = None, None, False
        t.state, t.message = ("ready" if ok else "failed"), message
        t.build_ms = 1e3 * (time.monotonic() - t.registered_at)
        t.bytes_by_tier = dict(bytes_by_tier or {})
        t.retryable = retryable
        for identity in t.waiters:
            self.reply(identity, t.reply())
        t.waiters.clear()

    def capture_lost(self, tid: str, why: str) -> None:
        """The process running `tid`'s capture died: try again, or give up after the limit."""
        t = self._templates.get(tid)
        if t is None:
            return
        if t.bundle is not None:
            release(t.bundle)
        t.holder, t.bundle = None, None
        if t.attempts >= self.max_attempts:
            self.done(tid, False, f"{why}; gave up after {t.attempts} attempts")
        else:
            t.queued = True

    def rebuild(self) -> None:
        """A new loop is ready (its device cache is new): build every template again; a host
        cache answers at once."""
        for t in self._templates.values():
            if t.state != "failed" and not t.queued and t.holder is None:
                t.state, t.queued, t.attempts = "building", True, 0

    def fail_building(self, why: str) -> None:
        for tid, t in self._templates.items():
            if t.state == "building":
                self.done(tid, False, why)

    def states(self) -> dict[str, int]:
        """How many templates are in each state."""
        states = [t.state for t in self._templates.values()]
        return {s: states.count(s) for s in ("building", "ready", "failed")}
