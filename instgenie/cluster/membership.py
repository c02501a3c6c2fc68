"""Nodes joining and leaving a cluster server while it serves (event loop thread).

Every `poll_s` the cluster's nodes are read (off the event loop) and the pool is reconciled:
- a node that left (dead in the GCS, or gone): each of its slots is taken out - its pending
  requests fail with worker_died (so the runtime re-runs each once elsewhere) and its worker is
  stopped - and nothing is restarted there;
- an alive node with fewer workers than `--workers` asks for (a node that joined, a GPU whose
  worker failed to restart): slots are added and started in the background; once up, they get
  work like any other (templates are built on them on demand, server/templates.py);
- a slot whose start or restart failed on a node that is still alive is replaced after
  `RETRY_S`.
Invariants: slot indices are never reused; a removed slot is never restarted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from .fleet import Fleet, wanted

if TYPE_CHECKING:
    from instgenie.server.runtime import Runtime

log = logging.getLogger("instgenie.cluster")

RETRY_S = 10.0  # a failed slot on a live node is replaced after this long, seconds


class Membership:
    def __init__(self, runtime: Runtime, fleet: Fleet, poll_s: float) -> None:
        self.runtime = runtime
        self.fleet = fleet
        self.poll_s = poll_s
        self.alive: dict[str, str] = {}  # node id -> address, as of the last poll
        self._failed_at: dict[int, float] = {}  # slot index -> when it was seen failed
        self._task: asyncio.Task | None = None
        self.polls = 0  # completed reconciliations, count

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                nodes = await asyncio.to_thread(self.fleet.nodes)
                self.reconcile(nodes)
            except asyncio.CancelledError:
                raise
            except Exception:  # a poll must never end membership
                log.exception("cluster membership poll failed")
            await asyncio.sleep(self.poll_s)

    def reconcile(self, nodes) -> None:
        rt = self.runtime
        if rt.draining:
            return
        self.alive = {n.node: n.ip for n in nodes if n.alive}
        want = wanted(nodes, self.fleet.per_node, self.fleet.gpu)
        now = time.monotonic()
        for slot in list(rt.pool.slots):
            if slot.node not in self.alive:
                rt.remove_worker(slot, f"its node {slot.node[:12]} left the cluster")
            elif slot.state == "failed":
                since = self._failed_at.setdefault(slot.index, now)
                if now - since >= RETRY_S:
                    self._failed_at.pop(slot.index, None)
                    rt.remove_worker(slot, f"replaced: {slot.last_error}")
        for node, n in want.items():
            have = sum(1 for s in rt.pool.slots if s.node == node)
            for _ in range(n - have):
                slot = rt.add_worker(self.fleet.slot_config(), node, self.alive[node])
                log.info("node %s (%s): worker %d starting", node[:12], self.alive[node],
                         slot.index)  # fmt: skip
        self.polls += 1

    def node_alive(self, node: str) -> bool:
        return node in self.alive

    def report(self) -> list[dict]:
        """/health's "nodes": each node with its workers."""
        rows = {}
        for s in self.runtime.pool.slots:
            row = rows.setdefault(
                s.node,
                {
                    "node": s.node,
                    "address": s.node_ip or None,
                    "alive": s.node in self.alive,
                    "workers": [],
                },
            )
            row["workers"].append(s.index)
        return list(rows.values())
