"""A small in-process client of one worker (tests, the load tester, the API server's dispatcher).

`WorkerClient(address)` talks to a running worker; `start_worker(config)` also starts one as a
subprocess (`python -m instgenie.worker.lifeline supervisor`) and returns a `WorkerHandle`.
The worker dies with the *thread* that started it (PR_SET_PDEATHSIG, see worker.lifeline): start
workers from a thread that lives as long as they should.

Threads: one background thread owns the ZMQ socket (sockets are single-threaded); callers on any
thread queue messages to it and wait on futures. Replies are matched by request uid (edits), by
template id (templates) and in order (stats, step log: the worker answers those at once).
If the worker process exits, every pending future fails with `worker_died` (WorkerHandle).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import zmq

import instgenie
from instgenie.config import Config, to_dict
from instgenie.curve import ClientCurve, CurveKeys
from instgenie.errors import EXIT_MODEL_LOAD, InstGenIEError
from instgenie.ipc import ClientSocket, ipc_address, remove_ipc_dirs
from instgenie.messages import (
    Accepted,
    Cancel,
    CostSpec,
    DropTemplate,
    EditDone,
    EditFailed,
    GetStats,
    GetStepLog,
    Progress,
    RegisterTemplate,
    Shutdown,
    Stats,
    StepEntry,
    StepLog,
    SubmitEdit,
    TemplateReady,
)
from instgenie.wire import Message, MessageError, WorkerToClient
from instgenie.worker.names import shm_base

log = logging.getLogger("instgenie.worker.client")


class WorkerError(InstGenIEError):
    """A request the worker answered with EditFailed (or a failed template / a dead worker)."""

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.reason = message
        self.retryable = retryable


@dataclass
class EditHandle:
    uid: str
    future: Future = field(default_factory=Future)  # -> EditDone, or raises WorkerError
    #: steps done so far, as Progress messages arrived (1..num_steps)
    progress: list[int] = field(default_factory=list)
    num_steps: int | None = None  # steps it runs in all, from its Progress (after strength)
    on_progress: Callable[[Progress], None] | None = None
    queue_position: int | None = None  # from Accepted
    submitted_at: float = field(default_factory=time.monotonic)

    def result(self, timeout: float | None = None) -> EditDone:
        return self.future.result(timeout)


class WorkerClient:
    def __init__(
        self, address: str, *, allow_remote: bool = False, curve: ClientCurve | None = None
    ) -> None:
        """Talk to the worker at `address`. With `curve` (the cluster's CurveKeys.client_side())
        the socket is a CURVE client, which a worker bound with curve requires, and `address`
        may be non-loopback (curve is the opt-in: allow_remote is implied)."""
        self.address = address
        self._allow_remote = allow_remote or curve is not None
        self._curve = curve
        self._outgoing: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._edits: dict[str, EditHandle] = {}
        self._templates: defaultdict[str, list[Future]] = defaultdict(list)
        self._stats: deque[Future] = deque()
        self._steplogs: deque[Future] = deque()
        self._uids = itertools.count()
        self._prefix = secrets.token_hex(4)
        self._closed = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None  # the socket could not be made
        self._thread = threading.Thread(target=self._run, name="worker-client", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:  # e.g. a non-local address without curve
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise self._start_error

    # ---- requests -------------------------------------------------------------------------------
    def new_uid(self) -> str:
        return f"{self._prefix}-{next(self._uids)}"

    def submit(
        self, msg: SubmitEdit, on_progress: Callable[[Progress], None] | None = None
    ) -> EditHandle:
        handle = EditHandle(msg.uid, on_progress=on_progress)
        with self._lock:
            if msg.uid in self._edits:
                raise ValueError(f"uid {msg.uid!r} is already in flight on this client")
            self._edits[msg.uid] = handle
        self._send(msg)
        return handle

    def edit(self, **fields) -> EditHandle:
        """Submit SubmitEdit(**fields); uid defaults to a fresh one."""
        fields.setdefault("uid", self.new_uid())
        fields.setdefault("submitted_at", time.time())
        return self.submit(SubmitEdit(**fields))

    def run_edit(self, timeout: float | None = 600.0, **fields) -> EditDone:
        return self.edit(**fields).result(timeout)

    def cancel(self, uid: str) -> None:
        self._send(Cancel(uid=uid))

    def submit_template(self, msg: RegisterTemplate) -> Future:
        """Register and build a template without waiting: a future of its TemplateReady (ok or
        not), or WorkerError if the worker died. Sent in order with later submissions, so an
        edit submitted afterwards finds the template registered."""
        fut: Future = Future()
        with self._lock:
            self._templates[msg.template_id].append(fut)
        self._send(msg)
        return fut

    def register_template(
        self, msg: RegisterTemplate, timeout: float | None = 600.0
    ) -> TemplateReady:
        """Register and build a template; returns when its cache is ready (WorkerError if not)."""
        fut = self.submit_template(msg)
        try:
            reply: TemplateReady = fut.result(timeout)
        except TimeoutError:
            with self._lock:
                waiting = self._templates.get(msg.template_id, [])
                if fut in waiting:
                    waiting.remove(fut)
            raise
        if not reply.ok:
            raise WorkerError("template_failed", reply.message)
        return reply

    def drop_template(self, template_id: str) -> None:
        """Forget a template and delete its cache (pending registrations of it fail)."""
        self._send(DropTemplate(template_id=template_id))

    def stats(self, timeout: float | None = 10.0) -> dict[str, float]:
        return self._ask(self._stats, GetStats(), timeout).counters

    def report(self, timeout: float | None = 10.0) -> Stats:
        """The whole Stats answer: counters and where each template's cache lives (residency)."""
        return self._ask(self._stats, GetStats(), timeout)

    def cost_spec(self, timeout: float | None = 10.0) -> CostSpec | None:
        """The loop's CostSpec (how the router prices this worker's batches); None until the
        loop has reported it."""
        return self._ask(self._stats, GetStats(cost=True), timeout).cost

    def step_log(self, since_step: int = 0, timeout: float | None = 10.0) -> list[StepEntry]:
        return self._ask(self._steplogs, GetStepLog(since_step=since_step), timeout).entries

    def wait_ready(self, timeout: float = 300.0) -> dict[str, float]:
        """Poll stats until the worker's processes are all up; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                counters = self.stats(timeout=min(2.0, max(0.1, deadline - time.monotonic())))
                if counters.get("ready"):
                    return counters
            except TimeoutError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker at {self.address} not ready after {timeout} s")
            time.sleep(0.1)

    def shutdown(self, drain: bool = True) -> None:
        self._send(Shutdown(drain=drain))

    def _ask(self, waiters: deque[Future], msg: Message, timeout: float | None):
        fut: Future = Future()
        with self._lock:
            waiters.append(fut)
        self._send(msg)
        try:
            return fut.result(timeout)
        except TimeoutError:
            with self._lock:
                if fut in waiters:
                    waiters.remove(fut)
            raise

    # ---- failure of the whole worker ------------------------------------------------------------
    def fail_all(self, code: str, message: str, retryable: bool = True) -> None:
        """Fail every pending future (the worker is gone)."""
        with self._lock:
            edits, self._edits = self._edits, {}
            templates, self._templates = self._templates, defaultdict(list)
            waiters = [*self._stats, *self._steplogs]
            self._stats.clear()
            self._steplogs.clear()
        err = WorkerError(code, message, retryable)
        for fut in [h.future for h in edits.values()] + waiters + sum(templates.values(), []):
            if not fut.done():
                fut.set_exception(err)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._outgoing.put(None)
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.fail_all("client_closed", "the client was closed", retryable=False)

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- socket thread --------------------------------------------------------------------------
    def _send(self, msg: Message) -> None:
        if self._closed:
            raise RuntimeError("client is closed")
        self._outgoing.put(msg)
        os.write(self._wake_w, b"x")

    def _run(self) -> None:
        try:
            sock = ClientSocket(self.address, allow_remote=self._allow_remote, curve=self._curve,
                                accept=WorkerToClient)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - raised by the constructor, which waits
            self._start_error = exc
            self._started.set()
            return
        poller = zmq.Poller()
        poller.register(sock.socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._started.set()
        try:
            while True:
                events = dict(poller.poll())
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                    while True:
                        try:
                            msg = self._outgoing.get_nowait()
                        except queue.Empty:
                            break
                        if msg is None:
                            return
                        try:
                            sock.send(msg)
                        except MessageError as exc:  # this message cannot be encoded: it alone
                            self._refuse(msg, str(exc))
                while (reply := sock.recv(0)) is not None:
                    try:
                        self._on_reply(reply)
                    except Exception:  # a caller's callback: never the socket thread's end
                        log.exception("worker client: handling %s failed", type(reply).__name__)
        finally:
            sock.close()
            if not self._closed:  # died unexpectedly: nobody will answer what is pending
                self._closed = True
                self.fail_all("client_failed", "the worker client's socket thread stopped")

    def _refuse(self, msg: Message, why: str) -> None:
        """Fail the future(s) of a message that could not be sent (invalid_request)."""
        err = WorkerError("invalid_request", f"cannot be sent to the worker: {why}")
        with self._lock:
            if isinstance(msg, SubmitEdit):
                futs = [h.future for h in [self._edits.pop(msg.uid, None)] if h is not None]
            elif isinstance(msg, RegisterTemplate):
                futs = self._templates.pop(msg.template_id, [])
            else:
                futs = []
        for fut in futs:
            if not fut.done():
                fut.set_exception(err)

    def _on_reply(self, msg: Message) -> None:
        if isinstance(msg, (EditDone, EditFailed)):
            with self._lock:
                handle = self._edits.pop(msg.uid, None)
            if handle is None:
                return
            if isinstance(msg, EditDone):
                handle.future.set_result(msg)
            else:
                handle.future.set_exception(WorkerError(msg.code, msg.message, msg.retryable))
        elif isinstance(msg, Progress):
            handle = self._edits.get(msg.uid)
            if handle is not None:
                if msg.step > 0:  # a denoise step (else a stage report)
                    handle.num_steps = msg.num_steps  # before the step: readers check progress
                    handle.progress.append(msg.step)
                if handle.on_progress is not None:
                    handle.on_progress(msg)
        elif isinstance(msg, Accepted):
            handle = self._edits.get(msg.uid)
            if handle is not None:
                handle.queue_position = msg.queue_position
        elif isinstance(msg, TemplateReady):
            with self._lock:
                futs = self._templates.pop(msg.template_id, [])
            for fut in futs:
                fut.set_result(msg)
        elif isinstance(msg, (Stats, StepLog)):
            waiters = self._stats if isinstance(msg, Stats) else self._steplogs
            with self._lock:
                fut = waiters.popleft() if waiters else None
            if fut is not None:
                fut.set_result(msg)


class WorkerHandle:
    """A worker started as a subprocess, with a connected client. Closing shuts it down.

    With `curve` (the cluster's CurveKeys) the worker's socket is a CURVE server admitting only
    curve's client key, `address` may be non-loopback (e.g. `tcp://0.0.0.0:PORT`; a fixed
    port: the address clients connect to is this one), and this handle's own client connects
    with curve.client_side(). The server keys reach the supervisor through its stdin (a pipe,
    closed once written), never its argv or environment."""

    def __init__(
        self, config: Config, address: str | None = None, curve: CurveKeys | None = None
    ) -> None:
        self.address = address or ipc_address("worker")
        #: the socket file of an address made here (our private ipc directory): removed once the
        #: supervisor has exited, which it cannot do itself when killed
        self._own_socket = Path(self.address.removeprefix("ipc://")) if address is None else None
        spec = {"address": self.address, "config": to_dict(config), "die_with_parent": True,
                "parent": os.getpid(), "curve_stdin": curve is not None}  # fmt: skip
        env = dict(os.environ)
        root = str(Path(instgenie.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "instgenie.worker.lifeline", "supervisor", json.dumps(spec)]
        stdin = subprocess.DEVNULL if curve is None else subprocess.PIPE
        self.proc = subprocess.Popen(cmd, env=env, stdin=stdin)
        if curve is not None:
            _write_secret(self.proc, json.dumps(curve.server_side().to_dict()).encode())
        self.client = WorkerClient(self.address, curve=curve and curve.client_side())
        self._watch = threading.Thread(target=self._watch_exit, daemon=True)
        self._watch.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 300.0) -> dict[str, float]:
        """The client's wait_ready, but a supervisor that exits meanwhile (e.g. its model cannot
        be loaded) is reported at once: RuntimeError, not a TimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                why = ": its model could not be loaded (the error is logged above)"
                raise RuntimeError(f"worker exited with status {rc} before it was ready"
                                   f"{why if rc == EXIT_MODEL_LOAD else ''}")  # fmt: skip
            try:
                return self.client.wait_ready(min(1.0, max(0.0, deadline - time.monotonic())))
            except WorkerError:  # the supervisor exited: its status says why (above)
                self.proc.wait(10)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"worker at {self.address} not ready after {timeout} s"
                    ) from None

    def _watch_exit(self) -> None:
        rc = self.proc.wait()
        from instgenie.tensorshm import cleanup  # (torch: not at import time of the API process)

        cleanup(shm_base(self.proc.pid))  # segments of children it could not clean up itself
        remove_ipc_dirs(self.proc.pid)  # its ipc directory, if it could not remove it (killed)
        if self._own_socket is not None:
            self._own_socket.unlink(missing_ok=True)
        self.client.fail_all("worker_died", f"the worker supervisor exited with status {rc}")

    def close(self, drain: bool = True, timeout: float = 60.0) -> int:
        """Shut the worker down (drain: finish in-flight requests) and return its exit status."""
        if self.proc.poll() is None:
            try:
                self.client.shutdown(drain=drain)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, RuntimeError):
                self.proc.kill()
                self.proc.wait()
        self.client.close()
        return self.proc.returncode

    def __enter__(self) -> WorkerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(drain=False)


def _write_secret(proc: subprocess.Popen, data: bytes) -> None:
    """Hand `data` to `proc` on its stdin pipe and close it (a few hundred bytes: the pipe
    buffer takes them without blocking). A process that died first reads nothing: its exit
    status tells why (wait_ready)."""
    assert proc.stdin is not None
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except BrokenPipeError:
        pass


def start_worker(
    config: Config,
    *,
    address: str | None = None,
    curve: CurveKeys | None = None,
    timeout: float = 300.0,
):
    """Start a worker subprocess and wait until it serves; the caller closes the handle."""
    handle = WorkerHandle(config, address, curve)
    try:
        handle.wait_ready(timeout)
    except BaseException:
        handle.close(drain=False)
        raise
    return handle
