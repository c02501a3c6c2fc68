"""WorkerClient's socket thread survives what a caller hands it: a message that cannot be encoded
fails alone (invalid_request), a raising progress callback is logged, and the thread keeps
serving. No worker is needed: the messages fail before they leave the process."""

from __future__ import annotations

import pytest

from instgenie.ipc import ipc_address
from instgenie.messages import RegisterTemplate
from instgenie.worker.client import WorkerClient, WorkerError


def test_unencodable_messages_fail_alone_and_the_thread_lives() -> None:
    with WorkerClient(ipc_address("nobody")) as c:
        bad = c.edit(image=b"x", mask=b"m", prompt="a\ud800b", seed=0)  # lone surrogate
        with pytest.raises(WorkerError) as e:
            bad.result(timeout=10)
        assert e.value.code == "invalid_request" and "cannot be sent" in e.value.reason
        fut = c.submit_template(RegisterTemplate(template_id="ab" * 32, image=b"i",
                                                 prompt="\udcff", seed=0))  # fmt: skip
        with pytest.raises(WorkerError) as e:
            fut.result(timeout=10)
        assert e.value.code == "invalid_request"
        assert c._thread.is_alive()
        pending = c.edit(image=b"x", mask=b"m", prompt="fine", seed=0)  # encodes and is sent
        assert not pending.future.done()
    # closing fails what is still pending, with a typed error
    with pytest.raises(WorkerError) as e:
        pending.result(timeout=10)
    assert e.value.code == "client_closed"


def test_a_client_whose_socket_cannot_be_made_raises_instead_of_hanging() -> None:
    """A non-local address without CurveZMQ is refused by the socket thread: the constructor
    raises that error (it used to wait forever for a thread that had died)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(WorkerClient, "tcp://192.0.2.1:5555", allow_remote=True)
        with pytest.raises(ValueError, match="CurveZMQ"):
            fut.result(timeout=30)
