"""Configuration of the API + scheduler process (`instgenie serve`).

Frozen, like the rest of the config tree in instgenie/config.py; `instgenie serve` builds its flags
from these fields (add_dataclass_args), with the comment above each field as its help text.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTING_POLICIES = ("least-loaded", "mask-aware", "cache-aware", "round-robin")
#: how many workers each node of a cluster runs (--workers): one per GPU, or a count
WORKERS_AUTO = "auto"


@dataclass(frozen=True)
class ServerConfig:
    #: interface the HTTP server binds; loopback unless deliberately exposed
    host: str = "127.0.0.1"
    #: TCP port; 0 = any free port (printed on the "serving on" line)
    port: int = 8000
    #: serve the web editor (instgenie/ui: paint a mask, run an edit, compare) at `/`; --no-ui
    #: serves the API alone
    ui: bool = True
    #: largest request body, bytes (uploads included), checked before parsing: 413
    max_body_bytes: int = 64 << 20
    #: most parts in one multipart body, counted as bytes arrive: 413
    max_parts: int = 32
    #: largest non-file multipart field (prompt, numbers), bytes
    max_field_bytes: int = 64 << 10
    #: requests waiting in this process for a worker slot; beyond it: 429 with Retry-After
    max_queue: int = 64
    #: requests in flight on one worker at a time; 0 = twice the worker's max_batch
    worker_slots: int = 0
    #: routing policy across workers (scheduler/routing.py): "least-loaded" | "mask-aware"
    #: (predicted latency from each worker's latency models and the request's mask; measured no
    #: better on an H200 pair, docs/benchmarks/routing-h200.md) | "cache-aware" (mask-aware priced
    #: with the tier each worker's node holds the template's cache in; a miss costs the full run
    #: plus its capture; for several hosts, docs/benchmarks/cluster-sim.md) | "round-robin"
    routing: str = "least-loaded"
    #: most an edit or template capture may cost, in native edits (one edit at the model's
    #: native area with its default steps = 1; priced from the worker's profile, else FLOPs;
    #: server/admission.py); beyond it: 422 too_costly. 0 = 32
    max_request_cost: float = 0.0
    #: most seconds of a worker's loop an edit or capture may take as its profile predicts
    #: (workers without --profile are not limited by it); beyond it: 422 too_costly. 0 = off
    max_request_seconds: float = 0.0
    #: a worker whose loop has been in one model stage call (VAE/prompt encode, VAE decode) this
    #: long, seconds, is degraded: /health says so and routing sends it nothing new while
    #: another worker is not (well below WorkerConfig.stage_timeout_s, which kills it); sooner,
    #: at 4x the call's expected time (5 s at least), where the worker's profile prices it
    stage_overrun_s: float = 30.0
    #: Retry-After of 429 and retryable 503 answers, seconds
    retry_after_s: int = 2
    #: an edit not finished after this long, seconds, is cancelled and answered 504
    request_timeout_s: float = 600.0
    #: most async jobs kept (running and finished); finished ones are dropped oldest first
    max_jobs: int = 256
    #: finished async jobs are forgotten this long after they finish, seconds
    job_ttl_s: float = 600.0
    #: most registered templates
    max_templates: int = 256
    #: most registered LoRAs (POST /v1/loras, their files in --lora-dir); beyond it:
    #: 409 too_many_loras
    max_loras: int = 1024
    #: SQLite file keeping the registered templates and async jobs across restarts (written
    #: before the API answers; docs/api.md, "What survives a restart"); "" = server.sqlite3
    #: under the cache root (--cache-root; by default the one derived from the machine), or,
    #: with --cache-root "", in memory only (nothing survives); "none" = in memory only. One
    #: running server per file.
    state_db: str = ""
    #: steps of a template, or of an edit of no template, that names none (an edit of a template
    #: that names none runs the template's steps); 0 = the model's default
    default_steps: int = 0
    #: seconds between health polls of each worker (stats, step log)
    health_poll_s: float = 0.5
    #: a worker whose last stats answer is older than this, seconds, is unhealthy
    health_timeout_s: float = 3.0
    #: append every worker's step log (messages.StepEntry, as polled) to this file, one JSON
    #: object per step with "worker" and "node" added; "" = off. For calibrating the simulator
    #: and the profile against a served workload (bench/report_cluster.py)
    step_log: str = ""
    #: a worker holding requests in its loop whose step counter has not moved for this long,
    #: seconds, is unhealthy (a stuck loop)
    stall_s: float = 30.0
    #: a worker whose supervisor answers no stats for this long, seconds (frozen, or its client
    #: connection is gone), is killed: its requests fail with worker_died and it is restarted;
    #: 0 = never
    worker_hang_s: float = 60.0
    #: restart a worker whose supervisor process exited
    restart_workers: bool = True
    #: a worker (re)start that is not ready after this long, seconds, fails
    worker_start_timeout_s: float = 900.0
    #: on SIGTERM/SIGINT, in-flight requests get this long to finish, seconds
    drain_timeout_s: float = 300.0
    #: serve on a Ray cluster (pip install instgenie[cluster]): its address, e.g.
    #: "ray://head:10001" or "head:6379"; "auto" = the cluster this host belongs to (`ray
    #: start`); "" = this host only, one worker per --devices entry (Ray is not imported)
    cluster: str = ""
    #: with --cluster: workers per node, "auto" = one per GPU of every node (one per node for a
    #: --devices cpu model), or a count; nodes that join later get theirs without a restart
    workers: str = WORKERS_AUTO
    #: with --cluster: seconds between reads of the cluster's nodes (joins and leaves)
    cluster_poll_s: float = 2.0


def check_server_config(cfg: ServerConfig) -> None:
    """ValueError naming the field for values that cannot work."""
    if cfg.routing not in ROUTING_POLICIES:
        raise ValueError(f"routing: {cfg.routing!r} is not one of {ROUTING_POLICIES}")
    if cfg.workers != WORKERS_AUTO and not (cfg.workers.isdigit() and int(cfg.workers) > 0):
        raise ValueError(f"workers: must be {WORKERS_AUTO!r} or a positive count, got "
                         f"{cfg.workers!r}")  # fmt: skip
    if not 0 <= cfg.port <= 65535:
        raise ValueError(f"port: {cfg.port} is not in 0..65535")
    for name in ("max_body_bytes", "max_parts", "max_field_bytes", "max_jobs", "max_templates",
                 "max_loras"):  # fmt: skip
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(cfg, name)}")
    for name in ("max_queue", "worker_slots", "retry_after_s", "default_steps", "worker_hang_s",
                 "drain_timeout_s", "max_request_cost", "max_request_seconds"):  # fmt: skip
        if not getattr(cfg, name) >= 0:  # nan too (it would switch a limit off)
            raise ValueError(f"{name}: must be >= 0, got {getattr(cfg, name)}")
    for name in ("request_timeout_s", "health_poll_s", "health_timeout_s", "stall_s",
                 "worker_start_timeout_s", "job_ttl_s", "stage_overrun_s",
                 "cluster_poll_s"):  # fmt: skip
        if not getattr(cfg, name) > 0:  # nan too
            raise ValueError(f"{name}: must be > 0, got {getattr(cfg, name)}")
