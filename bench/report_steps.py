"""Markdown table of the denoise loop's steps in `instgenie loadtest --out` reports: per phase,
the steps by how they ran (CUDA-graph replay, capture, warm-up, eager; count x mean ms), the
loop's summed step time, that time per request-step (summed step ms / the requests' steps:
what one step of one request cost the loop, whatever the batching), and the latency p50/p95.
Not a test.

    python3 bench/report_steps.py always=out/capture/always_masked.json \
        auto=out/capture/auto_masked.json
"""

from __future__ import annotations

import sys

from instgenie.loadtest.report import load_named

MODES = ("replay", "capture", "warmup", "eager")


def phase_row(name: str, phase: dict) -> str:
    steps = phase.get("steps") or {}
    total_ms = sum(v["n"] * v["mean_ms"] for v in steps.values())
    work = sum(r["num_steps"] for r in phase["rows"] if r.get("num_steps"))
    modes = " · ".join(
        f"{m} {steps[m]['n']}×{steps[m]['mean_ms']:.0f}" for m in MODES if m in steps
    )
    lat = phase["latency_ms"]
    per = f"{total_ms / work:.1f}" if work else "—"
    return (f"| {phase['rate']:g} | {name} | {modes} | {total_ms / 1e3:.1f} | {per} | "
            f"{lat['p50'] / 1e3:.2f} | {lat['p95'] / 1e3:.2f} |")  # fmt: skip


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    reports = load_named(argv)
    print("| rate /s | run | steps by mode (count × mean ms) | step time s | ms per "
          "request-step | p50 s | p95 s |")  # fmt: skip
    print("|---:|---|---|---:|---:|---:|---:|")
    rates = sorted({p["rate"] for _, r in reports for p in r["phases"]})
    for rate in rates:
        for name, r in reports:
            for p in r["phases"]:
                if p["rate"] == rate:
                    print(phase_row(name, p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
