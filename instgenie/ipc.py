"""Typed ZMQ endpoints: every message is one frame made by wire.encode (msgpack, never pickle).

- Channel: PUSH/PULL, one direction (a worker's processes: pre -> loop -> post -> supervisor).
- Server: ROUTER, `recv() -> (identity, message)`, `send(identity, message)` (the supervisor).
- ClientSocket: DEALER, talks to a Server (API server, tests, load tester).

Invariants (RELIABILITY.md item 14):
- Addresses are `ipc://<path>` (not the abstract namespace, which has no permissions), `inproc://`,
  or `tcp://127.x.x.x` / `tcp://[::1]`, for bind and connect alike. Any other address (a socket
  beyond loopback) needs BOTH `allow_remote=True` and CurveZMQ keys (instgenie/curve.py): a
  bound one `curve=ServerCurve`, a connecting one `curve=ClientCurve`; ValueError otherwise, so
  no socket ever listens or talks in clear text beyond this host. Curve is optional on local
  addresses (same guarantees there when given).
- A socket bound with curve is a CURVE server (traffic encrypted, the server proves its key) and
  is guarded by this process's one ZAP handler (instgenie/zap.py: zmq.auth ThreadAuthenticator,
  started before the first such bind, never stopped): a connection is let in only if its client
  public key is one of that socket's `ServerCurve.clients`, matched exactly (each socket its
  own ZAP domain; a closed socket's domain admits nobody). Anything else never completes the
  handshake: none of its frames reaches the socket (not even as garbage). Nothing is written to
  disk.
- `ipc_address(tag)` makes unique paths in a private directory (0700),
  `<tmp>/instgenie-ipc-<pid>-<random>`, removed when its process exits, however it exits
  (ipc_dir_prefix says by whom).
- Every socket sets ZMQ_MAXMSGSIZE (a peer sending more is disconnected by libzmq) and LINGER 0
  (close never blocks; unsent messages are dropped).
- A received frame that is not exactly one valid message of an accepted type (undecodable bytes,
  wrong number of frames, a message of another direction) is counted in `garbage_frames`, logged
  on the 1st, (N+1)th, ... occurrence, and skipped: the receive goes on waiting until its timeout.
- Timeouts are in ms: None waits forever, 0 does not wait. recv returns None on timeout; send
  returns False if the message could not be queued in time (or, for a Server, the peer is gone).
Threads and processes: a socket is used by the thread that made it, in the process that made it
(RuntimeError in another pid). `context()` is zmq.Context.instance(), which pyzmq re-creates in a
forked child; spawned children import afresh and so make their own.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from instgenie.wire import MAX_MESSAGE_BYTES, Message, MessageError, decode, encode
from instgenie.zap import AllowedClients, curve_client, curve_server

if TYPE_CHECKING:
    from instgenie.curve import ClientCurve, ServerCurve

log = logging.getLogger(__name__)

LOG_EVERY = 100  # log one garbage frame in this many
_TCP_LOOPBACK = re.compile(r"tcp://(127\.\d{1,3}\.\d{1,3}\.\d{1,3}|\[::1\]):(\*|\d{1,5})")
_TAG = re.compile(r"[A-Za-z0-9_-]{1,32}")
_SUN_PATH_MAX = 107  # bytes of a unix socket path (sun_path is 108 with the NUL)


def _pid_namespace() -> str:
    """This process's pid namespace (the inode of /proc/self/ns/pid): a pid means a process only
    within it; "0" where the kernel does not say."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


#: directories are named <prefix><pid namespace>-<pid>-<mkdtemp's random suffix>: a process of
#: another namespace sharing the temp directory (a container) is never taken for a dead one
_DIR_PREFIX = f"instgenie-ipc-{_pid_namespace()}-"
_DIR_NAME = re.compile(re.escape(_DIR_PREFIX) + r"(\d+)-[a-z0-9_]+")
_ipc_dir: tuple[int, str] | None = None  # (creating pid, path) of this process's ipc directory


def context() -> zmq.Context:
    """The process's ZMQ context (a new one after fork; never one inherited from the parent)."""
    return zmq.Context.instance()


def is_local(address: str) -> bool:
    """Whether `address` stays on this host: ipc://, inproc:// or loopback tcp."""
    return (
        address.startswith(("ipc://", "inproc://")) or _TCP_LOOPBACK.fullmatch(address) is not None
    )


