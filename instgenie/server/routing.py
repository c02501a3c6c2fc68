"""Routing policies: which worker gets the next request.

A policy is a pure function of the request's routing facts and a snapshot of every worker's state
(no I/O, no clocks), so it is unit-testable and the mask-aware cost-model scheduler can replace
it behind the same interface. The dispatcher calls `choose` only with workers that are up and
accepting; a policy returns None to say "none of these has room": the request then waits in the
server queue.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about a request before it runs."""

    template_id: str | None  # registered template it edits (cache affinity), or None
    num_steps: int | None  # denoise steps asked for; None: the model's default
    pixels: int  # width * height of the image, pixels
    mask_ratio: float | None = None  # fraction of pixels to edit; None: not measured


@dataclass(frozen=True)
class WorkerView:
    """One worker as the dispatcher sees it at routing time."""

    index: int  # position in the pool, 0-based
    device: str  # torch device, e.g. "cuda:1"
    in_flight: int  # requests sent to it and not answered yet, count
    slots: int  # most requests it may hold at once (ServerConfig.worker_slots), count
    batch_size: int = 0  # requests in its last denoise step (stats, may lag), count
    queue_depth: int = 0  # requests it holds that are not in the denoise loop (stats), count
    templates_ready: frozenset[str] = field(default_factory=frozenset)  # cache resident there

    @property
    def has_room(self) -> bool:
        return self.in_flight < self.slots


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> int | None:
        """The index of the chosen worker among `workers`, or None if none has room."""
        ...


class RoundRobin:
    """Workers in turn, skipping full ones."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> int | None:
        if not workers:
            return None
        start = next(self._turn)
        n = len(workers)
        for k in range(n):
            w = workers[(start + k) % n]
            if w.has_room:
                return w.index
        return None


class LeastLoaded:
    """The worker with the smallest fraction of its slots in use; ties go to a worker where the
    request's template cache is resident, then to the lower index."""

    name = "least-loaded"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> int | None:
        room = [w for w in workers if w.has_room]
        if not room:
            return None

        def cost(w: WorkerView) -> tuple[float, int, int]:
            cold = int(
                request.template_id is not None and request.template_id not in w.templates_ready
            )
            return (w.in_flight / max(1, w.slots), cold, w.index)

        return min(room, key=cost).index


def make_policy(name: str) -> RoutingPolicy:
    if name == RoundRobin.name:
        return RoundRobin()
    if name == LeastLoaded.name:
        return LeastLoaded()
    raise ValueError(f"routing: unknown policy {name!r}; known: least-loaded, round-robin")
