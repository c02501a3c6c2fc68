"""One denoising step as a value: what the worker's batcher decided for this iteration.

The batcher (worker/batcher.py) builds one `StepPlan` per loop iteration and passes it down
pipeline -> family adapter -> masked executor as an argument, the way vLLM's SchedulerOutput
reaches its model runner. Nothing below the batcher decides who runs, which blocks read the cache
or whether a CUDA graph may be captured; nothing passes a step's inputs by setting attributes.

Pure Python: importable without torch (the router and tests read plans too).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class GraphUse(enum.StrEnum):
    """Whether the step's backbone call may run as a CUDA graph (engine/graphs.py)."""

    #: replay a captured graph of this composition, or capture one when it pays within the
    #: plan's horizon (or as the configured capture policy says); eager where not eligible
    AUTO = "auto"
    #: always eager (e.g. a timed profiling step: timers cannot sit inside a graph)
    EAGER = "eager"


@dataclass(frozen=True)
class Member:
    """One request of the step."""

    uid: str
    step: int  # its step index before this step, 0-based
    num_steps: int  # its denoising steps in all

    @property
    def last(self) -> bool:
        """This is its last step: it leaves the batch after it."""
        return self.step + 1 >= self.num_steps


@dataclass(frozen=True)
class StepPlan:
    """Invariants: member uids are unique; every member has a step left (step < num_steps);
    `joined` is a subset of the member uids; `horizon` >= 1 when given."""

    index: int  # loop iteration counter (steps executed before this one)
    members: tuple[Member, ...]  # batch order: the executor lays rows out in this order
    joined: tuple[str, ...] = ()  # uids admitted just before this step
    #: steps, this one included, that the batch keeps these members unless a request arrives or
    #: is aborted (until its first member finishes); None: unknown (scripts, benchmarks)
    horizon: int | None = None
    #: block ids that compute every token this step (no cache read): the load planner's
    #: decision (scheduler.planner); empty: every block of a cache reader uses the cache
    compute_all: frozenset[int] = frozenset()
    graph: GraphUse = GraphUse.AUTO
    #: time every block of the step (profiling; implies an eager step)
    timed: bool = False

    def __post_init__(self) -> None:
        uids = [m.uid for m in self.members]
        if len(set(uids)) != len(uids):
            raise ValueError(f"StepPlan: duplicate members {uids}")
        for m in self.members:
            if not 0 <= m.step < m.num_steps:
                raise ValueError(f"StepPlan: {m.uid} has no step left ({m.step}/{m.num_steps})")
        if not set(self.joined) <= set(uids):
            raise ValueError(f"StepPlan: joined {self.joined} are not all members")
        if self.horizon is not None and self.horizon < 1:
            raise ValueError(f"StepPlan: horizon {self.horizon} < 1")
        object.__setattr__(self, "compute_all", frozenset(self.compute_all))

    @property
    def leaving(self) -> tuple[str, ...]:
        """Uids whose last step this is."""
        return tuple(m.uid for m in self.members if m.last)

    @property
    def may_graph(self) -> bool:
        return self.graph is GraphUse.AUTO and not self.timed

    def check_batch(self, batch: Iterable) -> None:  # noqa: ANN001 - RequestState-like
        """Raise ValueError unless `batch` (objects with uid and step_index) is exactly the
        plan's members, in order, at the plan's step indices."""
        got = [(s.uid, s.step_index) for s in batch]
        want = [(m.uid, m.step) for m in self.members]
        if got != want:
            raise ValueError(f"StepPlan {self.index}: planned {want}, the batch is {got}")


def members_of(batch: Iterable) -> tuple[Member, ...]:  # noqa: ANN001 - RequestState-like
    """Members of a batch of request states (uid, step_index, num_steps), in batch order."""
    return tuple(Member(s.uid, s.step_index, s.num_steps) for s in batch)


def horizon_of(members: Iterable[Member]) -> int | None:
    """Steps, the coming one included, until the first member finishes (None: no members). An
    upper bound on how long the composition lasts: arrivals are not predicted."""
    left = [m.num_steps - m.step for m in members]
    return min(left) if left else None
