"""A worker bound with CurveZMQ (WorkerHandle(config, address, curve)): the cluster's client keys
get answers; a client with another key, or without curve, gets nothing processed; the secret
keys reach the supervisor through a pipe, never its argv or environment. (The sockets: see
tests/test_ipc_curve.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from instgenie import ipc
from instgenie import messages as m
from instgenie.config import Config, ModelConfig, WorkerConfig
from instgenie.curve import ClientCurve, CurveKeys
from instgenie.wire import WorkerToClient
from instgenie.worker.client import WorkerClient, WorkerHandle
from tests.conftest import make_image, make_mask, png_bytes
from tests.curve_helpers import free_tcp_port, handshake, send_raw, watch

SIZE = 64
QUIET_S = 3.0  # generous: a refused client is given this long to get anything back


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[WorkerHandle, CurveKeys]]:
    keys = CurveKeys.generate()
    config = Config(model=ModelConfig(model="sd2-inpaint:tiny"),
                    worker=WorkerConfig(max_batch=2, heartbeat_timeout_s=15.0))  # fmt: skip
    handle = WorkerHandle(config, address=f"tcp://127.0.0.1:{free_tcp_port()}", curve=keys)
    try:
        handle.wait_ready(timeout=240)  # its own client: keyed
        yield handle, keys
    finally:
        assert handle.close(drain=False, timeout=30) == 0


def _edit(uid: str) -> dict:
    image, mask = png_bytes(make_image(SIZE, SIZE)), png_bytes(make_mask(SIZE, SIZE))
    return dict(uid=uid, image=image, mask=mask, prompt="a hat", seed=1, num_inference_steps=2,
                paste_back=False)  # fmt: skip


def test_a_client_with_the_cluster_keys_gets_answers(worker) -> None:
    handle, keys = worker
    with WorkerClient(handle.address, curve=keys.client_side()) as client:
        done = client.run_edit(timeout=120, **_edit("keyed"))
        assert (done.uid, done.width, done.height, done.num_steps) == ("keyed", SIZE, SIZE, 2)
        assert client.stats()["ready"] == 1


def _refused_socket(address: str, curve: ClientCurve | None) -> ipc.ClientSocket:
    sock = ipc.ClientSocket(accept=WorkerToClient, name="refused")
    monitor = watch(sock.socket)
    sock.connect(address, curve=curve)
    assert handshake(sock.socket, monitor) == "failed"
    return sock


def test_clients_without_the_keys_get_nothing_processed(worker) -> None:
    handle, keys = worker
    before = handle.client.stats()
    stranger = CurveKeys.generate()
    unknown_key = ClientCurve(public=stranger.client_public, secret=stranger.client_secret,
                              server=keys.server_public)  # fmt: skip
    for curve in (unknown_key, None):
        with _refused_socket(handle.address, curve) as sock:
            # queued while a (doomed) connection attempt has a pipe, else dropped: never delivered
            sock.send(m.SubmitEdit(**_edit("intruder")), timeout_ms=500)
            sock.send(m.GetStats(), timeout_ms=500)
            send_raw(sock, b"\xc1 not a message")
            assert sock.recv(QUIET_S * 1000) is None
    with WorkerClient(handle.address, curve=unknown_key) as client:  # the client API, alike
        handle_ = client.edit(**_edit("intruder-2"))
        with pytest.raises(TimeoutError):
            client.stats(timeout=QUIET_S)
        assert not handle_.future.done()
    after = handle.client.stats()  # asked by a keyed client: nothing arrived from the others
    for counter in ("requests_accepted", "requests_rejected", "garbage_frames", "in_flight"):
        assert after[counter] == before[counter], counter


def _proc_bytes(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


def test_the_secret_keys_are_in_no_argv_or_environment(worker) -> None:
    handle, keys = worker
    stats = handle.client.stats()
    pids = {handle.pid} | {int(v) for k, v in stats.items() if k.startswith("pid_") and v}
    assert len(pids) >= 4  # supervisor, loop, pre, post
    secrets = [keys.server_secret.encode(), keys.client_secret.encode()]
    for pid in pids:
        cmdline, environ = _proc_bytes(pid, "cmdline"), _proc_bytes(pid, "environ")
        assert cmdline and environ
        leaked = [s in cmdline or s in environ for s in secrets]  # (no bytes in the message)
        assert not any(leaked), f"a secret key is in the argv or environment of pid {pid}"
    # the supervisor's stdin was the pipe the keys came through, read to its end
    assert str(Path(f"/proc/{handle.pid}/fd/0").readlink()).startswith("pipe:")
    assert handle.proc.stdin is not None and handle.proc.stdin.closed