def check_address(address: str, *, allow_remote: bool = False, curve: bool = False) -> str:
    """`address` if it is local (see the module invariants), or if it is not but allow_remote
    and `curve` (the socket uses CurveZMQ) are both set; else ValueError."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str, got {type(address).__name__}")
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        if not path or path.startswith("@") or len(path.encode()) > _SUN_PATH_MAX:
            raise ValueError(f"ipc address needs a filesystem path of at most 107 bytes: {address}")
        return address
    if is_local(address):
        return address
    if not allow_remote:
        raise ValueError(
            f"refusing non-local address {address!r}: use ipc://, tcp://127.0.0.1:* "
            "or pass allow_remote=True with CurveZMQ keys"
        )
    if not curve:
        raise ValueError(
            f"refusing non-local address {address!r} without CurveZMQ: a socket beyond "
            "loopback needs curve keys (instgenie.curve.CurveKeys; `instgenie keys generate`)"
        )
    return address


def ipc_address(tag: str) -> str:
    """A unique `ipc://` address in this process's private directory (mode 0700; see
    ipc_dir_prefix for who removes it). The socket file is removed when the endpoint bound to it
    closes."""
    global _ipc_dir
    if not _TAG.fullmatch(tag):
        raise ValueError(f"tag must match {_TAG.pattern}, got {tag!r}")
    if _ipc_dir is None or _ipc_dir[0] != os.getpid():
        remove_stale_ipc_dirs()
        pid = os.getpid()
        _ipc_dir = (pid, tempfile.mkdtemp(prefix=ipc_dir_prefix(pid)))  # 0700 by contract
        atexit.register(_remove_ipc_dir, *_ipc_dir)
    return check_address(f"ipc://{_ipc_dir[1]}/{tag}-{secrets.token_hex(6)}.sock")


def ipc_dir_prefix(pid: int) -> str:
    """Name prefix of the ipc directories of process `pid` (in tempfile.gettempdir()).
    Who removes a process's directory: the process itself at a normal exit (atexit; a worker
    supervisor exits normally on SIGTERM, it drains first); its parent once it has exited
    otherwise (remove_ipc_dirs(pid) after wait(): SIGKILL, a crash); and when the parent died too
    (its children get the parent-death SIGKILL), the next process of this user that makes an ipc
    directory (remove_stale_ipc_dirs)."""
    return f"{_DIR_PREFIX}{pid}-"


def remove_ipc_dirs(pid: int) -> None:
    """Remove the ipc directories of process `pid`, which has exited (call after reaping it)."""
    for path in Path(tempfile.gettempdir()).glob(f"{ipc_dir_prefix(pid)}*"):
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_ipc_dirs() -> list[str]:
    """Remove the ipc directories of this user's processes that no longer exist; returns their
    paths. Only directories of this pid namespace are looked at; their pid is read from the
    name, and a live pid (or one of another user) keeps its directory."""
    removed = []
    uid = os.getuid()
    for path in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*"):
        m = _DIR_NAME.fullmatch(path.name)
        if m is None or int(m[1]) == os.getpid() or _pid_exists(int(m[1])):
            continue
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_ipc_dir(pid: int, path: str) -> None:
    if os.getpid() == pid:  # a forked child inherits atexit handlers: leave the parent's dir
        shutil.rmtree(path, ignore_errors=True)


class Endpoint:
    """One ZMQ socket that carries messages; base of Channel, Server and ClientSocket."""

    _frames = 1  # frames per received message (ROUTER: identity + payload)

    def __init__(
        self,
        socket_type: int,
        *,
        accept: type[Message] | tuple[type[Message], ...] = Message,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        hwm: int = 1000,
        log_every: int = LOG_EVERY,
        name: str = "",
    ) -> None:
        self.accept = accept  # received messages of other types are garbage
        self.max_message_bytes = max_message_bytes  # ZMQ_MAXMSGSIZE and the encode/decode cap
        self.log_every = max(1, log_every)
        self.name = name or type(self).__name__  # for logs
        self.garbage_frames = 0  # dropped received messages (any reason), count
        self._pid = os.getpid()
        self._bound_files: list[str] = []  # ipc socket files this endpoint created
        self._zap: AllowedClients | None = None  # its ZAP allow list, once bound with curve
        self.socket = context().socket(socket_type)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, hwm)
        self.socket.setsockopt(zmq.RCVHWM, hwm)

    # ---- lifecycle --------------------------------------------------------------------------
    def bind(
        self, address: str, *, allow_remote: bool = False, curve: ServerCurve | None = None
    ) -> str:
        """Bind; returns the resolved address (the port chosen for `tcp://127.0.0.1:*`).
        With `curve`, a CURVE server admitting only curve.clients (required beyond loopback)."""
        self._check_pid()
        check_address(address, allow_remote=allow_remote, curve=curve is not None)
        if curve is not None:
            if self._zap is not None:
                raise ValueError(f"{self.name}: a socket binds with curve keys once")
            self._zap = curve_server(self.socket, curve, context())
        self.socket.bind(address)
        resolved = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        if resolved.startswith("ipc://"):
            self._bound_files.append(resolved[len("ipc://") :])
        return resolved

    def connect(
        self, address: str, *, allow_remote: bool = False, curve: ClientCurve | None = None
    ) -> None:
        """Connect; with `curve`, as a CURVE client (required beyond loopback)."""
        self._check_pid()
        check_address(address, allow_remote=allow_remote, curve=curve is not None)
        if curve is not None:
            curve_client(self.socket, curve)
        self.socket.connect(address)

    def close(self) -> None:
        """Close the socket (dropping unsent messages) and remove its ipc files. Idempotent."""
        if os.getpid() != self._pid:  # a forked copy: the parent's context is not ours to touch
            return
        self.socket.close(linger=0)
        if self._zap is not None:  # nobody is admitted to a closed socket's domain
            self._zap.revoke()
            self._zap = None
        for path in self._bound_files:  # libzmq also unlinks them, but later, in its own thread
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._bound_files.clear()

    @property
    def closed(self) -> bool:
        return self.socket.closed

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- frames -----------------------------------------------------------------------------
    def _send_frames(self, frames: list[bytes], timeout_ms: float | None) -> bool:
        self._check_pid()
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            try:
                self.socket.send_multipart(frames, flags=0 if deadline is None else zmq.NOBLOCK)
                return True
            except zmq.Again:
                left_ms = (deadline - time.monotonic()) * 1000 if deadline is not None else 0.0
                if left_ms <= 0:
                    return False
                # POLLOUT on a ROUTER means "some peer is writable", maybe not ours: recheck often
                router = self.socket.type == zmq.ROUTER
                self.socket.poll(min(math.ceil(left_ms), 1 if router else 1 << 30), zmq.POLLOUT)
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:  # ROUTER_MANDATORY: no such peer (any more)
                    return False
                raise

    def _recv_message(self, timeout_ms: float | None) -> tuple[list[bytes], Message] | None:
        """The next valid message (with its frames), skipping garbage; None on timeout."""
        self._check_pid()
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            left_ms = (
                None if deadline is None else max(0, math.ceil((deadline - time.monotonic()) * 1e3))
            )
            if not self.socket.poll(left_ms, zmq.POLLIN):
                return None
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # raced away (should not happen: one thread per socket)
                continue
            if len(frames) != self._frames:
                self._garbage(f"{len(frames)} frames, expected {self._frames}")
                continue
            try:
                msg = decode(frames[-1], self.max_message_bytes)
            except MessageError as e:
                self._garbage(str(e))
                continue
            if not isinstance(msg, self.accept):
                self._garbage(f"unexpected message type {type(msg).__name__}")
                continue
            return frames, msg

    def _garbage(self, reason: str) -> None:
        self.garbage_frames += 1
        if (self.garbage_frames - 1) % self.log_every == 0:
            log.warning(
                "%s: dropped an invalid message (%s); %d dropped so far",
                self.name,
                reason[:200],
                self.garbage_frames,
            )

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(f"{self.name}: a socket of pid {self._pid} used in {os.getpid()}")


class Channel(Endpoint):
    """One direction of a PUSH/PULL pipe. Typically the receiver binds and senders connect."""

    @classmethod
    def push(
        cls, address: str, *, bind: bool = False, allow_remote: bool = False, **options: Any
    ) -> Channel:
        """The sending end; options are Endpoint's (accept, max_message_bytes, hwm, ...)."""
        options.setdefault("name", f"push {address}")
        return cls(zmq.PUSH, **options)._attach(address, bind, allow_remote)

    @classmethod
    def pull(
        cls, address: str, *, bind: bool = True, allow_remote: bool = False, **options: Any
    ) -> Channel:
        """The receiving end; options are Endpoint's (accept, max_message_bytes, hwm, ...)."""
        options.setdefault("name", f"pull {address}")
        return cls(zmq.PULL, **options)._attach(address, bind, allow_remote)

    def _attach(self, address: str, bind: bool, allow_remote: bool) -> Channel:
        self.address = address  # the resolved one once bound
        try:
            if bind:
                self.address = self.bind(address, allow_remote=allow_remote)
            else:
                self.connect(address, allow_remote=allow_remote)
        except BaseException:
            self.close()
            raise
        return self

    def send(self, msg: Message, timeout_ms: float | None = None) -> bool:
        """Queue `msg`; False if it could not be queued within timeout_ms (HWM reached, or no
        receiver connected yet). MessageError if it cannot be encoded."""
        return self._send_frames([encode(msg, self.max_message_bytes)], timeout_ms)

    def recv(self, timeout_ms: float | None = None) -> Message | None:
        got = self._recv_message(timeout_ms)
        return None if got is None else got[1]


