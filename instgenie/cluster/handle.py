"""`RemoteWorkerHandle`: the API process's handle of one worker actor, with the interface of a
local worker.client.WorkerHandle that server/pool.py and server/health.py use: `client`, `pid`,
`address`, `proc.poll()` / `proc.kill()`, `wait_ready`, `close`.

- The actor is created at once (its start runs on its node); `wait_ready` waits for it, then
  connects a WorkerClient to the supervisor's address with the Curve client keys.
- A watcher thread holds the actor's `wait_exit` call: when the supervisor exits, or the actor
  or its whole node dies (Ray raises RayActorError), `proc.poll()` turns non-None and every
  pending future of the client fails with worker_died (retryable) at once - nothing waits on a
  dead node for a TCP timeout.
- `proc.kill()` (the health monitor fencing a silent worker) is ray.kill of the actor.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from instgenie.config import Config, to_dict
from instgenie.curve import CurveKeys
from instgenie.worker.client import WorkerClient

log = logging.getLogger("instgenie.cluster")

#: exit status reported for a worker whose actor (or node) died without a supervisor status
ACTOR_DIED = -9


class RemoteProc:
    """What the pool and health monitor read of a remote supervisor process."""

    def __init__(self, actor) -> None:
        self._actor = actor
        self.returncode: int | None = None  # set once by the watcher

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        ray.kill(self._actor, no_restart=True)


class RemoteWorkerHandle:
    def __init__(self, actor_cls, config: Config, node: str, keys: CurveKeys, index: int,
                 start_timeout_s: float, num_gpus: float) -> None:  # fmt: skip
        self.node = node
        self._keys = keys
        self.address = ""
        self.pid = -1
        self.node_ip = ""
        self.info: dict = {}
        self.client: WorkerClient | None = None
        self._closed = False
        # hard affinity: a node that has left fails the start at once (ActorUnschedulableError)
        strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        self.actor = actor_cls.options(
            num_gpus=num_gpus, num_cpus=0, scheduling_strategy=strategy, max_restarts=0,
            name=None,
        ).remote(to_dict(config), keys.to_dict(), index)  # fmt: skip
        self.proc = RemoteProc(self.actor)
        self._start_ref = self.actor.start.remote(start_timeout_s)

    def wait_ready(self, timeout: float = 300.0) -> dict[str, float]:
        """Wait for the actor's start (the worker serving on its node) and connect to it."""
        deadline = time.monotonic() + timeout
        try:
            self.info = ray.get(self._start_ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"worker on node {self.node[:12]} not ready after {timeout} s"
            ) from None
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"worker on node {self.node[:12]} failed to start: {exc}") from None
        self.address, self.pid, self.node_ip = (
            self.info["address"],
            self.info["pid"],
            self.info["node_ip"],
        )
        self.client = WorkerClient(self.address, curve=self._keys.client_side(), allow_remote=True)
        threading.Thread(target=self._watch_exit, name="remote-worker-watch", daemon=True).start()
        return self.client.wait_ready(max(1.0, deadline - time.monotonic()))

    def _watch_exit(self) -> None:
        try:
            rc = ray.get(self.actor.wait_exit.remote())
            why = f"the worker supervisor exited with status {rc}"
        except ray.exceptions.RayError as exc:
            rc, why = ACTOR_DIED, f"its actor or node died ({type(exc).__name__})"
        self.proc.returncode = rc
        if not self._closed:
            log.warning("worker on node %s (%s): %s", self.node[:12], self.node_ip, why)
        if self.client is not None:
            self.client.fail_all("worker_died", why)

    def close(self, drain: bool = True, timeout: float = 60.0) -> int:
        """Stop the worker (drain: finish what it holds), then the actor; its exit status."""
        self._closed = True
        rc = self.proc.returncode
        if rc is None:
            try:
                rc = ray.get(self.actor.stop.remote(drain, timeout), timeout=timeout + 10)
            except ray.exceptions.RayError as exc:
                log.warning("worker on node %s: stop failed (%s)", self.node[:12], exc)
                rc = ACTOR_DIED
        try:
            ray.kill(self.actor, no_restart=True)
        except ray.exceptions.RayError:
            pass
        if self.client is not None:
            self.client.close()
        return rc if rc is not None else ACTOR_DIED


def worker_config(config: Config, gpu: bool) -> Config:
    """The config a worker actor runs: its one GPU is cuda:0 (Ray sets CUDA_VISIBLE_DEVICES)."""
    model = dataclasses.replace(config.model, device="cuda:0" if gpu else "cpu")
    return dataclasses.replace(config, model=model)
