"""CurveZMQ on the sockets of instgenie/ipc.py: one ZAP handler per process (zmq.auth's
ThreadAuthenticator, started before the first CURVE server binds: a CURVE server without a
ZAP handler would admit anyone) and an exact allow list of client public keys per bound socket,
each socket in its own ZAP domain. Nothing is written to disk. Keys: instgenie/curve.py.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

    from instgenie.curve import ClientCurve, ServerCurve


class AllowedClients:
    """A ZAP credentials provider: the client public keys (z85) one bound socket accepts.
    It stays registered for the process's life (removing a domain would race the authenticator
    thread's lookup); `revoke` empties it when its socket closes (a few hundred bytes each)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = frozenset(k.encode("ascii") for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:  # called in the authenticator thread
        return key in self.keys

    def revoke(self) -> None:
        self.keys = frozenset()  # one reference swap: atomic for the authenticator thread


_auth: tuple[int, ThreadAuthenticator] | None = None  # (pid, this process's ZAP handler)
_auth_lock = threading.Lock()


def _authenticator(ctx: zmq.Context) -> ThreadAuthenticator:
    """This process's ZAP handler on `ctx`, started on first use (a forked child, or a new
    context, gets its own: the parent's thread and context are not in it). Runs until the
    process exits."""
    global _auth
    with _auth_lock:
        if _auth is None or _auth[0] != os.getpid() or _auth[1].context is not ctx:
            from zmq.auth.thread import ThreadAuthenticator  # (asyncio: only where curve is used)

            auth = ThreadAuthenticator(ctx, log=logging.getLogger("instgenie.ipc.zap"))
            auth.start()
            _auth = (os.getpid(), auth)
        return _auth[1]


def curve_server(socket: zmq.Socket, curve: ServerCurve, ctx: zmq.Context) -> AllowedClients:
    """Make `socket` (not bound yet, made by `ctx`) a CURVE server whose own ZAP domain admits
    exactly curve.clients; returns that allow list (revoke it when the socket closes)."""
    auth = _authenticator(
        ctx
    )  # before the bind: a CURVE server without a ZAP handler admits anyone
    domain = f"instgenie-{secrets.token_hex(8)}"
    allowed = AllowedClients(curve.clients)
    auth.configure_curve_callback(domain, allowed)
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, curve.secret.encode("ascii"))
    socket.setsockopt(zmq.CURVE_PUBLICKEY, curve.public.encode("ascii"))
    socket.setsockopt_string(zmq.ZAP_DOMAIN, domain)
    try:  # a draft option in some builds: refuse, not admit, should the handler ever be missing
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    except zmq.ZMQError:
        pass
    return allowed


def curve_client(socket: zmq.Socket, curve: ClientCurve) -> None:
    socket.setsockopt(zmq.CURVE_SERVERKEY, curve.server.encode("ascii"))
    socket.setsockopt(zmq.CURVE_PUBLICKEY, curve.public.encode("ascii"))
    socket.setsockopt(zmq.CURVE_SECRETKEY, curve.secret.encode("ascii"))