class Server(Endpoint):
    """ROUTER socket: many ClientSockets, replies routed by the identity they arrived with."""

    _frames = 2

    def __init__(
        self,
        address: str | None = None,
        *,
        allow_remote: bool = False,
        curve: ServerCurve | None = None,
        **options: Any,
    ) -> None:
        """Bind to `address` if given (with `curve`: see bind); options are Endpoint's (accept,
        max_message_bytes, ...)."""
        options.setdefault("name", f"server {address}")
        super().__init__(zmq.ROUTER, **options)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: an error, not a drop
        self.address = (
            None if address is None else self._bind_or_close(address, allow_remote, curve)
        )

    def _bind_or_close(self, address: str, allow_remote: bool, curve: ServerCurve | None) -> str:
        try:
            return self.bind(address, allow_remote=allow_remote, curve=curve)
        except BaseException:
            self.close()
            raise

    def recv(self, timeout_ms: float | None = None) -> tuple[bytes, Message] | None:
        """(client identity, message), or None on timeout."""
        got = self._recv_message(timeout_ms)
        return None if got is None else (got[0][0], got[1])

    def send(self, identity: bytes, msg: Message, timeout_ms: float | None = None) -> bool:
        """False if that client is gone (or its queue stayed full for timeout_ms)."""
        return self._send_frames([identity, encode(msg, self.max_message_bytes)], timeout_ms)


