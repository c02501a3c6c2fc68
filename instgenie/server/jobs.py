"""Async edit jobs: a bounded table, progress events for SSE, TTL for finished jobs.

Invariants (event loop thread only):
- At most `max_jobs` jobs exist; adding one first forgets expired finished jobs, then the oldest
  finished ones; if every job is still running the add is refused (429).
- A job's events are append-only and end with exactly one terminal event (done, failed or
  cancelled); a subscriber replays them from the start, then waits for new ones.
- With a state database (state_db.py): a job is stored when it is queued (before its 202), and
  its terminal state is committed before it becomes visible (`finish`: result, error, status
  and the terminal event are applied only once the write is done); jobs forgotten here (TTL,
  room, DELETE) are deleted there. At start `load` brings back the stored jobs: finished ones
  as they were (their TTL counted from their wall-clock finish time), unfinished ones as failed
  with code "interrupted".
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from instgenie.messages import Stage
from instgenie.server.errors import ApiError
from instgenie.server.state_db import JobState, StateDB, StateDBError, StoredJob

log = logging.getLogger("instgenie.server")

TERMINAL = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)
#: the error of a job that was queued or running when the server stopped
INTERRUPTED = {
    "code": "interrupted",
    "message": "the server stopped before this job finished; submit the edit again",
}


def terminal_data(job_id: str, status: JobState, result: dict | None, error: dict | None) -> dict:
    """The data of a job's terminal event (SSE): the result without its image, or the error."""
    if status == JobState.DONE:
        summary = {k: v for k, v in (result or {}).items() if k != "image"}
        return {"result": summary, "href": f"/v1/jobs/{job_id}"}
    return {"error": error}


