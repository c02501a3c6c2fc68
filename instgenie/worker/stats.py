"""The worker's counters (GetStats): a flat name -> float map read by clients, the server's health
checks and its Prometheus metrics. Built from the supervisor's parts; changes nothing."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from instgenie.worker.supervisor import Supervisor


def worker_stats(sup: Supervisor) -> dict[str, float]:
    requests, templates, children = sup.requests, sup.templates, sup.children
    reports = sup.loop_reports
    out = {k: float(v) for k, v in {**requests.counters, **templates.counters}.items()}
    out["child_deaths"] = float(children.deaths)
    out.update((f"cache_hits_{tier}", float(n)) for tier, n in requests.cache_hits.items())
    out.update((f"in_{s}", float(n)) for s, n in requests.stages().items())
    out["in_flight"] = float(len(requests))
    out.update((f"templates_{s}", float(n)) for s, n in templates.states().items())
    out["ready"] = float(children.ready)
    out["steps_total"] = float(reports.steps_total)
    #: > 0 while the loop encodes/decodes (under stage_timeout_s): busy, not stalled
    loops = [c.watchdog for c in children.all if c.role == "loop"]
    out["loop_busy_s"] = max((d.busy_s for d in loops), default=0)
    #: 1.0 for the stage call the loop is in ("loop_busy_encode", "loop_busy_decode")
    for d in loops:
        if d.busy_stage:
            out[f"loop_busy_{d.busy_stage}"] = 1.0
    out["uptime_s"] = time.monotonic() - sup.started
    out["garbage_frames"] = float(sup.clients.server.garbage_frames + children.inbox.garbage_frames)
    out["pid_supervisor"] = float(os.getpid())
    for c in children.all:
        out[f"pid_{c.role}_{c.index}"] = float(c.pid)
        out[f"restarts_{c.role}_{c.index}"] = float(c.restarts)
        out[f"codec_{c.role}_{c.index}"] = float(c.codec)
    if sup.config.worker.cache_root:  # block loads come from the host DRAM tier
        out["cache_bytes_loaded_dram"] = float(reports.bytes_loaded)
    for k in ("evictions_dram", "evictions_disk", "bytes_dram", "bytes_disk", "corrupt"):
        if k in reports.cache_stats:
            out[f"cache_{k}"] = reports.cache_stats[k]
    # the loop's device tier (cache/device_tier.py), named by its tier: "gpu" (CUDA) or "cpu"
    for t in ("gpu", "cpu"):
        for k in (f"bytes_{t}", f"entries_{t}", f"budget_{t}_bytes", f"promotions_{t}",
                  f"demotions_{t}", f"evictions_{t}", f"in_flight_{t}"):  # fmt: skip
            if k in reports.cache_stats:
                out[f"cache_{k}"] = reports.cache_stats[k]
    # every tier budget the loop reports (e.g. "budget_gpu_bytes", measured after model load)
    out.update((f"cache_{k}", v) for k, v in reports.cache_stats.items() if k.startswith("budget_"))
    # the loop's prompt-encoder cache (model_stages="loop"; pre processes keep their own)
    out.update((k, v) for k, v in reports.cache_stats.items() if k.startswith("prompt_"))
    if reports.steps:  # 0 once the loop reports an empty batch (the gauge must come back down)
        idle = all(d.running == 0 for d in loops)
        out["batch_size_last"] = 0.0 if idle else float(len(reports.steps[-1].members))
    if requests.latency:
        arr = np.asarray(requests.latency)
        for q in (50, 95, 99):
            out[f"total_ms_p{q}"] = float(np.percentile(arr[:, 0], q))
            out[f"queue_ms_p{q}"] = float(np.percentile(arr[:, 1], q))
    return out
