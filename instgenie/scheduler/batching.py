"""Batching policies: which prepared requests join the running batch before a step.

- continuous: every step, admit waiting requests up to the batch limit (paper §4.3);
- static: admit only when the running batch is empty, then run it to completion (as a
  Diffusers-style server does); arrivals wait;
- naive-continuous: continuous, but pre/post-processing run inside the loop process, between
  steps (the strawman of paper Fig. 10, top).

A batch holds requests of one batch key only (equal latent shape and text length). Admission is
FIFO across keys: the first waiting request of another key stops admission, so the running
batch drains (within its members' remaining steps) and that request runs next. (Admitting the
same-key requests queued behind it instead let a steady same-resolution stream starve it until
its timeout.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol, TypeVar


class Batchable(Protocol):
    """What admission reads of a request (engine.request.RequestState has it): requests of one
    key may share a denoise step."""

    @property
    def batch_key(self) -> Hashable: ...


R = TypeVar("R", bound=Batchable)


@dataclass(frozen=True)
class Policy:
    name: str
    #: admit only into an empty batch
    static: bool = False
    #: pre/post-processing run inside the loop process between steps
    inline_stages: bool = False

    def admit(self, running: list[R], waiting: deque[R], max_batch: int) -> list[R]:
        """Pop and return the waiting requests that join before the next step: the head of the
        queue while it has the running batch's key (FIFO)."""
        if self.static and running:
            return []
        key = running[0].batch_key if running else (waiting[0].batch_key if waiting else None)
        joined: list[R] = []
        while waiting and len(running) + len(joined) < max_batch:
            if waiting[0].batch_key != key:
                break  # FIFO across keys: it runs once this batch drains
            joined.append(waiting.popleft())
        return joined


POLICIES = {
    "continuous": Policy("continuous"),
    "static": Policy("static", static=True),
    "naive-continuous": Policy("naive-continuous", inline_stages=True),
}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown batching policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
