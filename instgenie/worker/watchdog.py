"""One child process's watchdog: what its heartbeats said, and whether it is still alive.

A child is dead when it is not ready `start_timeout_s` after its start, silent (no heartbeat) for
`heartbeat_timeout_s`, or makes no progress for `stall_timeout_s`. Progress is its loop iteration
count moving, holding nothing, or a model stage call (`ChildRuntime.doing`: encode, decode) that
has run for less than `stage_timeout_s`; past that limit the child is stuck whether or not it
holds requests. The process set (child_processes.py) acts on the verdict; this only judges.
"""

from __future__ import annotations

from dataclasses import dataclass

from instgenie.config import WorkerConfig
from instgenie.messages import Heartbeat


@dataclass
class Watchdog:
    limits: WorkerConfig  # the *_timeout_s fields
    started_at: float = 0.0  # monotonic; the current incarnation's start
    last_beat: float = 0.0  # monotonic; its last heartbeat (or ChildReady)
    last_iterations: int = -1  # its loop iteration count at the last heartbeat
    progress_at: float = 0.0  # monotonic; last time its iterations moved (or it held nothing)
    running: int = 0  # requests its last heartbeat says it works on (the loop's batch)
    busy_s: float = 0.0  # how long its main thread has been in one model stage call, s
    busy_stage: str = ""  # that stage call ("encode", "decode"), "" = none

    def started(self, now: float) -> None:
        """A new incarnation was spawned at `now` (monotonic)."""
        self.started_at = self.last_beat = self.progress_at = now
        self.last_iterations, self.running, self.busy_s = -1, 0, 0.0

    def ready(self, now: float) -> None:
        self.last_beat = self.progress_at = now

    def beat(self, msg: Heartbeat, now: float) -> None:
        self.last_beat = now
        stage_limit = self.limits.stage_timeout_s
        took = msg.time - msg.busy_since if msg.busy else 0.0
        busy, stuck = 0.0 < took < stage_limit, took >= stage_limit
        moved = msg.loop_iterations != self.last_iterations or not msg.in_flight
        if busy or (moved and not stuck):
            self.progress_at = now
        self.last_iterations = msg.loop_iterations
        self.running = len(msg.in_flight)
        self.busy_s = took if busy else 0.0
        self.busy_stage = msg.busy if busy else ""

    def verdict(self, ready: bool, now: float) -> str:
        """Why the child counts as dead at `now`; "" while it is alive."""
        w = self.limits
        if not ready and now - self.started_at > w.start_timeout_s:
            return f"not ready after {w.start_timeout_s:.0f} s"
        if ready and now - self.last_beat > w.heartbeat_timeout_s:
            return f"no heartbeat for {now - self.last_beat:.1f} s"
        if ready and now - self.progress_at > w.stall_timeout_s:
            return f"no progress for {now - self.progress_at:.1f} s"
        return ""
