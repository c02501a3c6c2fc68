"""Work waiting for a process, and handing it over when one can take it: edits and template
captures for a pre process (the loop under naive), Prepared bundles for the loop, Finished
latents for a post process.

Every message between processes passes through the supervisor (a hub), so it always knows which
process holds a request. Invariants: template captures go first (edits may be waiting on them);
a bundle here is owned by the supervisor until forwarded, and one whose request is gone is
released (`drop`, `release_all`); a queued edit has no holder and is cancellable here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from instgenie.messages import BuildTemplate, Finished, Prepared, Stage
from instgenie.tensorshm import release
from instgenie.wire import Message
from instgenie.worker.child_processes import Child, ChildProcesses
from instgenie.worker.names import CAPTURE_PREFIX, capture_uid
from instgenie.worker.request_table import RequestTable
from instgenie.worker.template_registry import TemplateRegistry


class WorkQueues:
    def __init__(
        self,
        children: ChildProcesses,
        requests: RequestTable,
        templates: TemplateRegistry,
        reply: Callable[[bytes, Message], None],
    ) -> None:
        self.children, self.requests, self.templates = children, requests, templates
        self.reply = reply  # to a client
        self._queue: deque[str] = deque()  # edits waiting for a pre process (or the loop)
        self._to_loop: deque[Prepared] = deque()  # waiting for the loop to be ready
        self._to_post: deque[Finished] = deque()

    def queue(self, uid: str) -> int:
        """Queue an accepted edit; its position (0 = next)."""
        self._queue.append(uid)
        return len(self._queue) - 1

    def unqueue(self, uid: str) -> None:
        self._queue.remove(uid)

    def clear_queue(self) -> None:
        self._queue.clear()

    def to_loop(self, msg: Prepared) -> None:
        self._to_loop.append(msg)

    def to_post(self, msg: Finished) -> None:
        self._to_post.append(msg)

    def drop(self, uid: str) -> None:
        """Release the bundles of `uid` waiting here (its request is gone)."""
        for backlog in (self._to_loop, self._to_post):
            for m in [m for m in backlog if m.uid == uid]:
                backlog.remove(m)  # type: ignore[arg-type]
                release(m.state if isinstance(m, Prepared) else m.latents)

    def drop_capture(self, tid: str) -> None:
        """A capture of `tid` not yet forwarded never starts."""
        for msg in [m for m in self._to_loop if m.uid == capture_uid(tid)]:
            self._to_loop.remove(msg)
            release(msg.state)

    def release_all(self) -> None:
        for b in [*self._to_loop, *self._to_post]:
            release(b.state if isinstance(b, Prepared) else b.latents)

    def dispatch(self) -> None:
        """Hand over what waits, as far as processes are ready to take it."""
        children, send, inline = self.children, self.children.send, self.children.inline
        for t in self.templates.all():
            if t.queued:
                target = children.entry()
                if target is None:
                    break
                t.build_on(target)
                send(target, BuildTemplate(template_id=t.msg.template_id))
        while self._queue:
            target = children.entry()
            if target is None:
                break
            flight = self.requests.get(self._queue.popleft())
            assert flight is not None  # a queued edit leaves the queue when it ends
            flight.sent(target, "loop" if inline else "pre")
            send(target, flight.msg)
            self.reply(flight.identity, flight.progress(Stage.PREPROCESS))
        while self._to_loop and children.loop.ready:
            self._hand_over(children.loop, self._to_loop.popleft())
        while self._to_post:
            post = children.least_loaded("post", 1 << 30)
            if post is None:
                break
            self._hand_over(post, self._to_post.popleft())

    def _hand_over(self, target: Child, msg: Prepared | Finished) -> None:
        owner = self.requests.get(msg.uid) or self.templates.get(msg.uid[len(CAPTURE_PREFIX) :])
        if owner is not None:
            owner.sent(target)
        else:
            target.sent(msg.uid)
        self.children.send(target, msg)
