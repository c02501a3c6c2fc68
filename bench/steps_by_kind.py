"""Summarise a served step log (`instgenie serve --step-log`) by how each step ran: graph mode
(replay, capture, warmup, eager), members, capture runs (uid "template:...") among them, members
on the full path, and whether a capture run was at its first step (where its DRAM segment is
pinned). Not a test.

    python bench/steps_by_kind.py docs/benchmarks/data/cluster-h200/pinned-0.5/steps-*.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

from instgenie.sim.physics import CAPTURE_UID_PREFIX


def main(paths: list[str]) -> int:
    for path in paths:
        groups: dict[tuple, list[float]] = defaultdict(list)
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for r in rows:
            caps = [s for u, s in r["members"] if u.startswith(CAPTURE_UID_PREFIX)]
            full = len(r["members"]) - len(caps) - sum(r["tiers"].values())
            groups[(r["graph"], len(r["members"]), len(caps), full, 0 in caps)].append(
                r["duration_ms"]
            )
        total = sum(r["duration_ms"] for r in rows) / 1e3
        print(f"{path}: {len(rows)} steps, {total:.1f} s")
        print("| graph | members | captures | full path | a capture's first step | steps | "
              "median ms | mean ms |")  # fmt: skip
        print("|---|---:|---:|---:|---|---:|---:|---:|")
        for k in sorted(groups):
            v = groups[k]
            print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {'yes' if k[4] else ''} | {len(v)} | "
                  f"{statistics.median(v):.0f} | {statistics.mean(v):.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