@dataclass
class Job:
    id: str
    created: float = field(default_factory=time.time)  # unix s
    status: JobState = JobState.QUEUED
    step: int = 0  # denoise steps done
    num_steps: int | None = None  # steps it will run, once known
    #: the stage it is in on its worker; None while queued
    stage: Stage | None = None
    result: dict | None = None  # the edit response (status done)
    error: dict | None = None  # {"code", "message", "field"?} (status failed/cancelled)
    finished: float | None = None  # unix s
    finished_mono: float | None = None  # monotonic s, for the TTL
    #: (event name, data): a JobState's value when it enters it, else "stage" or "step"
    events: list[tuple[str, dict]] = field(default_factory=list)
    task: asyncio.Task | None = None
    finishing: bool = False  # its terminal state is being committed (JobTable.finish)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def is_finished(self) -> bool:
        return self.status in TERMINAL

    def push(self, event: str, data: dict) -> None:
        if self.is_finished:
            return
        if event in JobState._value2member_map_:
            self.status = JobState(event)
        if event in TERMINAL:
            self.finished, self.finished_mono = time.time(), time.monotonic()
        self.events.append((event, data))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def enter(self, stage: Stage) -> None:
        """Its worker reports it entered `stage` (the first report makes it running)."""
        if self.is_finished or stage == self.stage:
            return
        self.stage = stage
        if self.status == JobState.QUEUED:
            self.push(JobState.RUNNING.value, {"stage": stage.value})
        else:
            self.push("stage", {"stage": stage.value})

    def progress(self, step: int, num_steps: int) -> None:
        self.enter(Stage.DENOISE)
        if step > self.step:
            self.step, self.num_steps = step, num_steps
            self.push("step", {"step": step, "num_steps": num_steps})

    async def wait_change(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass

    def stored(self) -> StoredJob:
        return StoredJob(self.id, self.status, self.created, self.finished, self.step,
                         self.num_steps, self.result, self.error)  # fmt: skip

    def view(self) -> dict:
        return {
            "id": self.id,
            "object": "edit.job",
            "status": self.status.value,
            "created": int(self.created),
            "finished": int(self.finished) if self.finished is not None else None,
            "stage": None if self.is_finished or self.stage is None else self.stage.value,
            "progress": {"step": self.step, "num_steps": self.num_steps},
            "result": self.result,
            "error": self.error,
        }


class JobTable:
    def __init__(
        self, max_jobs: int, ttl_s: float, retry_after_s: int, db: StateDB | None = None
    ) -> None:
        self.max_jobs = max_jobs
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.db = db  # None: nothing survives a restart
        self.jobs: OrderedDict[str, Job] = OrderedDict()  # oldest first
        self._ending: set[asyncio.Future] = set()  # finish() calls whose write is in flight

    # ---- persistence ----------------------------------------------------------------------------
    def load(self) -> int:
        """Bring back the stored jobs (at start, before serving); returns how many."""
        if self.db is None:
            return 0
        wall, mono = time.time(), time.monotonic()
        interrupted = self.db.fail_unfinished(wall, INTERRUPTED)
        if interrupted:
            log.warning("%d async job(s) were unfinished when the server stopped: failed, "
                        "code interrupted", interrupted)  # fmt: skip
        for st in self.db.load_jobs():
            job = Job(id=st.id, created=st.created, status=st.status, step=st.step,
                      num_steps=st.num_steps, result=st.result, error=st.error,
                      finished=st.finished)  # fmt: skip
            if not job.is_finished or job.finished is None:  # (not written by this code)
                continue
            job.finished_mono = mono - max(0.0, wall - job.finished)
            job.events.append((job.status.value, terminal_data(job.id, job.status, job.result,
                                                                job.error)))  # fmt: skip
            self.jobs[job.id] = job
        self.purge()
        finished = [j.id for j in self.jobs.values()]
        self._drop(finished[: max(0, len(finished) - self.max_jobs)])  # oldest beyond max_jobs
        return len(self.jobs)

    async def save(self, job: Job) -> None:
        """Store a job as it is now (a new, queued one) before the API answers; a failed write
        is logged and the job goes on in memory only."""
        if self.db is None:
            return
        try:
            await self.db.run(self.db.put_job, job.stored())
        except StateDBError as exc:
            log.error("job %s is kept in memory only: %s", job.id, exc)

    def finish(
        self, job: Job, status: JobState, *, result: dict | None = None, error: dict | None = None
    ) -> asyncio.Future:
        """Make the job terminal: commit it, then apply status, result/error and the terminal
        event at once. Await the returned future for the state to be visible; cancelling the
        awaiting task does not stop it. A second finish of the same job is a no-op."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if job.finishing or job.is_finished:
            done.set_result(None)
            return done
        job.finishing = True
        finished = time.time()

        def apply(write=None) -> None:
            if write is not None and write.exception() is not None:
                log.error("job %s: its end is kept in memory only: %s", job.id, write.exception())
            job.result, job.error = result, error
            job.push(status.value, terminal_data(job.id, status, result, error))
            job.finished = finished  # the time stored
            self._ending.discard(done)
            done.set_result(None)

        if self.db is None:
            apply()
        else:
            st = StoredJob(job.id, status, job.created, finished, job.step, job.num_steps,
                           result, error)  # fmt: skip
            self._ending.add(done)
            write = self.db.submit(self.db.put_job, st)
            write.add_done_callback(lambda f: loop.call_soon_threadsafe(apply, f))
        return asyncio.shield(done)

    async def settle(self) -> None:
        """Wait until every job end being committed is applied (before the event loop stops)."""
        while self._ending:
            await asyncio.gather(*self._ending)

    def _drop(self, ids: list[str]) -> None:
        for jid in ids:
            self.jobs.pop(jid, None)
        if ids and self.db is not None:
            self.db.submit(self.db.delete_jobs, ids)  # in order after the writes before it

    def new(self) -> Job:
        self.purge()
        if len(self.jobs) >= self.max_jobs:
            finished = [j.id for j in self.jobs.values() if j.is_finished]
            self._drop(finished[: len(self.jobs) - self.max_jobs + 1])
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
        self._drop([job_id])

    def purge(self) -> None:
        now = time.monotonic()
        expired = [
            j.id
            for j in self.jobs.values()
            if j.finished_mono is not None and now - j.finished_mono > self.ttl_s
        ]
        self._drop(expired)

    @property
    def running(self) -> int:
        return sum(1 for j in self.jobs.values() if not j.is_finished)
