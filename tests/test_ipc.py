"""ipc: typed ZMQ endpoints; local addresses only, MAXMSGSIZE, garbage counted and survived."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from instgenie import ipc
from instgenie import messages as m
from instgenie import wire as w
from instgenie.curve import CurveKeys

SUBMIT = m.SubmitEdit(uid="u1", image=b"\x89PNG", mask=b"m", prompt="hat", seed=3)
GARBAGE = [
    b"",
    b"\xc1",
    os.urandom(64),
    msgpack.packb([1, 2, 3]),
    msgpack.packb(["Nope", w.SCHEMA_VERSION, {}]),
    msgpack.packb(["Cancel", w.SCHEMA_VERSION + 1, {"uid": "u"}]),
    w.encode(m.Cancel(uid="u"))[:-1],  # truncated
]


@pytest.fixture(autouse=True)
def no_socket_files() -> Iterator[None]:
    yield
    directory = Path(ipc.ipc_address("probe")[len("ipc://") :]).parent
    assert list(directory.iterdir()) == []


def test_push_pull_round_trip() -> None:
    addr = ipc.ipc_address("pipe")
    with ipc.Channel.pull(addr) as rx, ipc.Channel.push(addr) as tx:
        msgs = [
            SUBMIT,
            m.Cancel(uid="u1"),
            m.Heartbeat(pid=1, loop_iterations=2, in_flight=[], time=0.5),
        ]
        for msg in msgs:
            assert tx.send(msg, timeout_ms=1000)
        assert [rx.recv(1000) for _ in msgs] == msgs
        assert rx.recv(0) is None and rx.garbage_frames == 0


def test_router_dealer_routes_replies_by_identity() -> None:
    addr = ipc.ipc_address("srv")
    with ipc.Server(addr) as srv, ipc.ClientSocket(addr, identity=b"c1") as c1:
        with ipc.ClientSocket(addr) as c2:  # libzmq picks an identity
            c1.send(m.Cancel(uid="from1"))
            c2.send(m.Cancel(uid="from2"))
            got = dict((msg.uid, ident) for ident, msg in (srv.recv(1000), srv.recv(1000)))  # type: ignore[misc, union-attr]
            assert got["from1"] == b"c1"
            for uid, ident in got.items():
                assert srv.send(ident, m.Accepted(uid=uid, queue_position=0))
            assert c1.recv(1000) == m.Accepted(uid="from1", queue_position=0)
            assert c2.recv(1000) == m.Accepted(uid="from2", queue_position=0)
        assert srv.send(b"nobody", m.Accepted(uid="x", queue_position=0)) is False


def test_loopback_tcp_with_port_chosen_by_the_os() -> None:
    with ipc.Server("tcp://127.0.0.1:*") as srv:
        assert srv.address is not None and srv.address.startswith("tcp://127.0.0.1:")
        with ipc.ClientSocket(srv.address) as cli:
            assert cli.send(SUBMIT, timeout_ms=1000)
            got = srv.recv(2000)
            assert got is not None and got[1] == SUBMIT
            assert srv.send(got[0], m.Accepted(uid="u1", queue_position=0))
            assert cli.recv(2000) == m.Accepted(uid="u1", queue_position=0)


def test_timeouts() -> None:
    addr = ipc.ipc_address("t")
    with ipc.Channel.pull(addr) as rx, ipc.Channel.push(ipc.ipc_address("nobody"), bind=True) as tx:
        t0 = time.monotonic()
        assert rx.recv(0) is None
        assert time.monotonic() - t0 < 0.5  # does not wait for the 1 s below (load: preemption)
        t0 = time.monotonic()
        assert rx.recv(1000) is None
        assert 0.99 <= time.monotonic() - t0 < 5.0
        assert tx.send(SUBMIT, timeout_ms=50) is False  # no peer to queue for


@pytest.mark.parametrize("kind", ["server", "pull"])
def test_garbage_frames_are_counted_and_survived(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    addr = ipc.ipc_address("g")
    if kind == "server":
        ep: ipc.Endpoint = ipc.Server(addr, accept=w.ClientToWorker, log_every=3)
        raw = ipc.context().socket(zmq.DEALER)
    else:
        ep = ipc.Channel.pull(addr, accept=w.ClientToWorker, log_every=3)
        raw = ipc.context().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(addr)
    try:
        for frame in GARBAGE:
            raw.send(frame)
        raw.send_multipart([b"two", b"frames"])
        raw.send(w.encode(m.Abort(uid="u1", reason="x")))  # valid, but not client -> worker
        raw.send(w.encode(SUBMIT))
        with caplog.at_level(logging.WARNING, logger="instgenie.ipc"):
            got = ep.recv(2000)
        assert (got[1] if isinstance(got, tuple) else got) == SUBMIT
        assert ep.garbage_frames == len(GARBAGE) + 2
        assert len(caplog.records) == 3  # the 1st, 4th and 7th of 9
        raw.send(w.encode(m.Cancel(uid="again")))
        got = ep.recv(2000)
        assert (got[1] if isinstance(got, tuple) else got) == m.Cancel(uid="again")
    finally:
        raw.close()
        ep.close()


def test_maxmsgsize_and_linger_are_set_and_enforced() -> None:
    addr = ipc.ipc_address("big")
    with ipc.Server(addr, max_message_bytes=4096) as srv, ipc.ClientSocket(addr) as cli:
        for ep in (srv, cli):
            assert ep.socket.getsockopt(zmq.MAXMSGSIZE) == (
                4096 if ep is srv else w.MAX_MESSAGE_BYTES
            )
            assert ep.socket.getsockopt(zmq.LINGER) == 0
        big = m.SubmitEdit(uid="big", image=b"x" * 10_000, mask=b"", prompt="", seed=0)
        assert cli.send(big)  # libzmq drops it at the server and disconnects the peer
        assert srv.recv(200) is None
        with ipc.ClientSocket(addr, max_message_bytes=4096) as small:
            with pytest.raises(w.MessageError):  # the sender learns at once
                small.send(big)
            assert small.send(SUBMIT)
            assert srv.recv(2000)[1] == SUBMIT  # type: ignore[index]


@pytest.mark.parametrize(
    "address",
    [
        "tcp://0.0.0.0:*",
        "tcp://*:5555",
        "tcp://eth0:5555",
        "tcp://10.1.2.3:5555",
        "tcp://127.0.0.1:5555;10.0.0.1:5555",
        "ipc://@abstract",
        "ipc://",
        "ipc:///" + "x" * 200,
        "udp://127.0.0.1:5555",
        "ws://127.0.0.1:5555",
    ],
)
def test_non_local_addresses_are_refused(address: str) -> None:
    with pytest.raises(ValueError):
        ipc.Server(address)
    with pytest.raises(ValueError):
        ipc.ClientSocket(address)
    with pytest.raises(ValueError):
        ipc.Channel.pull(address)
    with pytest.raises(ValueError):
        ipc.Channel.push(address)


def test_allow_remote_is_explicit_and_needs_curve() -> None:
    """(CurveZMQ itself: tests/test_ipc_curve.py.)"""
    with pytest.raises(ValueError, match="without CurveZMQ"):
        ipc.Server("tcp://0.0.0.0:*", allow_remote=True)
    keys = CurveKeys.generate()
    with ipc.Server("tcp://0.0.0.0:*", allow_remote=True, curve=keys.server_side()) as srv:
        assert srv.address is not None and srv.address.startswith("tcp://0.0.0.0:")


def test_ipc_address_is_private_unique_and_cleaned_up() -> None:
    a, b = ipc.ipc_address("x"), ipc.ipc_address("x")
    assert a != b and a.startswith("ipc://")
    path = Path(a[len("ipc://") :])
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with ipc.Channel.pull(a):
        assert path.exists()
    assert not path.exists()
    for tag in ("", "../x", "a/b", "x" * 33):
        with pytest.raises(ValueError):
            ipc.ipc_address(tag)


def test_socket_refuses_use_in_a_forked_child() -> None:
    with ipc.Channel.pull(ipc.ipc_address("fork")) as rx:
        pid = os.fork()
        if pid == 0:  # child: never touch the parent's sockets; exit without cleanup handlers
            try:
                rx.recv(0)
                code = 1
            except RuntimeError:
                code = 0 if ipc.context() is not None else 2
            rx.close()  # a no-op here
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert rx.recv(0) is None  # still fine in the parent


def _spawned_client(address: str) -> None:
    with ipc.ClientSocket(address, identity=b"child") as cli:  # a fresh context in a fresh process
        cli.send(m.WorkerReady(pid=os.getpid(), model="fake", device="cpu"))
        reply = cli.recv(10_000)
        cli.send(m.Pong(nonce=reply.nonce, time=reply.time, pid=os.getpid()))  # type: ignore[union-attr]


def test_spawned_child_talks_to_the_server() -> None:
    addr = ipc.ipc_address("spawn")
    with ipc.Server(addr) as srv:
        child = mp.get_context("spawn").Process(target=_spawned_client, args=(addr,), daemon=True)
        child.start()
        try:
            ident, ready = srv.recv(30_000)  # type: ignore[misc]
            assert ident == b"child" and ready == m.WorkerReady(
                pid=child.pid, model="fake", device="cpu"
            )
            assert srv.send(ident, m.Ping(nonce=7, time=1.5))
            assert srv.recv(10_000) == (b"child", m.Pong(nonce=7, time=1.5, pid=child.pid))
            child.join(10)
            assert child.exitcode == 0
        finally:
            if child.is_alive():
                child.kill()
                child.join(5)


def test_poll_reports_ready_endpoints() -> None:
    a, b = ipc.ipc_address("a"), ipc.ipc_address("b")
    with ipc.Channel.pull(a) as ra, ipc.Channel.pull(b) as rb, ipc.Channel.push(b) as tb:
        assert ipc.poll([ra, rb], 0) == []
        tb.send(SUBMIT)
        assert ipc.poll([ra, rb], 1000) == [rb]
        assert rb.recv(0) == SUBMIT


_MAKES_A_DIR = (
    "import sys; from instgenie import ipc; "
    "print(ipc.ipc_address('t'), flush=True); "
    "sys.stdin.readline()"
)


def _process_with_an_ipc_dir() -> tuple[subprocess.Popen, Path]:
    """A process that has made its ipc directory; it exits normally when its stdin closes."""
    root = str(Path(ipc.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get(
        "PYTHONPATH")]))}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", _MAKES_A_DIR], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    address = proc.stdout.readline().strip()  # type: ignore[union-attr]
    directory = Path(address.removeprefix("ipc://")).parent
    assert directory.name.startswith(ipc.ipc_dir_prefix(proc.pid)) and directory.is_dir()
    return proc, directory


def test_a_process_removes_its_ipc_dir_at_a_normal_exit() -> None:
    proc, directory = _process_with_an_ipc_dir()
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert not directory.exists()


def test_the_ipc_dir_of_a_killed_process_is_removed_by_its_parent_or_later() -> None:
    """SIGKILL skips atexit: the parent removes the directory after reaping the process
    (remove_ipc_dirs, as WorkerHandle does for its supervisor); if the parent is gone too, the
    next process that makes an ipc directory removes those of dead pids, never a live one's."""
    live, live_dir = _process_with_an_ipc_dir()
    try:
        for how in ("by its parent", "later"):
            proc, directory = _process_with_an_ipc_dir()
            proc.kill()
            proc.communicate(timeout=30)
            assert directory.is_dir()  # the killed process could not remove it
            if how == "by its parent":
                ipc.remove_ipc_dirs(proc.pid)
            else:
                assert str(directory) in ipc.remove_stale_ipc_dirs()
            assert not directory.exists() and live_dir.is_dir()
    finally:
        live.communicate(timeout=30)
    assert live.returncode == 0
    assert not live_dir.exists()


def test_ipc_dirs_of_another_pid_namespace_are_never_taken_for_stale() -> None:
    """A container sharing the temp directory names its directories with its own pid namespace:
    a pid that looks dead here may be alive there, so its directory stays."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.communicate(timeout=30)  # a pid that no process of this namespace has now
    here = Path(tempfile.mkdtemp(prefix=ipc.ipc_dir_prefix(proc.pid)))
    other_ns = ipc.ipc_dir_prefix(proc.pid).replace(ipc._pid_namespace(), "1", 1)
    there = Path(tempfile.mkdtemp(prefix=other_ns))
    try:
        removed = ipc.remove_stale_ipc_dirs()
        assert str(here) in removed and not here.exists()
        assert there.is_dir() and str(there) not in removed
    finally:
        shutil.rmtree(there, ignore_errors=True)
        shutil.rmtree(here, ignore_errors=True)
