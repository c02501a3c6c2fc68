"""The router's predicted step latency against measured steps (SDXL 1024², H200). Not a test.

Prices one denoising step of a batch of b identical requests (masked at the benchmark's token
ratio, or full) with scheduler.estimate.Estimator and the committed profile's fits (an SDXL-shaped
CostSpec, bench/bench_routing_decision.py), and sets it beside the step benchmark's eager and
CUDA-graph medians (bench/bench_masked_step.py output). Shows how far the eager per-block fits
are from the graphed steps that serving replays.

    python3 bench/report_estimate_vs_step.py \
        docs/benchmarks/data/masked_step_sdxl_h200_nhwc_default.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_routing_decision import sdxl_spec  # noqa: E402
from instgenie.scheduler.estimate import Estimator  # noqa: E402


def main(argv: list[str]) -> int:
    data = json.loads(Path(argv[0]).read_text())
    spec = sdxl_spec()
    est = Estimator(spec)
    px = data["size"] * data["size"]
    env = data["env"]
    print(f"{env['device']}, commit {env['commit']}; profile {Path(spec.profile).name}")
    print(
        "| batch | mask ratio | path | predicted ms | eager ms | graphed ms | predicted / graphed |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|")
    for row in data["steps"]:
        b, r = row["batch"], row["token_ratio"]
        ratios = {s: r for s in est.strides}
        for path, work, eager, graph in (
            ("masked", est.work(px, 20, None, ratios, "gpu"), row["ms_masked"],
             row["ms_masked_graph"]),
            ("full", est.work(px, 20, None, None, None), row["ms_full"], row["ms_full_graph"]),
        ):  # fmt: skip
            if path == "full" and row["mask_ratio"] != 0.2:
                continue  # the full step does not depend on the mask: one row per batch
            pred = est.step_ms([work] * b)
            print(f"| {b} | {row['mask_ratio']:g} | {path} | {pred:.1f} | {eager:.1f} "
                  f"| {graph:.1f} | {pred / graph:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
