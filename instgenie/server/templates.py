"""Registered templates: one record per template id, built on one node, then where edits go.

A template id is the sha256 of the template image's bytes (hex), so an edit that uploads the same
image bytes (an OpenAI client, a native edit by image) finds it; a template captured with LoRAs
hashes them too (`template_id_of`), so such an edit never finds it (it names it by id). Registration
returns at once; its cache is built on every accepting worker of ONE node (scheduler/placement.py;
one host = one node = every worker): RegisterTemplate is sent at once, in order with later edits,
and the reply future is bridged to the event loop. A worker without a build record gets
RegisterTemplate right before an edit of the template (`ensure`, called by the dispatcher): where
its node's DRAM/disk holds the cache that answers at once and the edit reads it; elsewhere a capture
starts and the edit runs the full path beside it (replication follows the router's prices:
placement.py).
Invariants (event loop thread only):
- `slot.templates_ready` / `slot.template_tiers` are where each registered template's cache is
  resident for that worker, as its last Stats answer says (`refresh`: an eviction is seen), with
  the node's DRAM/disk tiers shared by every worker of the node (a sibling's report counts) and
  "gpu"/"cpu" (a loop's device store) only for the worker that holds it; a build answered ok
  since that answer was asked for is added at once. A build answered by a replaced worker is
  ignored; resync() rebuilds on a restarted worker what it had build records for.
- Overall state: "failed" if any worker refused the template (bad content fails everywhere),
  else "ready" once, on at least one node, every accepting worker that was sent it has it
  ready (on one host: every worker that was up at registration), else "building".
- A registered template's LoRAs are registered: a registration checks them (`register`'s
  `check`) and a LoRA's deletion looks for templates naming it (`unless_lora_used`) under the
  same lock, so neither can slip between the other's check and change.
- With a state database (state_db.py), `records` is what the database holds: a registration or
  deletion is committed there first, then applied here (one at a time, under `_lock`; the
  commit runs on the database's writer thread), so the API answers only durable changes and a
  restarted server reloads the same templates (`load`) and places each on a node again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from instgenie.messages import RegisterTemplate
from instgenie.scheduler.placement import NodeView, place
from instgenie.server.config import ServerConfig
from instgenie.server.errors import ApiError
from instgenie.server.metrics import fastest_tier
from instgenie.server.pool import WorkerPool, WorkerSlot
from instgenie.server.state_db import StateDB, StateDBError, StoredTemplate
from instgenie.worker.client import WorkerError

log = logging.getLogger("instgenie.server")

T = TypeVar("T")

#: cache tiers a node's workers share (the host cache); "gpu"/"cpu" are one loop's own
NODE_TIERS = ("dram", "disk")
#: a build that found no room on its node is sent again after retry_after_s x 2^attempts
#: seconds, at most this many (each try costs its worker one denoising step and the encodes)
RETRY_MAX_S = 60.0


def template_id_of(image: bytes, loras: Sequence[tuple[str, float]] = ()) -> str:
    """sha256 hex of the image bytes; a template captured with LoRAs: of the image bytes, a NUL
    and the LoRAs as canonical JSON `[[id, scale], ...]` (in order), so it is another template
    than the same image's without them (whose id, the one an edit posting the image finds,
    stays the bytes' hash)."""
    if not loras:
        return hashlib.sha256(image).hexdigest()
    refs = json.dumps([[str(i), float(s)] for i, s in loras], separators=(",", ":"))
    return hashlib.sha256(image + b"\0" + refs.encode()).hexdigest()


def lora_refs(msg: RegisterTemplate) -> list[dict]:
    """A template's LoRAs as the API shows them: [{"id", "scale"}, ...]."""
    return [{"id": i, "scale": s} for i, s in msg.loras]


