"""ipc with CurveZMQ: a curve-bound socket admits exactly its configured client keys (ZAP), a
socket beyond loopback without curve is refused, and what is refused never reaches the socket."""

from __future__ import annotations

import pytest

from instgenie import ipc
from instgenie import messages as m
from instgenie.curve import ClientCurve, CurveKeys
from tests.curve_helpers import handshake, send_raw, watch

KEYS, OTHER = CurveKeys.generate(), CurveKeys.generate()
QUIET_MS = 1500  # how long a refused client is given to get anything through (it never does)


def _client(address: str, curve: ClientCurve | None) -> tuple[ipc.ClientSocket, str]:
    """A client that has connected, and how its handshake ended ("ok" or "failed")."""
    cli = ipc.ClientSocket(name="probe")
    monitor = watch(cli.socket)
    cli.connect(address, curve=curve)
    return cli, handshake(cli.socket, monitor)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:*", "ipc"])
def test_a_client_with_the_right_keys_talks_both_ways(address: str) -> None:
    address = ipc.ipc_address("curve") if address == "ipc" else address
    with ipc.Server(address, curve=KEYS.server_side()) as srv:
        cli, outcome = _client(srv.address, KEYS.client_side())  # type: ignore[arg-type]
        with cli:
            assert outcome == "ok"
            assert cli.send(m.Cancel(uid="u1"), timeout_ms=5000)
            ident, msg = srv.recv(10_000)  # type: ignore[misc]
            assert msg == m.Cancel(uid="u1")
            assert srv.send(ident, m.Accepted(uid="u1", queue_position=0), timeout_ms=5000)
            assert cli.recv(10_000) == m.Accepted(uid="u1", queue_position=0)


REFUSED = {  # what ZAP refuses; what the CURVE handshake itself refuses; no handshake at all
    "an unknown client key": ClientCurve(
        public=OTHER.client_public, secret=OTHER.client_secret, server=KEYS.server_public
    ),
    "the right client key, expecting another server": ClientCurve(
        public=KEYS.client_public, secret=KEYS.client_secret, server=OTHER.server_public
    ),
    "no curve": None,
}


@pytest.mark.parametrize("who", list(REFUSED))
def test_refused_clients_get_nothing_through(who: str) -> None:
    with ipc.Server("tcp://127.0.0.1:*", curve=KEYS.server_side()) as srv:
        cli, outcome = _client(srv.address, REFUSED[who])  # type: ignore[arg-type]
        with cli:
            assert outcome == "failed"
            # queued while a (doomed) connection attempt has a pipe, else dropped: never delivered
            cli.send(m.Cancel(uid="refused"), timeout_ms=500)
            send_raw(cli, b"\xc1garbage")
            assert srv.recv(QUIET_MS) is None
            assert srv.garbage_frames == 0  # not even seen as garbage
        good, outcome = _client(srv.address, KEYS.client_side())
        with good:  # the socket still serves the right keys
            assert outcome == "ok" and good.send(m.Cancel(uid="ok"), timeout_ms=5000)
            assert srv.recv(10_000)[1] == m.Cancel(uid="ok")  # type: ignore[index]


def test_each_bound_socket_admits_only_its_own_clients() -> None:
    """One ZAP handler per process, one allow list per socket: keys of one cluster do not open
    another's socket."""
    with (
        ipc.Server("tcp://127.0.0.1:*", curve=KEYS.server_side()) as a,
        ipc.Server("tcp://127.0.0.1:*", curve=OTHER.server_side()) as b,
    ):
        for srv, keys in ((a, KEYS), (b, OTHER)):
            cli, got = _client(srv.address, keys.client_side())  # type: ignore[arg-type]
            cli.close()
            assert got == "ok"
        # OTHER's client key, but speaking to a's server key: a's handler does not know it
        cross = ClientCurve(public=OTHER.client_public, secret=OTHER.client_secret,
                            server=KEYS.server_public)  # fmt: skip
        cli, got = _client(a.address, cross)  # type: ignore[arg-type]
        cli.close()
        assert got == "failed"


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:*", "tcp://*:0", "tcp://10.1.2.3:5555"])
def test_beyond_loopback_needs_curve_even_with_allow_remote(address: str) -> None:
    with pytest.raises(ValueError, match="without CurveZMQ"):
        ipc.Server(address, allow_remote=True)
    with pytest.raises(ValueError, match="without CurveZMQ"):
        ipc.ClientSocket(address, allow_remote=True)
    with pytest.raises(ValueError, match="without CurveZMQ"):
        ipc.Channel.pull(address, allow_remote=True)
    with pytest.raises(ValueError, match="refusing non-local address"):  # still explicit
        ipc.Server(address, curve=KEYS.server_side())


def test_beyond_loopback_with_curve_binds() -> None:
    with ipc.Server("tcp://0.0.0.0:*", allow_remote=True, curve=KEYS.server_side()) as srv:
        assert srv.address is not None and srv.address.startswith("tcp://0.0.0.0:")
        port = srv.address.rsplit(":", 1)[1]
        cli, outcome = _client(f"tcp://127.0.0.1:{port}", KEYS.client_side())
        cli.close()
        assert outcome == "ok"
    with ipc.ClientSocket("tcp://10.1.2.3:5555", allow_remote=True, curve=KEYS.client_side()):
        pass  # connecting is asynchronous: allowed, nothing sent in clear text
