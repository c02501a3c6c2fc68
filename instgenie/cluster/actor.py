"""`WorkerActor`: one worker's process tree on a Ray node.

The actor is the worker supervisor's parent: it starts `python -m instgenie.worker.lifeline
supervisor` (worker.client.WorkerHandle) from a thread of its own that lives exactly as long as
the supervisor, so the supervisor - and its loop, pre and post children (PR_SET_PDEATHSIG) - die
with the actor however it ends: ray.kill, its node leaving, a crash.
The supervisor binds tcp://<node ip>:<free port>, guarded by CurveZMQ: the keys come through Ray
as the actor's constructor argument and reach the supervisor through its stdin (never argv, the
environment or a file). The API process connects to that address itself: requests and results
never pass through Ray.
Node-local settings: the cache settings left "auto" (--cache-root, the DRAM and disk budgets) are
resolved on the node (cache/budgets.resolve_cache: its INSTGENIE_CACHE_ROOT, its memory, its
disk), so each node's workers use that node's local disk and shared memory
(`INSTGENIE_CACHE_ROOT=/local/nvme ray start ...`; several nodes on one machine in tests).
Concurrency: max_concurrency=4, so `wait_exit` - held by the API process for as long as the
worker lives - runs beside `start` and `stop`.
"""

from __future__ import annotations

import dataclasses
import socket
import threading

import ray

from instgenie.cache.budgets import resolve_cache
from instgenie.config import Config, from_dict
from instgenie.curve import CurveKeys
from instgenie.worker.client import WorkerHandle


def node_config(config: dict) -> Config:
    """The worker's config on this node: the server's, its "auto" cache settings resolved here."""
    cfg = from_dict(Config, config)
    return dataclasses.replace(cfg, worker=resolve_cache(cfg.worker)[0])


def free_port(ip: str) -> int:
    """A TCP port free on `ip` now (the OS's choice; the supervisor binds it right after)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def tcp_address(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


@ray.remote(max_concurrency=4)
class WorkerActor:
    def __init__(self, config: dict, keys: dict, index: int) -> None:
        self.config = node_config(config)
        self.keys = CurveKeys.from_dict(keys)
        self.index = index  # the server's slot index (logs)
        self._handle: WorkerHandle | None = None
        self._spawned = threading.Event()
        self._exited = threading.Event()
        self._error = ""
        self._rc: int | None = None

    def start(self, timeout_s: float) -> dict:
        """Start the worker and wait until it serves: {"address", "node", "node_ip", "pid",
        "hostname", "cache_root"}; raises what failed (the supervisor is stopped then)."""
        ip = ray.util.get_node_ip_address()
        address = tcp_address(ip, free_port(ip))
        threading.Thread(
            target=self._own, args=(address,), name="worker-owner", daemon=True
        ).start()
        self._spawned.wait()
        if self._handle is None:
            raise RuntimeError(f"worker {self.index}: cannot start its supervisor: {self._error}")
        try:
            self._handle.wait_ready(timeout_s)
        except BaseException:
            self._handle.close(drain=False, timeout=5)
            raise
        return {
            "address": address,
            "node": ray.get_runtime_context().get_node_id(),
            "node_ip": ip,
            "pid": self._handle.pid,
            "hostname": socket.gethostname(),
            "cache_root": self.config.worker.cache_root,
        }

    def _own(self, address: str) -> None:
        """Spawn the supervisor and stay alive until it exits (its parent-death signal is tied to
        this thread)."""
        try:
            self._handle = WorkerHandle(self.config, address=address, curve=self.keys)
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = f"{type(exc).__name__}: {exc}"
            self._spawned.set()
            self._exited.set()
            return
        self._spawned.set()
        self._rc = self._handle.proc.wait()
        self._exited.set()

    def wait_exit(self) -> int:
        """Block until the supervisor exits; its exit status."""
        self._exited.wait()
        return self._rc if self._rc is not None else -1

    def stop(self, drain: bool, timeout_s: float) -> int:
        """Shut the worker down (drain: finish what it holds); its exit status."""
        if self._handle is None:
            return 0
        return self._handle.close(drain=drain, timeout=timeout_s)