class ClientSocket(Endpoint):
    """DEALER socket connected to a Server; `identity` (optional) names it to the server."""

    def __init__(
        self,
        address: str | None = None,
        *,
        allow_remote: bool = False,
        curve: ClientCurve | None = None,
        identity: bytes | None = None,
        **options: Any,
    ) -> None:
        """Connect to `address` if given (with `curve`: see connect)."""
        options.setdefault("name", f"client {address}")
        super().__init__(zmq.DEALER, **options)
        if identity is not None:
            self.socket.setsockopt(zmq.ROUTING_ID, identity)
        try:
            if address is not None:
                self.connect(address, allow_remote=allow_remote, curve=curve)
        except BaseException:
            self.close()
            raise

    def send(self, msg: Message, timeout_ms: float | None = None) -> bool:
        return self._send_frames([encode(msg, self.max_message_bytes)], timeout_ms)

    def recv(self, timeout_ms: float | None = None) -> Message | None:
        got = self._recv_message(timeout_ms)
        return None if got is None else got[1]


def poll(endpoints: list[Endpoint], timeout_ms: float | None = None) -> list[Endpoint]:
    """The endpoints with a frame waiting (maybe garbage: recv(0) may still return None)."""
    poller = zmq.Poller()
    for ep in endpoints:
        poller.register(ep.socket, zmq.POLLIN)
    ready = dict(poller.poll(timeout_ms))
    return [ep for ep in endpoints if ready.get(ep.socket)]
