"""What the denoise loop reports to its supervisor, kept across the loop's restarts: its step log
(GetStepLog), the activation bytes its steps loaded, its cache counters, where its templates'
caches live (Stats.residency) and its CostSpec.

Invariant: step numbers are the worker's, not one loop incarnation's: a restarted loop counts
from 0 again and its steps are shifted by the steps of every earlier incarnation, so the log's
step numbers only grow.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from instgenie.config import WorkerConfig
from instgenie.messages import CostSpec, LoopSteps, StepEntry


class LoopReports:
    def __init__(self, w: WorkerConfig) -> None:
        self.steps: deque[StepEntry] = deque(maxlen=w.step_log_size)
        self._step_offset = 0  # steps of previous loop incarnations
        self._loop_steps = 0  # steps of the current incarnation
        self.bytes_loaded = 0  # cached activations copied in by denoise steps, bytes
        self.cache_stats: dict[str, float] = {}  # the loop's host-cache counters (LoopSteps)
        #: template id -> {tier: bytes} resident now, as the loop last reported (LoopSteps);
        #: emptied when the loop dies (its device store dies with it; the next loop reports)
        self.residency: dict[str, dict[str, int]] = {}
        self.residency_known = False  # the current loop has reported its residency
        #: the loop's CostSpec (ChildReady; the latest loop's, kept across its restarts)
        self.cost_spec: CostSpec | None = None

    @property
    def steps_total(self) -> int:
        return self._step_offset + self._loop_steps

    def add(self, msg: LoopSteps) -> None:
        for e in msg.entries:
            self.steps.append(dataclasses.replace(e, step=e.step + self._step_offset))
            self.bytes_loaded += e.bytes_loaded
        self.cache_stats.update(msg.cache)
        if msg.residency is not None:
            self.residency = msg.residency
            self.residency_known = True
        if msg.entries:
            self._loop_steps = msg.entries[-1].step + 1

    def since(self, step: int) -> list[StepEntry]:
        return [e for e in self.steps if e.step >= step]

    def cost_reported(self, cost: CostSpec | None) -> None:
        """A ready process reported `cost` (the loop's; None: it has none)."""
        if cost is not None:
            self.cost_spec = cost

    def template_ready(self, template_id: str, bytes_by_tier: dict[str, int]) -> None:
        """The loop answered a build ok (TemplateReady): resident where it says until its next
        report (which follows at once, with every tier holding it)."""
        if bytes_by_tier:
            self.residency = {**self.residency, template_id: dict(bytes_by_tier)}

    def loop_died(self) -> None:
        self.residency = {}
        self.residency_known = False
        self._step_offset += self._loop_steps
        self._loop_steps = 0
