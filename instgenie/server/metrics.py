"""Prometheus metrics of one app (its own CollectorRegistry, so several apps can coexist).

Counted as things happen: HTTP requests by route and status, edits by path and cache result,
cache hits by tier, edit latency, denoise step time and cache bytes loaded (from the workers'
step logs). Read at scrape time from the live state: server queue depth, per worker in-flight,
queue depth, running batch size, up/down, restarts, template states, and the workers' own cache
counters (`cache_hits_<tier>`, `cache_evictions_<tier>`, `cache_promotions_<tier>`, ... in their
Stats, when reported).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from instgenie.messages import StepEntry

#: fastest first: the tier a cache hit is attributed to is the fastest one holding the entry
TIER_ORDER = ("gpu", "cuda", "cpu", "dram", "disk")
_MIRRORED = {  # worker Stats prefix -> (metric name, help)
    "cache_hits_": ("instgenie_worker_cache_hits", "Template cache hits reported by the worker"),
    "cache_evictions_": ("instgenie_cache_evictions", "Cache entries evicted, by tier"),
    "cache_promotions_": (
        "instgenie_cache_promotions",
        "Template caches copied into the worker's device tier, by tier",
    ),
    "cache_bytes_loaded_": ("instgenie_worker_cache_bytes_loaded", "Bytes loaded, by tier"),
}

_PROMPT_CACHE = {  # worker Stats key -> (metric name, help); the loop's prompt-encoder cache
    "prompt_hits": ("instgenie_prompt_cache_hits", "Prompt encodes answered from the cache"),
    "prompt_misses": ("instgenie_prompt_cache_misses", "Prompt encodes run (cache misses)"),
    "prompt_evictions": ("instgenie_prompt_cache_evictions", "Prompt cache entries evicted"),
    "prompt_bytes": ("instgenie_prompt_cache_bytes", "Bytes held by the prompt cache"),
}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http = Counter(
            "instgenie_http_requests",
            "HTTP requests by route and status",
            ["method", "route", "status"],
            registry=r,
        )
        self.edits = Counter(
            "instgenie_edits",
            "Finished edits by path taken and cache result",
            ["path", "cache"],
            registry=r,
        )
        self.cache_hits = Counter(
            "instgenie_cache_hits",
            "Template cache hits of edits, by the tier the worker read the cache from",
            ["tier"],
            registry=r,
        )
        self.failures = Counter(
            "instgenie_edit_failures",
            "Admitted edits that failed (worker, timeout, cancel), by code; refused input is in "
            "instgenie_http_requests_total",
            ["code"],
            registry=r,
        )
        self.edit_seconds = Histogram(
            "instgenie_edit_seconds",
            "Edit latency seen by the server (admitted -> answered)",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300),
            registry=r,
        )
        self.retries = Counter(
            "instgenie_edit_retries",
            "Edits run again on another worker because theirs died (the request's retry field)",
            registry=r,
        )
        self.step_seconds = Histogram(
            "instgenie_step_seconds",
            "Denoise step wall time, by worker and by how its backbone ran (graph: replay, "
            "capture, warmup or eager; engine.graphs)",
            ["worker", "node", "graph"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.bytes_loaded = Counter(
            "instgenie_cache_bytes_loaded",
            "Cached activation bytes copied in by denoise steps",
            ["worker", "node"],
            registry=r,
        )

    def observe_steps(self, worker: int, entries: Iterable[StepEntry], node: str = "local") -> None:
        label = str(worker)
        for e in entries:
            self.step_seconds.labels(label, node, e.graph).observe(e.duration_ms / 1e3)
            if e.bytes_loaded:
                self.bytes_loaded.labels(label, node).inc(e.bytes_loaded)

    def add_live(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Register a callable that yields metric families at each scrape."""

        class _Live:
            def collect(self) -> Iterable[Metric]:
                return collect()

        self.registry.register(_Live())

    def render(self) -> bytes:
        return generate_latest(self.registry)


def fastest_tier(bytes_by_tier: dict[str, int]) -> str:
    held = [t for t, n in bytes_by_tier.items() if n > 0]
    if not held:
        return "unknown"
    return min(held, key=lambda t: TIER_ORDER.index(t) if t in TIER_ORDER else len(TIER_ORDER))


def live_families(server_queue: int, workers: list[dict], templates: dict[str, int]):
    """Gauges of the current state. `workers`: per worker {"index", "node", "in_flight", "up",
    "restarts", "stats"}; `templates`: state -> count. Every per-worker family is labelled by
    worker (the slot index) and node (the host it runs on: "local" on one host)."""
    q = GaugeMetricFamily("instgenie_queue_depth", "Requests waiting in the server queue")
    q.add_metric([], server_queue)
    yield q
    gauges = {
        "in_flight": GaugeMetricFamily(
            "instgenie_worker_in_flight",
            "Requests sent to the worker and not answered",
            labels=["worker", "node"],
        ),
        "queue": GaugeMetricFamily(
            "instgenie_worker_queue_depth",
            "Requests the worker holds outside its denoise loop",
            labels=["worker", "node"],
        ),
        "batch": GaugeMetricFamily(
            "instgenie_batch_size",
            "Requests in the worker's running batch (0 when its loop holds none)",
            labels=["worker", "node"],
        ),
        "up": GaugeMetricFamily(
            "instgenie_worker_up", "1 if the worker can make progress", labels=["worker", "node"]
        ),
    }
    restarts = CounterMetricFamily(
        "instgenie_worker_restarts",
        "Restarts of the worker's processes: its supervisor by the server, its loop, pre and post "
        "processes by its supervisor",
        labels=["worker", "node"],
    )
    mirrored = {
        p: CounterMetricFamily(n, h, labels=["worker", "node", "tier"])
        for p, (n, h) in _MIRRORED.items()
    }
    prompts = {
        k: (GaugeMetricFamily if k == "prompt_bytes" else CounterMetricFamily)(
            name, help_, labels=["worker", "node"]
        )
        for k, (name, help_) in _PROMPT_CACHE.items()
    }
    for w in workers:
        label, stats = [str(w["index"]), w.get("node", "local")], w["stats"]
        gauges["in_flight"].add_metric(label, w["in_flight"])
        gauges["queue"].add_metric(label, stats.get("in_queued", 0) + stats.get("in_pre", 0))
        gauges["batch"].add_metric(label, stats.get("batch_size_last", 0))
        gauges["up"].add_metric(label, 1.0 if w["up"] else 0.0)
        restarts.add_metric(label, w["restarts"])
        for k, family in prompts.items():
            if k in stats:
                family.add_metric(label, stats[k])
        for name, value in stats.items():
            for prefix, family in mirrored.items():
                if name.startswith(prefix):
                    family.add_metric([*label, name[len(prefix) :]], value)
    yield from gauges.values()
    yield restarts
    yield from mirrored.values()
    yield from prompts.values()
    t = GaugeMetricFamily("instgenie_templates", "Registered templates by state", labels=["state"])
    for state in ("building", "ready", "failed"):
        t.add_metric([state], templates.get(state, 0))
    yield t