@dataclass
class WorkerBuild:
    state: str = "building"  # "building" | "ready" | "failed"
    message: str = ""  # why it failed
    build_ms: float = 0.0  # worker-reported registration -> ready, ms
    bytes_by_tier: dict[str, int] = field(default_factory=dict)  # cache bytes per tier
    ready_at: float = 0.0  # monotonic time the server learnt it is ready (0: it is not)
    attempts: int = 0  # sends before this one that found no room on the node (backoff)


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
        if any(st == "ready" for st in self.node_states(pool).values()):
            return "ready"
        return "building"

    def node_states(self, pool: WorkerPool) -> dict[str, str]:
        """node -> its state, for every node with an accepting worker that was sent it:
        "failed" if one of them refused it, "ready" once all of them have it, else "building"."""
        nodes: dict[str, list[WorkerBuild]] = {}  # node -> builds of its accepting workers
        for s in pool.slots:
            if s.accepting and s.index in self.builds:
                nodes.setdefault(s.node, []).append(self.builds[s.index])
        return {
            node: "failed" if any(b.state == "failed" for b in builds)
            else "ready" if all(b.state == "ready" for b in builds)
            else "building"
            for node, builds in sorted(nodes.items())
        }  # fmt: skip


class TemplateRegistry:
    def __init__(self, pool: WorkerPool, cfg: ServerConfig, db: StateDB | None = None) -> None:
        self.pool = pool
        self.cfg = cfg
        self.db = db  # None: nothing survives a restart
        self.records: dict[str, TemplateRecord] = {}
        self._lock = asyncio.Lock()  # one registration/deletion at a time (check, commit, apply)
        #: slot index -> (its last Stats.residency, monotonic time that answer was asked for)
        self._reports: dict[int, tuple[dict[str, dict[str, int]], float]] = {}
        #: slot index -> template id -> its build answered ok, until a report asked for since
        #: covers it (`_apply`)
        self._fresh: dict[int, dict[str, WorkerBuild]] = {}
        self.draining = False  # set as the server drains: no build is sent again (`_build_again`)

    def load(self) -> int:
        """Reload the stored templates and build each on its node (at start, on the event
        loop); the workers find caches that survived in the node's DRAM/disk tiers."""
        if self.db is None:
            return 0
        for st in self.db.load_templates():
            rec = TemplateRecord(st.msg, st.width, st.height, created=st.created)
            self.records[rec.template_id] = rec
            self._place(rec)
        return len(self.records)

    # ---- placement --------------------------------------------------------------------------
    def node_views(self) -> list[NodeView]:
        """Every node with a worker, as placement sees it: its accepting workers, its DRAM tier's
        free bytes (capacity less bytes held, from its workers' latest counters; -1 unknown)
        and the templates resident on it in any tier or being built there."""
        nodes: dict[str, list[WorkerSlot]] = {}
        for s in self.pool.slots:
            nodes.setdefault(s.node, []).append(s)
        building: dict[int, set[str]] = {}  # slot index -> templates it is building
        for tid, rec in self.records.items():
            for index, b in rec.builds.items():
                if b.state == "building":
                    building.setdefault(index, set()).add(tid)
        views = []
        for node, slots in sorted(nodes.items()):
            free = -1
            for s in sorted(slots, key=lambda s: s.stats_at):  # the latest answer last
                cap, used = s.stats.get("cache_budget_dram_bytes"), s.stats.get("cache_bytes_dram")
                if cap is not None and used is not None:
                    free = int(cap - used)
            held = set().union(*(s.templates_ready | building.get(s.index, set()) for s in slots))
            accepting = sum(1 for s in slots if s.accepting)
            views.append(NodeView(node=node, workers=accepting, dram_free_bytes=free,
                                  templates=len(held)))  # fmt: skip
        return views

    def _place(self, rec: TemplateRecord) -> str | None:
        """Build `rec` on every accepting worker of the node placement picks; that node (None:
        no worker accepts; edits build it where they run, `ensure`)."""
        node = place(self.node_views())
        for slot in self.pool.slots:
            if slot.node == node and slot.accepting:
                self._build(rec, slot)
        return node

    def ensure(self, slot: WorkerSlot, template_id: str) -> None:
        """Right before an edit of `template_id` is sent to `slot`: RegisterTemplate first when
        the slot has no build record of it, or its build is ready but the cache has left the
        slot's node since (evicted: its residency reports no longer list it) - sent on the same
        socket, so ordered before the edit. Where the slot's node holds the cache it answers at
        once and the edit reads it; elsewhere a capture starts (the worker captures a template
        whose cache it no longer holds again) and the edit runs the full path beside it."""
        rec = self.records.get(template_id)
        if rec is None or slot.client is None or not slot.accepting:
            return
        build = rec.builds.get(slot.index)
        if build is not None and not (
            build.state == "ready" and template_id not in slot.templates_ready
        ):
            return
        try:
            self._build(rec, slot)
        except RuntimeError:  # the client closed: the worker is being replaced
            rec.builds.pop(slot.index, None)

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

    async def register(
        self, rec: TemplateRecord, check: Callable[[], object] | None = None
    ) -> tuple[TemplateRecord, bool]:
        """(the record, created now); registering the same content again is a no-op. Applied
        even if the caller is cancelled once its commit is under way. `check` (raising
        ApiError to refuse) runs first under the registration lock: the template's LoRAs are
        still registered (see `unless_lora_used`)."""
        return await asyncio.shield(self._register(rec, check))

    async def _register(
        self, rec: TemplateRecord, check: Callable[[], object] | None
    ) -> tuple[TemplateRecord, bool]:
        async with self._lock:
            if check is not None:
                check()
            return await self._register_locked(rec)

    def lora_users(self, lora_id: str) -> list[str]:
        """Ids of the registered templates captured with LoRA `lora_id`, sorted."""
        return sorted(
            tid for tid, rec in self.records.items() if any(i == lora_id for i, _ in rec.msg.loras)
        )

    async def unless_lora_used(self, lora_id: str, action: Callable[[], Awaitable[T]]) -> T:
        """`action()` (a LoRA's deletion) under the registration lock, unless a registered
        template names LoRA `lora_id`: then 409 lora_in_use naming it (a template never names
        a LoRA whose file is gone)."""
        async with self._lock:
            users = self.lora_users(lora_id)
            if users:
                more = f" and {len(users) - 1} more" if len(users) > 1 else ""
                raise ApiError(
                    409,
                    "lora_in_use",
                    f"LoRA {lora_id} is used by template {users[0]}{more}; DELETE "
                    f"{'them' if more else 'it'} first",
                    "id",
                )
            return await action()

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
        if retry:  # the failed builds' workers try again, wherever they are
            for slot in self.pool.slots:
                if slot.index in old.builds and slot.accepting:
                    self._build(rec, slot)
        if not rec.builds:
            self._place(rec)
        return rec, True

    def _build(self, rec: TemplateRecord, slot: WorkerSlot, attempts: int = 0) -> None:
        client, incarnation = slot.client, slot.starts
        assert client is not None
        rec.builds[slot.index] = build = WorkerBuild(attempts=attempts)
        fut = client.submit_template(rec.msg)  # sent now, ahead of any later edit
        loop = asyncio.get_running_loop()

        def built(f) -> None:
            try:
                loop.call_soon_threadsafe(self._built, rec, slot, incarnation, build, f)
            except RuntimeError:  # the event loop closed: answered as the server stopped
                pass

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
            build.ready_at = time.monotonic()
            self._fresh.setdefault(slot.index, {})[tid] = build
            slot.templates_ready.add(tid)
            slot.template_tiers[tid] = fastest_tier(build.bytes_by_tier)
        elif exc is None and fut.result().retryable:
            # no room on that node now (its tiers full of caches in use): not the template's
            # fault. The build stays "building", saying why, and is sent again after a backoff,
            # so a client waiting for "ready" needs no edit to get there (and edits meanwhile
            # take the full path without starting captures of their own: `ensure`)
            delay = min(RETRY_MAX_S, max(1, self.cfg.retry_after_s) * 2 ** min(build.attempts, 6))
            build.message = f"{fut.result().message}; sent again in {delay:g} s"
            log.warning("template %s on worker %d: %s", tid[:12], slot.index, build.message)
            asyncio.get_running_loop().call_later(
                delay, self._build_again, rec, slot, incarnation, build
            )
        elif exc is None:
            build.state, build.message = "failed", fut.result().message
        elif isinstance(exc, WorkerError) and exc.code == "invalid_request":
            build.state, build.message = "failed", exc.reason
        else:  # the worker died or shut down: resync() rebuilds it on the next incarnation
            build.message = f"{type(exc).__name__}: {exc}"
            log.warning("template %s on worker %d: %s", tid[:12], slot.index, build.message)

    def _build_again(self, rec, slot: WorkerSlot, incarnation: int, build: WorkerBuild) -> None:
        """The retry of a build that found no room, unless the template was deleted, built
        again or its worker replaced meanwhile (resync() builds it on the new incarnation)."""
        if self.records.get(rec.template_id) is not rec or rec.builds.get(slot.index) is not build:
            return
        if self.draining or slot.starts != incarnation or slot.client is None or not slot.accepting:
            return  # (a worker back up is resynced: it rebuilds what it has records for)
        try:
            self._build(rec, slot, build.attempts + 1)
        except RuntimeError:  # the client closed: the worker is being replaced; resync rebuilds
            rec.builds[slot.index] = build

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
        for residency, _ in self._reports.values():
            residency.pop(template_id, None)
        for fresh in self._fresh.values():
            fresh.pop(template_id, None)
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
        """A (re)started worker: build again what it had build records for (its node's
        DRAM/disk tiers answer at once for caches that survived)."""
        self._reports.pop(slot.index, None)
        self._fresh.pop(slot.index, None)
        for rec in self.records.values():
            if slot.index in rec.builds:
                self._build(rec, slot)

    # ---- residency --------------------------------------------------------------------------
    def refresh(self, slot: WorkerSlot, residency: dict[str, dict[str, int]], asked_at: float):
        """A Stats answer of `slot` (asked for at monotonic `asked_at`) said where its
        templates' caches live: refresh `templates_ready` / `template_tiers` of every worker of
        its node (they share its DRAM and disk tiers)."""
        old = self._reports.get(slot.index)
        self._reports[slot.index] = (dict(residency), asked_at)
        if old is not None and old[0] == residency and not self._fresh.get(slot.index):
            return  # the same as its last answer: nothing changed on the node
        for s in self.pool.slots:
            if s.node == slot.node:
                self._apply(s)

    def _apply(self, slot: WorkerSlot) -> None:
        """`slot`'s view from its own last report (every tier), its node's other accepting
        workers' reports (their DRAM/disk tiers only) and the builds answered ok since its
        report was asked for; registered templates only."""
        if not slot.accepting:  # down or restarting: the pool cleared it; resync() rebuilds
            return
        # no report of its own yet: every build it answered ok stands
        own, asked_at = self._reports.get(slot.index, ({}, -math.inf))
        tiers: dict[str, dict[str, int]] = {}

        def add(residency: dict[str, dict[str, int]], shared_only: bool) -> None:
            for tid, by_tier in residency.items():
                if tid not in self.records:
                    continue
                for tier, n in by_tier.items():
                    if n > 0 and not (shared_only and tier not in NODE_TIERS):
                        tiers.setdefault(tid, {})[tier] = n

        add(own, shared_only=False)
        for s in self.pool.slots:
            if s is not slot and s.node == slot.node and s.accepting and s.index in self._reports:
                add(self._reports[s.index][0], shared_only=True)
        fresh = self._fresh.get(slot.index, {})
        for tid, b in list(fresh.items()):
            rec = self.records.get(tid)
            if rec is None or rec.builds.get(slot.index) is not b or b.ready_at < asked_at:
                del fresh[tid]  # forgotten, rebuilt, or its report covers it
                continue
            held = tiers.setdefault(tid, {})
            for tier, n in b.bytes_by_tier.items():
                held.setdefault(tier, n)
        slot.templates_ready = set(tiers)
        slot.template_tiers = {tid: fastest_tier(by_tier) for tid, by_tier in tiers.items()}

    @property
    def building(self) -> int:
        return sum(
            1 for r in self.records.values() for b in r.builds.values() if b.state == "building"
        )
