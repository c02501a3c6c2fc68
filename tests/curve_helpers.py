"""Test helpers for CurveZMQ sockets: how a connection attempt ended, seen by the client."""

from __future__ import annotations

import secrets
import socket
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from instgenie import ipc

_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
)


def watch(sock: zmq.Socket) -> zmq.Socket:
    """A monitor of `sock`'s handshakes; call before it connects. Its endpoint is unique (pyzmq's
    default is named by the socket's fd, which a socket closed moments ago may still hold)."""
    address = f"inproc://curve-monitor-{secrets.token_hex(8)}"
    sock.monitor(address, zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(_FAILED))
    monitor = sock.context.socket(zmq.PAIR)
    monitor.connect(address)
    return monitor


def handshake(sock: zmq.Socket, monitor: zmq.Socket, timeout_s: float = 30.0) -> str:
    """The first handshake outcome `sock`'s monitor reports, "ok" or "failed" (TimeoutError if
    none within timeout_s). The monitor is then stopped and closed (stopped first: libzmq's
    monitor blocks the context's I/O thread once events pile up unread)."""
    deadline = time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            if monitor.poll(int(left * 1000) + 1):
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return "ok"
                if event in _FAILED:
                    return "failed"
        raise TimeoutError("no handshake outcome")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def free_tcp_port() -> int:
    """A loopback port free now (the OS's pick; a socket bound to it later may race another)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send_raw(endpoint: ipc.Endpoint, frame: bytes, timeout_s: float = 0.5) -> None:
    """Send one frame of raw bytes (not a message) if the socket queues it within timeout_s."""
    if endpoint.socket.poll(int(timeout_s * 1000), zmq.POLLOUT):
        try:
            endpoint.socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass
