"""Async edit jobs: a bounded table, progress events for SSE, TTL for finished jobs.

Invariants (event loop thread only):
- At most `max_jobs` jobs exist; adding one first forgets expired finished jobs, then the oldest
  finished ones; if every job is still running the add is refused (429).
- A job's events are append-only and end with exactly one terminal event (done, failed or
  cancelled); a subscriber replays them from the start, then waits for new ones.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from instgenie.server.errors import ApiError

TERMINAL = ("done", "failed", "cancelled")


@dataclass
class Job:
    id: str
    created: float = field(default_factory=time.time)  # unix s
    status: str = "queued"  # "queued" | "running" | "done" | "failed" | "cancelled"
    step: int = 0  # denoise steps done
    num_steps: int | None = None  # steps it will run, once known
    result: dict | None = None  # the edit response (status done)
    error: dict | None = None  # {"code", "message", "field"?} (status failed/cancelled)
    finished: float | None = None  # unix s
    finished_mono: float | None = None  # monotonic s, for the TTL
    events: list[tuple[str, dict]] = field(default_factory=list)  # (event name, data)
    task: asyncio.Task | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def is_finished(self) -> bool:
        return self.status in TERMINAL

    def push(self, event: str, data: dict) -> None:
        if self.is_finished:
            return
        if event in ("queued", "running", *TERMINAL):
            self.status = event
        if event in TERMINAL:
            self.finished, self.finished_mono = time.time(), time.monotonic()
        self.events.append((event, data))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def progress(self, step: int, num_steps: int) -> None:
        if step > self.step:
            self.step, self.num_steps = step, num_steps
            self.push("step", {"step": step, "num_steps": num_steps})

    async def wait_change(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass

    def view(self) -> dict:
        return {
            "id": self.id,
            "object": "edit.job",
            "status": self.status,
            "created": int(self.created),
            "finished": int(self.finished) if self.finished is not None else None,
            "progress": {"step": self.step, "num_steps": self.num_steps},
            "result": self.result,
            "error": self.error,
        }


class JobTable:
    def __init__(self, max_jobs: int, ttl_s: float, retry_after_s: int) -> None:
        self.max_jobs = max_jobs
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.jobs: OrderedDict[str, Job] = OrderedDict()  # oldest first

    def new(self) -> Job:
        self.purge()
        if len(self.jobs) >= self.max_jobs:
            for jid in [j.id for j in self.jobs.values() if j.is_finished]:
                del self.jobs[jid]
                if len(self.jobs) < self.max_jobs:
                    break
        if len(self.jobs) >= self.max_jobs:
            raise ApiError(
                429,
                "too_many_jobs",
                f"{len(self.jobs)} async jobs are running (the limit); retry later",
                retry_after_s=self.retry_after_s,
            )
        job = Job(id="job_" + secrets.token_hex(12))
        self.jobs[job.id] = job
        return job

    def get(self, job_id: str) -> Job:
        self.purge()
        job = self.jobs.get(job_id)
        if job is None:
            raise ApiError(
                404,
                "job_not_found",
                f"no job {job_id[:80]!r} (unknown, or finished more than {self.ttl_s:.0f} s ago)",
            )
        return job

    def forget(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)

    def purge(self) -> None:
        now = time.monotonic()
        expired = [
            j.id
            for j in self.jobs.values()
            if j.finished_mono is not None and now - j.finished_mono > self.ttl_s
        ]
        for jid in expired:
            del self.jobs[jid]

    @property
    def running(self) -> int:
        return sum(1 for j in self.jobs.values() if not j.is_finished)
