"""Health: every worker is polled in the background; probes read the last result.

One poll at a time per worker (stats, with where its templates' caches live, then the step log
since the last poll), each bounded by `health_timeout_s`, on this module's own threads: a frozen
worker makes its poll wait, never the probes, and polls never pile up (RELIABILITY #8). A worker
can make progress when its supervisor is alive and answers, its processes are all up, and its
loop's step counter moves while it holds requests (`WorkerSlot.health`). A supervisor found dead
is reported to `on_death` once; every other finished poll to `on_residency` (where the worker's
template caches live: TemplateRegistry.refresh), then to `on_poll` (the runtime hands queued
requests to a worker that has just turned healthy: routing prefers healthy workers, and a queue
waiting on full healthy workers would otherwise move only at the next request completion).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from instgenie.cache.budgets import CacheDefaults
from instgenie.config import to_dict
from instgenie.server.config import ServerConfig
from instgenie.server.metrics import Metrics
from instgenie.server.pool import WorkerPool, WorkerSlot
from instgenie.worker.client import WorkerError

log = logging.getLogger("instgenie.server")


class HealthMonitor:
    def __init__(
        self,
        pool: WorkerPool,
        cfg: ServerConfig,
        metrics: Metrics,
        on_death: Callable[[WorkerSlot, str], None],
        on_poll: Callable[[WorkerSlot], None] | None = None,
        cache: CacheDefaults | None = None,
        on_residency: Callable[[WorkerSlot, dict[str, dict[str, int]], float], None] | None = None,
    ) -> None:
        self.pool = pool
        #: each Stats answer's residency (template -> {tier: bytes}) with the monotonic time it
        #: was asked for (TemplateRegistry.refresh), before on_poll
        self.on_residency = on_residency
        #: the host cache the workers were started with (resolved once by the launcher)
        self.cache = cache
        self.cfg = cfg
        self.metrics = metrics
        self.on_death = on_death
        self.on_poll = on_poll
        # one poll at a time per worker: sized for a fleet whose slots come and go (cluster)
        self._executor = ThreadPoolExecutor(
            max_workers=max(len(pool.slots), 64), thread_name_prefix="health"
        )
        self._tasks: dict[int, asyncio.Task] = {}  # slot index -> its watch

    def start(self) -> None:
        for s in self.pool.slots:
            self.watch(s)

    def watch(self, slot: WorkerSlot) -> None:
        """Poll `slot` from now on (a slot added while serving: cluster mode)."""
        if slot.index not in self._tasks:
            self._tasks[slot.index] = asyncio.create_task(self._watch(slot))

    def unwatch(self, slot: WorkerSlot) -> None:
        """Stop polling a removed slot."""
        task = self._tasks.pop(slot.index, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _watch(self, slot: WorkerSlot) -> None:
        while True:
            try:
                await self._poll(slot)
            except asyncio.CancelledError:
                raise
            except Exception:  # a poll must never end the watch
                log.exception("health poll of worker %d failed", slot.index)
            await asyncio.sleep(self.cfg.health_poll_s)

    async def _poll(self, slot: WorkerSlot) -> None:
        handle = slot.handle
        if handle is None or slot.state != "up":
            return
        rc = handle.proc.poll()
        if rc is not None:
            reason = f"its supervisor (pid {handle.pid}) exited with status {rc}"
            slot.last_error = reason
            log.error("worker %d: %s", slot.index, reason)
            self.on_death(slot, reason)
            return
        loop = asyncio.get_running_loop()
        client, timeout = handle.client, self.cfg.health_timeout_s
        asked_at = time.monotonic()
        try:
            report = await loop.run_in_executor(self._executor, client.report, timeout)
        except (TimeoutError, WorkerError, RuntimeError):
            self._fence(slot, handle)
            return  # stats_at stays old: unhealthy once health_timeout_s has passed
        if slot.handle is not handle:
            return
        stats = report.counters
        slot.observe(stats, time.monotonic())
        if self.on_residency is not None:
            self.on_residency(slot, report.residency, asked_at)
        if self.on_poll is not None:
            self.on_poll(slot)
        steps = int(stats.get("steps_total", 0))
        if steps > slot.step_cursor:
            try:
                entries = await loop.run_in_executor(
                    self._executor, client.step_log, slot.step_cursor, timeout
                )
            except (TimeoutError, WorkerError, RuntimeError):
                return
            if slot.handle is handle and entries:
                new = [e for e in entries if e.step >= slot.step_cursor]
                self.metrics.observe_steps(slot.index, new, slot.node)
                if self.cfg.step_log:
                    self._append_steps(slot, new)
                slot.step_cursor = max(e.step for e in entries) + 1

    def _append_steps(self, slot: WorkerSlot, entries: list) -> None:
        """`entries` of `slot` as JSON lines at cfg.step_log (append; a write error is logged
        once per poll and loses only those lines: it must never stop health polling)."""
        try:
            with open(self.cfg.step_log, "a") as f:
                for e in entries:
                    row = {"worker": slot.index, "node": slot.node} | dataclasses.asdict(e)
                    f.write(json.dumps(row) + "\n")
        except OSError as exc:
            log.warning("step log %s: %s", self.cfg.step_log, exc)

    def _fence(self, slot: WorkerSlot, handle) -> None:
        """Kill a supervisor that has answered nothing for worker_hang_s: the next poll sees it
        exit and the death path fails its requests (worker_died) and restarts it."""
        silent = time.monotonic() - slot.stats_at
        hang = self.cfg.worker_hang_s
        if hang > 0 and silent > hang and handle.proc.poll() is None:
            log.error("worker %d: no stats answer for %.0f s; killing its supervisor (pid %d)",
                      slot.index, silent, handle.pid)  # fmt: skip
            handle.proc.kill()

    def report(self) -> tuple[bool, list[dict]]:
        """(any worker can make progress, per worker details: "status" ok | degraded (healthy,
        but its loop overruns one stage call: routing avoids it) | unhealthy)."""
        now = time.monotonic()
        rows = []
        for s in self.pool.slots:
            ok, why = s.health(now, self.cfg.health_timeout_s, self.cfg.stall_s)
            stage, busy_s = s.busy() if ok else ("", 0.0)
            overrun = s.overrun(self.cfg.stage_overrun_s) if ok else ""
            rows.append(
                {
                    "index": s.index,
                    "node": s.node,
                    "node_ip": s.node_ip or None,
                    "device": s.device,
                    "state": s.state,
                    "healthy": ok,
                    "status": "degraded" if overrun else "ok" if ok else "unhealthy",
                    "busy_stage": stage or None,
                    "busy_s": round(busy_s, 3),
                    "reason": overrun or why or None,
                    "pid": s.handle.pid if s.handle is not None else None,
                    "address": s.handle.address if s.handle is not None else None,
                    "in_flight": s.in_flight,
                    "restarts": s.restarts,
                    "batch_size": int(s.stats.get("batch_size_last", 0)),
                    "steps_total": int(s.stats.get("steps_total", 0)),
                    "last_stats_age_s": round(now - s.stats_at, 3) if s.stats_at else None,
                    "cost_model": cost_model(s),
                    "cache_gpu_budget_bytes": gpu_budget(s),
                    # what its processes were started with (their config; nothing re-reads it)
                    "execution": to_dict(s.config.model.execution),
                }
            )
        return any(r["healthy"] for r in rows), rows

    def cache_report(self) -> dict | None:
        """/health's "cache": the host cache's root and each tier's budget, bytes, with how it
        was derived (cache/budgets.py); the GPU tier's budget is each worker's own (its loop
        measures it after loading the model and reports it in its stats), summed here."""
        if self.cache is None:
            return None
        out = self.cache.to_dict()
        budgets = [b for b in map(gpu_budget, self.pool.slots) if b is not None]
        if budgets:
            gpu = {"budget_bytes": sum(budgets), "source": "reported by the workers' loops "
                   "(each worker's own: workers[].cache_gpu_budget_bytes)"}  # fmt: skip
        elif not self.cache.root:
            gpu = {"budget_bytes": None,
                   "source": "no budget: every template in its loop's device memory"}  # fmt: skip
        else:
            gpu = {"budget_bytes": None, "source": "not reported: no GPU tier above DRAM"}
        out["tiers"] = {"gpu": gpu, **out["tiers"]}
        return out


def gpu_budget(slot: WorkerSlot) -> int | None:
    """The GPU tier's budget the worker's loop reports (stats "cache_budget_gpu_bytes"), bytes;
    None until it reports one."""
    value = slot.stats.get("cache_budget_gpu_bytes")
    return None if value is None else int(value)


def cost_model(slot: WorkerSlot) -> str | None:
    """How the mask-aware router prices `slot` (WorkerHealth.cost_model)."""
    if slot.cost is None:
        return None
    return "profile" if slot.cost.compute else "flops"
