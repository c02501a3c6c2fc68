"""The worker's client socket (ROUTER): the clients it has heard from, and replies to them.

A terminal reply (EditDone, EditFailed, TemplateReady) may wait 200 ms for a congested client;
progress never waits. The last MAX_CLIENTS identities are remembered, for the WorkerReady that a
(re)started worker broadcasts.
"""

from __future__ import annotations

import logging

from instgenie.curve import ServerCurve
from instgenie.ipc import Server
from instgenie.messages import EditDone, EditFailed, TemplateReady
from instgenie.wire import ClientToWorker, Message

log = logging.getLogger("instgenie.worker")

MAX_CLIENTS = 10_000  # identities remembered for WorkerReady broadcasts


class ClientSocket:
    def __init__(
        self, address: str, *, allow_remote: bool, curve: ServerCurve | None = None
    ) -> None:
        """Bind `address`; with `curve`, only clients holding one of curve.clients' keys get a
        connection (required for a non-loopback address: ipc.py)."""
        self.server = Server(address, allow_remote=allow_remote, curve=curve,
                             accept=ClientToWorker, name="worker")  # fmt: skip
        self.address = self.server.address
        self._clients: dict[bytes, None] = {}  # insertion-ordered: the oldest is forgotten first

    def heard(self, identity: bytes) -> None:
        self._clients[identity] = None
        if len(self._clients) > MAX_CLIENTS:
            self._clients.pop(next(iter(self._clients)))

    def reply(self, identity: bytes, msg: Message) -> None:
        terminal = isinstance(msg, (EditDone, EditFailed, TemplateReady))
        if not self.server.send(identity, msg, timeout_ms=200 if terminal else 0):
            log.warning("client unreachable; dropped %s", type(msg).__name__)

    def answer(self, identity: bytes, msg: Message) -> None:
        """A query's answer (Stats, StepLog): never waits."""
        self.server.send(identity, msg, timeout_ms=0)

    def broadcast(self, msg: Message) -> None:
        for identity in self._clients:
            self.reply(identity, msg)

    def close(self) -> None:
        self.server.close()
