"""Fit the simulator's step physics (instgenie/sim/physics.py) from one served run: its step log
(`instgenie serve --step-log`, as bench/bench_cluster.py writes it) and its load-test report.
Use a run other than the one the simulator is then compared with (another seed or policy).

    python bench/calibrate_sim.py --steps out/calib/steps-least-loaded.jsonl \
        --report out/calib/least-loaded.json --profile profiles/sdxl-inpaint-full-h200.json \
        --out out/calib/physics.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from instgenie.scheduler.estimate import Estimator
from instgenie.sim import physics
from instgenie.sim.catalogue import cache_bytes
from instgenie.sim.models import profile_spec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", required=True, help="step log, JSON lines")
    ap.add_argument("--report", required=True, help="the same run's loadtest --out JSON")
    ap.add_argument("--profile", default="profiles/sdxl-inpaint-full-h200.json")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--num-steps", type=int, default=20)
    ap.add_argument("--source", default="", help="what the run was (recorded in the output)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = profile_spec(args.profile)
    phase = json.loads(Path(args.report).read_text())["phases"][-1]
    pixels = args.size * args.size
    nbytes = cache_bytes(spec, pixels, args.num_steps, rows=2 if spec.cfg else 1)
    lines = Path(args.steps).read_text().splitlines()
    fitted = physics.fit(
        (json.loads(x) for x in lines if x.strip()), Estimator(spec), pixels, args.num_steps,
        phase["mask_ratio_requested_mean"], nbytes, physics.outside_ms(phase["rows"]),
        args.source or f"{args.steps} ({len(lines)} steps)", physics.post_ms(phase["rows"]),
    )  # fmt: skip
    fitted.save(args.out)
    print(json.dumps(dataclasses.asdict(fitted), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
