"""`instgenie serve`: one worker per device, the API + scheduler process, clean shutdown.

Start-up: bind the HTTP socket (a busy port fails before any worker starts), open the state
database (an unusable one fails before any worker starts too), start every worker in parallel
and wait for all ready handshakes, then serve (the stored templates are built on the workers).
SIGTERM/SIGINT: drain - new requests get 503 while in-flight ones finish (up to
drain_timeout_s) - then stop HTTP, shut the workers down (drain) and exit 0. A second
SIGINT/SIGTERM stops at once (exit 1). Workers die with this process in any case
(PR_SET_PDEATHSIG in the worker supervisor).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from instgenie.cache.budgets import CacheDefaults, resolve_cache
from instgenie.config import Config, LimitsConfig, ModelConfig, WorkerConfig
from instgenie.engine.sizing import native_side, resolve_limits
from instgenie.logs import setup_process
from instgenie.server.config import WORKERS_AUTO, ServerConfig, check_server_config
from instgenie.server.state_db import DEFAULT_NAME, StateDB, StateDBError

if TYPE_CHECKING:
    from instgenie.server.runtime import Runtime

log = logging.getLogger("instgenie.server")

EXIT_BAD_CONFIG = 2  # a flag value that cannot work; 1: start-up failed or not drained


class _Interrupted(BaseException):
    """A signal arrived during start-up."""


class DrainingServer(uvicorn.Server):
    """uvicorn, with its signal handling replaced by drain-then-exit (and no re-raise of the
    signal afterwards, so the process exits 0)."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.drain_timeout_s = drain_timeout_s
        self.drained: bool | None = None  # None: no drain started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: object) -> None:
        if self._loop is None or self.drained is not None:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            self.drained = False
            return
        self.drained = False
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain(sig))

    async def _drain(self, sig: int) -> None:
        log.warning(
            "%s: draining (new requests get 503; in-flight ones finish)", signal.Signals(sig).name
        )
        ok = await self.runtime.drain(self.drain_timeout_s)
        if not ok:
            log.error("drain timed out after %.0f s; stopping anyway", self.drain_timeout_s)
        self.drained = ok and not self.force_exit
        self.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def state_path(server: ServerConfig, worker: WorkerConfig) -> Path | None:
    """Where the server keeps its state (ServerConfig.state_db); None: in memory only. `worker`'s
    cache root is resolved (resolve_cache)."""
    if server.state_db.lower() == "none":
        return None
    if server.state_db:
        return Path(server.state_db)
    return Path(worker.cache_root) / DEFAULT_NAME if worker.cache_root else None


def lora_dir(server: ServerConfig, worker: WorkerConfig) -> tuple[Path, bool]:
    """(the directory of registered LoRA files, whether it is a temporary one) for
    WorkerConfig.lora.lora_dir: the flag's, else "loras" beside the state database
    (state_path), else, with the state in memory, a temporary directory created now (removed
    at exit: registered LoRAs are lost on restart, as templates are). `worker`'s cache root is
    resolved."""
    if worker.lora.lora_dir:
        return Path(worker.lora.lora_dir), False
    state = state_path(server, worker)
    if state is not None:
        return state.parent / "loras", False
    return Path(tempfile.mkdtemp(prefix="instgenie-loras-")), True


def _cluster_pool(server: ServerConfig, config: Config):
    """(fleet, pool) of a cluster server: connected to Ray, one slot per worker the nodes alive
    now should run (cluster/fleet.py); more come as nodes join (cluster/membership.py)."""
    from instgenie.cluster.fleet import Fleet, wanted  # (imports Ray: cluster mode only)
    from instgenie.server.pool import WorkerPool

    per_node = None if server.workers == WORKERS_AUTO else int(server.workers)
    fleet = Fleet(server.cluster, config, per_node, server.worker_start_timeout_s)
    try:
        nodes = fleet.nodes()
        want = wanted(nodes, per_node, fleet.gpu)
        ips = {n.node: n.ip for n in nodes}
        placed = [(node, ips[node]) for node, n in sorted(want.items()) for _ in range(n)]
        if not placed:
            kind = "a GPU" if fleet.gpu else "room for a worker"
            raise RuntimeError(f"no alive node offers {kind} ({len(nodes)} node(s) known)")
        slot_config = fleet.slot_config()
        pool = WorkerPool(
            [slot_config] * len(placed),
            server.worker_slots,
            server.worker_start_timeout_s,
            launch=fleet.launch,
            nodes=placed,
        )
    except BaseException:
        fleet.close()
        raise
    return fleet, pool


