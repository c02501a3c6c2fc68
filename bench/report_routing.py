"""Markdown table comparing routing policies from `instgenie loadtest --out` reports (one per
policy, same seed and workload): latency percentiles, SLO attainment, and how the work split
across workers (requests and summed denoise time per worker). Not a test.

    python3 bench/report_routing.py least-loaded=out/ll/mixed.json mask-aware=out/ma/mixed.json

Repeated runs are named POLICY@RUN (e.g. mask-aware@a): a second table then pools every run of a
policy at each rate (all their requests' latencies) and gives a bootstrap 95 % interval of each
policy's p50 and p95 minus the first policy's (resampling requests within each run).
"""

from __future__ import annotations

import collections
import sys

import numpy as np

from instgenie.loadtest.report import load_named

BOOTSTRAP = 4000  # resamples for the pooled intervals


def _rows(phase: dict) -> tuple[dict, dict]:
    """(requests per worker, denoise seconds per worker) of a phase's ok requests."""
    count: collections.Counter = collections.Counter()
    busy: collections.Counter = collections.Counter()
    for r in phase["rows"]:
        if r.get("status") == 200 and r.get("worker") is not None:
            count[r["worker"]] += 1
            busy[r["worker"]] += (r.get("timings") or {}).get("denoise_ms", 0.0) / 1e3
    return dict(sorted(count.items())), dict(sorted(busy.items()))


def main(argv: list[str]) -> int:
    reports = load_named(argv)
    print("| rate | policy | ok | p50 s | p95 s | p99 s | SLO | requests per worker "
          "| denoise s per worker |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---|---|")
    phases = max(len(r["phases"]) for _, r in reports)
    for k in range(phases):
        for name, rep in reports:
            if k >= len(rep["phases"]):
                continue
            p = rep["phases"][k]
            lat = p["latency_ms"]
            count, busy = _rows(p)
            slo = p.get("slo_attainment")
            print(
                f"| {p['rate']:g}/s | {name} | {p['ok']}/{p['requests']} "
                f"| {lat['p50'] / 1e3:.2f} | {lat['p95'] / 1e3:.2f} | {lat['p99'] / 1e3:.2f} "
                f"| {'' if slo is None else f'{100 * slo:.0f}%'} "
                f"| {' / '.join(str(v) for v in count.values())} "
                f"| {' / '.join(f'{v:.1f}' for v in busy.values())} |"
            )
    if any("@" in name for name, _ in reports):
        pooled(reports)
    return 0


def _latencies(phase: dict) -> np.ndarray:
    """Client latencies of a phase, s; a request that failed counts as infinitely late."""
    return np.array([r["latency_ms"] / 1e3 if r.get("status") == 200 else np.inf
                     for r in phase["rows"]])  # fmt: skip


def pooled(reports: list[tuple[str, dict]]) -> None:
    runs: dict[tuple[float, str], list[np.ndarray]] = collections.defaultdict(list)
    order: list[str] = []
    slo_s: dict[tuple[float, str], float] = {}  # the phases' SLO, s
    for name, rep in reports:
        policy = name.partition("@")[0]
        if policy not in order:
            order.append(policy)
        for p in rep["phases"]:
            runs[(p["rate"], policy)].append(_latencies(p))
            slo_s[(p["rate"], policy)] = p.get("slo_ms", 5000.0) / 1e3
    rng = np.random.default_rng(0)
    print("\n| rate | policy | runs | requests | p50 s | p95 s | SLO | "
          f"p50 − {order[0]} (95 % CI) | p95 − {order[0]} (95 % CI) |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---|---|")

    def boot(samples: list[np.ndarray]) -> np.ndarray:
        """(BOOTSTRAP, 2) p50, p95 of the pooled requests, each run resampled on its own."""
        out = np.empty((BOOTSTRAP, 2))
        for i in range(BOOTSTRAP):
            x = np.concatenate([rng.choice(s, size=s.size) for s in samples])
            out[i] = np.percentile(x, [50, 95])
        return out

    for rate in sorted({r for r, _ in runs}):
        base = boot(runs[(rate, order[0])]) if (rate, order[0]) in runs else None
        for policy in order:
            if (rate, policy) not in runs:
                continue
            samples = runs[(rate, policy)]
            x = np.concatenate(samples)
            p50, p95 = np.percentile(x, [50, 95])
            slo = float(np.mean(x <= slo_s[(rate, policy)]))
            cells = ["", ""]
            if base is not None and policy != order[0]:
                d = boot(samples) - base
                lo, hi = np.percentile(d, [2.5, 97.5], axis=0)
                cells = [f"{np.median(d[:, j]):+.2f} s ({lo[j]:+.2f} … {hi[j]:+.2f})"
                         for j in range(2)]  # fmt: skip
            print(f"| {rate:g}/s | {policy} | {len(samples)} | {x.size} | {p50:.2f} | {p95:.2f} "
                  f"| {100 * slo:.0f}% | {cells[0]} | {cells[1]} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
