"""Where a newly registered template's cache is built (cluster mode; one node on a single host).

A template is captured on ONE node at registration: every accepting worker of that node is sent
its RegisterTemplate (they share the node's DRAM and disk tiers, so one capture runs). Other
nodes get it when the router sends them an edit of it (a miss: the edit runs the full path beside
the capture); replication of popular templates therefore follows demand through the cache-aware
router's prices, and cold copies leave through each node's own LRU. Pure Python: the server and
the simulator call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeView:
    """One node as placement sees it."""

    node: str  # node id (Ray node id in cluster mode, "local" on one host)
    workers: int  # accepting workers on it, count
    dram_free_bytes: int  # DRAM tier capacity minus bytes held, bytes; -1: unknown
    templates: int  # templates whose cache it holds in any tier, count


def place(nodes: Sequence[NodeView]) -> str | None:
    """The node a new template's cache is built on: among nodes with an accepting worker, the
    one with the most free DRAM (unknown counts as none), then the fewest templates, then the
    lowest id (deterministic). None when no node has an accepting worker."""
    live = [n for n in nodes if n.workers > 0]
    if not live:
        return None
    return min(live, key=lambda n: (-max(n.dram_free_bytes, 0), n.templates, n.node)).node
