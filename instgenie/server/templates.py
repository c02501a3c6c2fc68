"""Registered templates: one record per template id, built on every worker.

A template id is the sha256 of the template image's bytes (hex), so an edit that uploads the same
image bytes (an OpenAI client, a native edit by image) finds it. Registration returns at once;
each worker builds its cache (RegisterTemplate is sent at once, in order with later edits; the
reply future is bridged to the event loop).
Invariants (event loop thread only):
- `slot.templates_ready` holds exactly the ids whose build on that worker succeeded, for the
  worker's current incarnation (a build answered by a replaced worker is ignored; resync()
  rebuilds every record on a restarted worker).
- Overall state: "failed" if any worker refused the template (bad content fails everywhere),
  else "ready" once every accepting worker has it, else "building".
- With a state database (state_db.py), `records` is what the database holds: a registration or
  deletion is committed there first, then applied here (one at a time, under `_lock`; the
  commit runs on the database's writer thread), so the API answers only durable changes and a
  restarted server reloads the same templates (`load`) and builds them on every worker again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field

from instgenie.messages import RegisterTemplate
from instgenie.server.config import ServerConfig
from instgenie.server.errors import ApiError
from instgenie.server.metrics import fastest_tier
from instgenie.server.pool import WorkerPool, WorkerSlot
from instgenie.server.state_db import StateDB, StateDBError, StoredTemplate
from instgenie.worker.client import WorkerError

log = logging.getLogger("instgenie.server")


def template_id_of(image: bytes) -> str:
    return hashlib.sha256(image).hexdigest()


@dataclass
class WorkerBuild:
    state: str = "building"  # "building" | "ready" | "failed"
    message: str = ""  # why it failed
    build_ms: float = 0.0  # worker-reported registration -> ready, ms
    bytes_by_tier: dict[str, int] = field(default_factory=dict)  # cache bytes per tier


@dataclass
class TemplateRecord:
    msg: RegisterTemplate  # what every worker is sent
    width: int  # template image size, pixels
    height: int
    created: float = field(default_factory=time.time)  # unix s
    builds: dict[int, WorkerBuild] = field(default_factory=dict)  # slot index -> build

    @property
    def template_id(self) -> str:
        return self.msg.template_id

    def state(self, pool: WorkerPool) -> str:
        if any(b.state == "failed" for b in self.builds.values()):
            return "failed"
        live = [s.index for s in pool.slots if s.accepting]
        if live and all(self.builds.get(i, WorkerBuild()).state == "ready" for i in live):
            return "ready"
        return "building"


class TemplateRegistry:
    def __init__(self, pool: WorkerPool, cfg: ServerConfig, db: StateDB | None = None) -> None:
        self.pool = pool
        self.cfg = cfg
        self.db = db  # None: nothing survives a restart
        self.records: dict[str, TemplateRecord] = {}
        self._lock = asyncio.Lock()  # one registration/deletion at a time (check, commit, apply)

    def load(self) -> int:
        """Reload the stored templates and build them on every worker (at start, on the event
        loop); the workers find caches that survived in the host's DRAM/disk tiers."""
        if self.db is None:
            return 0
        for st in self.db.load_templates():
            rec = TemplateRecord(st.msg, st.width, st.height, created=st.created)
            self.records[rec.template_id] = rec
            for slot in self.pool.slots:
                if slot.accepting:
                    self._build(rec, slot)
        return len(self.records)

    async def _commit(self, fn, *args) -> None:
        if self.db is None:
            return
        try:
            await self.db.run(fn, *args)
        except StateDBError as exc:
            log.error("%s", exc)
            raise ApiError(
                503,
                "state_unavailable",
                "the server's state database cannot be written; nothing was changed",
                retry_after_s=self.cfg.retry_after_s,
            ) from None

    def get(self, template_id: str) -> TemplateRecord:
        rec = self.records.get(template_id)
        if rec is None:
            raise ApiError(
                404,
                "template_not_found",
                f"template_id: no template {template_id!r} is registered",
                "template_id",
            )
        return rec

    async def register(self, rec: TemplateRecord) -> tuple[TemplateRecord, bool]:
        """(the record, created now); registering the same content again is a no-op. Applied
        even if the caller is cancelled once its commit is under way."""
        return await asyncio.shield(self._register(rec))

    async def _register(self, rec: TemplateRecord) -> tuple[TemplateRecord, bool]:
        async with self._lock:
            return await self._register_locked(rec)

    async def _register_locked(self, rec: TemplateRecord) -> tuple[TemplateRecord, bool]:
        old = self.records.get(rec.template_id)
        retry = old is not None and old.state(self.pool) == "failed" and old.msg == rec.msg
        if old is not None and not retry:  # (registering a failed one again retries its build)
            if old.msg == rec.msg:
                return old, False
            raise ApiError(
                409,
                "template_conflict",
                f"template {rec.template_id} is registered with other parameters; DELETE it first",
                "template_id",
            )
        if len(self.records) - retry >= self.cfg.max_templates:
            raise ApiError(
                409,
                "too_many_templates",
                f"{len(self.records)} templates are registered (the limit); DELETE one first",
            )
        if self.db is not None:
            st = StoredTemplate(rec.msg, rec.width, rec.height, rec.created)
            await self._commit(self.db.put_template, st)
        self.records[rec.template_id] = rec
        for slot in self.pool.slots:
            if slot.accepting:
                self._build(rec, slot)
        return rec, True

    def _build(self, rec: TemplateRecord, slot: WorkerSlot) -> None:
        client, incarnation = slot.client, slot.starts
        assert client is not None
        rec.builds[slot.index] = build = WorkerBuild()
        fut = client.submit_template(rec.msg)  # sent now, ahead of any later edit
        loop = asyncio.get_running_loop()

        def built(f) -> None:
            loop.call_soon_threadsafe(self._built, rec, slot, incarnation, build, f)

        fut.add_done_callback(built)

    def _built(self, rec, slot: WorkerSlot, incarnation: int, build: WorkerBuild, fut) -> None:
        tid = rec.template_id
        if self.records.get(tid) is not rec or slot.starts != incarnation:
            return  # deleted meanwhile, or answered by a worker since replaced
        if rec.builds.get(slot.index) is not build:
            return
        exc = fut.exception()
        if exc is None and fut.result().ok:
            reply = fut.result()
            build.state, build.build_ms = "ready", reply.build_ms
            build.bytes_by_tier = dict(reply.bytes_by_tier)
            slot.templates_ready.add(tid)
            slot.template_tiers[tid] = fastest_tier(build.bytes_by_tier)
        elif exc is None:
            build.state, build.message = "failed", fut.result().message
        elif isinstance(exc, WorkerError) and exc.code == "invalid_request":
            build.state, build.message = "failed", exc.reason
        else:  # the worker died or shut down: resync() rebuilds it on the next incarnation
            build.message = f"{type(exc).__name__}: {exc}"
            log.warning("template %s on worker %d: %s", tid[:12], slot.index, build.message)

    async def drop(self, template_id: str) -> TemplateRecord:
        """Forget a template and remove its cache on every worker (404 if unknown)."""
        return await asyncio.shield(self._drop(template_id))

    async def _drop(self, template_id: str) -> TemplateRecord:
        async with self._lock:
            self.get(template_id)
            if self.db is not None:
                await self._commit(self.db.delete_template, template_id)
            return self._forget(template_id)

    def _forget(self, template_id: str) -> TemplateRecord:
        rec = self.records.pop(template_id)
        for slot in self.pool.slots:
            slot.templates_ready.discard(template_id)
            slot.template_tiers.pop(template_id, None)
            client = slot.client
            if client is not None and slot.accepting:
                try:
                    client.drop_template(template_id)
                except RuntimeError:  # closed: the worker is being replaced and forgets it
                    pass
        return rec

    def forget_slot(self, slot: WorkerSlot) -> None:
        """A removed worker (cluster mode: its node left) builds nothing any more."""
        for rec in self.records.values():
            rec.builds.pop(slot.index, None)

    def resync(self, slot: WorkerSlot) -> None:
        """Build every record on a (re)started worker."""
        for rec in self.records.values():
            self._build(rec, slot)

    @property
    def building(self) -> int:
        return sum(
            1 for r in self.records.values() for b in r.builds.values() if b.state == "building"
        )
