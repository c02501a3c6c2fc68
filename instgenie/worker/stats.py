"""The worker's counters (GetStats): a flat name -> float map read by clients, the server's health
checks and its Prometheus metrics. Built from the supervisor's state; changes nothing."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from instgenie.worker.supervisor import Supervisor


def worker_stats(sup: Supervisor) -> dict[str, float]:
    out = {k: float(v) for k, v in sup.counters.items()}
    stages = [f.stage for f in sup.flights.values()]
    out.update({f"in_{s}": float(stages.count(s)) for s in ("queued", "pre", "loop", "post")})
    out["in_flight"] = float(len(sup.flights))
    states = [t.state for t in sup.templates.values()]
    out.update({f"templates_{s}": float(states.count(s)) for s in ("building", "ready", "failed")})
    out["ready"] = float(sup.ready)
    out["steps_total"] = float(sup.step_offset + sup.loop_steps)
    #: > 0 while the loop encodes/decodes (under stage_timeout_s): busy, not stalled
    loop = [c for c in sup.children if c.role == "loop"]
    out["loop_busy_s"] = max((c.busy_s for c in loop), default=0)
    #: 1.0 for the stage call the loop is in ("loop_busy_encode", "loop_busy_decode")
    for c in loop:
        if c.busy_stage:
            out[f"loop_busy_{c.busy_stage}"] = 1.0
    out["uptime_s"] = time.monotonic() - sup.started
    out["garbage_frames"] = float(sup.server.garbage_frames + sup.inbox.garbage_frames)
    out["pid_supervisor"] = float(os.getpid())
    for c in sup.children:
        out[f"pid_{c.role}_{c.index}"] = float(c.pid)
        out[f"restarts_{c.role}_{c.index}"] = float(c.restarts)
        out[f"codec_{c.role}_{c.index}"] = float(c.codec)
    if sup.w.cache_root:  # block loads come from the host DRAM tier
        out["cache_bytes_loaded_dram"] = float(sup.bytes_loaded)
    for k in ("evictions_dram", "evictions_disk", "bytes_dram", "bytes_disk", "corrupt"):
        if k in sup.cache_stats:
            out[f"cache_{k}"] = sup.cache_stats[k]
    # the loop's device tier (cache/device_tier.py), named by its tier: "gpu" (CUDA) or "cpu"
    for t in ("gpu", "cpu"):
        for k in (f"bytes_{t}", f"entries_{t}", f"budget_{t}_bytes", f"promotions_{t}",
                  f"demotions_{t}", f"evictions_{t}", f"in_flight_{t}"):  # fmt: skip
            if k in sup.cache_stats:
                out[f"cache_{k}"] = sup.cache_stats[k]
    # every tier budget the loop reports (e.g. "budget_gpu_bytes", measured after model load)
    out.update((f"cache_{k}", v) for k, v in sup.cache_stats.items() if k.startswith("budget_"))
    # the loop's prompt-encoder cache (model_stages="loop"; pre processes keep their own)
    out.update((k, v) for k, v in sup.cache_stats.items() if k.startswith("prompt_"))
    if sup.steps:  # 0 once the loop reports an empty batch (the gauge must come back down)
        idle = all(c.running == 0 for c in sup.children if c.role == "loop")
        out["batch_size_last"] = 0.0 if idle else float(len(sup.steps[-1].members))
    if sup.latency:
        arr = np.asarray(sup.latency)
        for q in (50, 95, 99):
            out[f"total_ms_p{q}"] = float(np.percentile(arr[:, 0], q))
            out[f"queue_ms_p{q}"] = float(np.percentile(arr[:, 1], q))
    return out
