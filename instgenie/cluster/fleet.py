"""The Ray connection of a cluster server, the cluster's nodes and the workers each should run.

`--workers auto`: one worker per GPU of every alive node (a CPU model: one worker per node);
`--workers N`: N per node (at most its GPU count on GPU). Nodes are read from the Ray GCS
(`ray.nodes()`), so nodes that the Ray autoscaler or KubeRay adds or removes are seen at the next
poll. Pure functions (`wanted`) decide; `Fleet` does the I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

from instgenie.config import Config
from instgenie.curve import CurveKeys
from instgenie.server.pool import WorkerSlot

from .actor import WorkerActor
from .handle import RemoteWorkerHandle, worker_config

log = logging.getLogger("instgenie.cluster")

#: the Ray namespace of a server's actors
NAMESPACE = "instgenie"


@dataclass(frozen=True)
class NodeInfo:
    node: str  # Ray node id (hex)
    ip: str  # its address
    gpus: int  # GPUs it offers Ray, count
    alive: bool


def wanted(nodes: list[NodeInfo], per_node: int | None, gpu: bool) -> dict[str, int]:
    """Workers each alive node should run (0 for a GPU model on a node without GPUs)."""
    out = {}
    for n in nodes:
        if not n.alive:
            continue
        if gpu:
            out[n.node] = n.gpus if per_node is None else min(per_node, n.gpus)
        else:
            out[n.node] = 1 if per_node is None else per_node
    return out


class Fleet:
    def __init__(self, address: str, config: Config, per_node: int | None,
                 start_timeout_s: float) -> None:  # fmt: skip
        """Connect to the Ray cluster at `address` ("auto": the one this host belongs to)."""
        if not ray.is_initialized():
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                     configure_logging=False)  # fmt: skip
        self.config = config
        self.gpu = config.model.device.startswith("cuda")
        self.per_node = per_node
        self.start_timeout_s = start_timeout_s
        #: this server's Curve keys: made here, in memory; the actors get them through Ray
        self.keys = CurveKeys.generate()

    def nodes(self) -> list[NodeInfo]:
        return [
            NodeInfo(
                n["NodeID"],
                n.get("NodeManagerAddress", ""),
                int(n.get("Resources", {}).get("GPU", 0)),
                bool(n.get("Alive")),
            )  # fmt: skip
            for n in ray.nodes()
        ]

    def slot_config(self) -> Config:
        return worker_config(self.config, self.gpu)

    def launch(self, slot: WorkerSlot) -> RemoteWorkerHandle:
        """server/pool.py's `launch` in cluster mode: a WorkerActor on the slot's node."""
        return RemoteWorkerHandle(WorkerActor, slot.config, slot.node, self.keys, slot.index,
                                  self.start_timeout_s, 1 if self.gpu else 0)  # fmt: skip

    def close(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
