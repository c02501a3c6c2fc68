"""Markdown table comparing routing policies from `instgenie loadtest --out` reports (one per
policy, same seed and workload): latency percentiles, SLO attainment, and how the work split
across workers (requests and summed denoise time per worker). Not a test.

    python3 bench/report_routing.py least-loaded=out/ll/mixed.json mask-aware=out/ma/mixed.json
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


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
    reports = []
    for arg in argv:
        name, _, path = arg.partition("=")
        reports.append((name, json.loads(Path(path).read_text())))
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