def serve(
    model: ModelConfig,
    devices: list[str],
    worker: WorkerConfig,
    limits: LimitsConfig,
    server: ServerConfig,
) -> int:
    """Run the server until a signal; the exit status (0: drained and stopped cleanly)."""
    setup_process("api")
    try:
        check_server_config(server)
        if not devices:
            raise ValueError("devices: at least one device is required")
    except ValueError as exc:
        print(f"instgenie serve: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG
    # max_image_pixels = 0: the family's default, resolved once for the server and its workers
    limits = resolve_limits(limits, native_side(model.model))
    # the cache root and the host tiers' budgets ("auto": from the machine), resolved once too:
    # every worker, this log and /health show the same values. In cluster mode each node
    # resolves its own (its disk, its memory: cluster/actor.py); here only the state database's
    # place is derived from this host's.
    node_worker = worker
    worker, cache = resolve_cache(worker)
    # every worker reads registered LoRA files from the one directory the API writes them to
    # (in cluster mode, a path every node must see: a shared filesystem)
    loras, loras_tmp = lora_dir(server, worker)
    try:
        loras.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"instgenie serve: lora_dir {loras}: {exc}", file=sys.stderr, flush=True)
        return 1
    worker, node_worker = (
        dataclasses.replace(w, lora=dataclasses.replace(w.lora, lora_dir=str(loras)))
        for w in (worker, node_worker)
    )
    if server.cluster:
        print("instgenie: cluster mode: each node resolves its cache settings (its "
              "INSTGENIE_CACHE_ROOT, memory and disk)", file=sys.stderr, flush=True)  # fmt: skip
    else:
        print(f"instgenie: {cache.describe()}", file=sys.stderr, flush=True)
    configs = [
        Config(
            model=dataclasses.replace(model, device=d),
            limits=limits,
            worker=node_worker if server.cluster else worker,
        )  # fmt: skip
        for d in devices
    ]
    try:
        return _serve_state(model, devices, server, worker, configs, cache)
    finally:
        if loras_tmp:
            shutil.rmtree(loras, ignore_errors=True)


def _serve_state(
    model: ModelConfig,
    devices: list[str],
    server: ServerConfig,
    worker: WorkerConfig,
    configs: list[Config],
    cache: CacheDefaults,
) -> int:
    try:
        sock = _bind(server.host, server.port)
    except OSError as exc:
        print(
            f"instgenie: cannot listen on {server.host}:{server.port}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    path = state_path(server, worker)
    try:
        state = StateDB(path) if path is not None else None
    except StateDBError as exc:
        print(f"instgenie serve: {exc}", file=sys.stderr, flush=True)
        sock.close()
        return 1
    if state is None:
        print("instgenie: no cache root and no --state-db: templates and async jobs are kept "
              "in memory only (lost on restart)", file=sys.stderr, flush=True)  # fmt: skip
    else:
        print(f"instgenie: state in {path} (templates and finished async jobs survive a "
              "restart)", file=sys.stderr, flush=True)  # fmt: skip
    try:
        return _serve(model, devices, server, configs, sock, state, cache)
    finally:
        if state is not None:
            state.close()


def _serve(
    model: ModelConfig,
    devices: list[str],
    server: ServerConfig,
    configs: list[Config],
    sock: socket.socket,
    state: StateDB | None,
    cache: CacheDefaults,
) -> int:
    # imported after the bind: the worker client pulls in torch, seconds of start-up
    from instgenie.server.app import create_app
    from instgenie.server.pool import WorkerPool
    from instgenie.server.runtime import Runtime

    fleet = None
    if server.cluster:
        try:
            fleet, pool = _cluster_pool(server, configs[0])
        except Exception as exc:  # noqa: BLE001 - Ray missing, no cluster there, no node fits
            print(f"instgenie: cluster {server.cluster!r}: {exc}", file=sys.stderr, flush=True)
            if fleet is not None:
                fleet.close()
            sock.close()
            return 1
        devices = [f"{s.device}@{s.node_ip or s.node[:12]}" for s in pool.slots]
    else:
        pool = WorkerPool(configs, server.worker_slots, server.worker_start_timeout_s)

    def interrupted(signum: int, frame: object) -> None:
        raise _Interrupted(signal.Signals(signum).name)

    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        pool.start()
    except _Interrupted as exc:
        log.warning("%s during start-up: workers stopped", exc)
        sock.close()
        if fleet is not None:
            fleet.close()
        return 0
    except Exception as exc:
        print(f"instgenie: workers failed to start: {exc}", file=sys.stderr, flush=True)
        sock.close()
        if fleet is not None:
            fleet.close()
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    runtime = Runtime(pool, server, configs[0].limits, state, None if fleet else cache,
                      fleet=fleet)  # fmt: skip
    app = create_app(runtime)
    uv_config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=5
    )
    srv = DrainingServer(uv_config, runtime, server.drain_timeout_s)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"instgenie: serving {model.model} on http://{shown}:{port} with {len(devices)} "
        f"worker(s) on {', '.join(devices)}",
        file=sys.stderr,
        flush=True,
    )
    try:
        asyncio.run(srv.serve(sockets=[sock]))
    finally:
        codes = pool.close(drain=bool(srv.drained), timeout=server.drain_timeout_s)
        sock.close()
        if fleet is not None:
            fleet.close()
    bad = {i: rc for i, rc in codes.items() if rc != 0}
    if bad:
        log.error("workers exited with non-zero status: %s", bad)
    print(
        f"instgenie: stopped ({'drained' if srv.drained else 'not drained'})",
        file=sys.stderr,
        flush=True,
    )
    return 0 if srv.drained and not bad else 1
