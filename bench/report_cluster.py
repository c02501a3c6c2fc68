"""Simulator vs reality for bench/bench_cluster.py: for each routing policy, the measured p50/p95
(the loadtest report's rows) and the simulator's prediction of the same run - the same nodes,
DRAM tier, templates (registered in the same order, placed by the same placement), and the same
requests: each row's send time, template and mask ratio. Not a test.

    python bench/report_cluster.py --dir out/cluster --gpus 2 --dram-bytes 20GiB \
        --profile profiles/sdxl-inpaint-full-h200.json [--json out.json]

The simulator prices the worker loop (encode, steps, decode) with the profile; what it does not
model - the request's CPU work outside the loop in the worker's pre and post processes (image
decode, paste-back, PNG encode) and HTTP - is added per request as one constant: the median over
the measured run's ok answers of preprocess_ms + postprocess_ms + (client latency -
server_total_ms), reported as `overhead_ms` (so the comparison tests queueing, batching and
cache placement, not PNG speed). The templates start where the server placed them (placement
alternates between empty nodes: template i on node i mod nodes), as the load tester waits for
every template to be ready before it sends.

With `--repeats N` (and `--physics`) each policy is also simulated N times with step times
drawn about their fitted ones (the physics' replay/eager sigmas, seeds 0..N-1): one served run is
one draw of a process whose routing turns on small timing differences, so the spread (p10 /
median / p90 of p50, p95 and full-path edits) says how far one run may fall from the median.

With `--physics FILE` (bench/calibrate_sim.py, fitted from another served run) the simulated
steps take a served loop's times (instgenie/sim/physics.py) and the time outside the loop is the
calibration run's, not the measured run's: nothing of the measured run feeds its prediction but
its requests' send times, templates and mask ratios.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from instgenie.config import byte_count
from instgenie.scheduler.estimate import Estimator
from instgenie.sim.catalogue import Catalogue, cache_bytes
from instgenie.sim.models import profile_spec
from instgenie.sim.physics import StepPhysics, outside_ms
from instgenie.sim.scenario import Cluster, Scenario, simulate
from instgenie.sim.workload import Arrival


def measured(report: dict) -> tuple[list[dict], dict]:
    phase = report["phases"][-1]
    rows = [r for r in phase["rows"] if r["sent_s"] is not None]
    ok = [r for r in rows if r["status"] == 200]
    lat = np.array([r["latency_ms"] for r in ok])
    out = {"p50": float(np.percentile(lat, 50)), "p95": float(np.percentile(lat, 95)),
           "ok": len(ok), "sent": len(rows),
           "full_path": sum(1 for r in ok if r.get("path") == "full")}  # fmt: skip
    return rows, out


def predict(rows, policy, args, spec, extra_ms: float, physics: StepPhysics | None,
            seed: int | None = None) -> dict:  # fmt: skip
    templates = sorted({int(r["template"]) for r in rows})
    n_tpl = max(templates) + 1
    W = H = args.size
    nbytes = cache_bytes(spec, W * H, args.steps, rows=2 if spec.cfg else 1)
    cat = Catalogue(tuple(f"t{i:03d}" for i in range(n_tpl)), np.full(n_tpl, 1.0 / n_tpl), nbytes)
    strides = Estimator(spec).strides
    arrivals = [
        Arrival(
            1e3 * r["sent_s"],
            int(r["template"]),
            float(r["mask_ratio_requested"]),
            tuple((s, float(r["mask_ratio_requested"])) for s in sorted(strides)),
        )  # fmt: skip
        for r in sorted(rows, key=lambda r: r["sent_s"])
    ]
    cluster = Cluster(hosts=args.gpus, gpus=1, dram_bytes=byte_count(args.dram_bytes),
                      disk_bytes=0, max_batch=args.max_batch)  # fmt: skip
    initial = {cat.ids[i]: [i % args.gpus] for i in range(n_tpl)}
    sc = Scenario(spec, cluster, cat, arrivals, width=W, height=H, steps=args.steps,
                  initial=initial, physics=physics, seed=seed)  # fmt: skip
    res = simulate(sc, policy)
    ok = [j for j in res.requests if j.finish_ms >= 0]
    lat = np.array([j.finish_ms - j.arrival_ms + extra_ms for j in ok])
    return {"p50": float(np.percentile(lat, 50)), "p95": float(np.percentile(lat, 95)),
            "ok": len(ok), "full_path": sum(1 for j in ok if j.tier is None),
            "captures": res.captures, "template_bytes": nbytes,
            "captures_no_room": sum(h.tiers.no_room for h in res.hosts)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="out/cluster")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--dram-bytes", default="20GiB")
    ap.add_argument("--profile", default="profiles/sdxl-inpaint-full-h200.json")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--physics", default="", help="step physics JSON (bench/calibrate_sim.py)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="also simulate this many runs with the physics' step noise (seeds 0..)",
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    spec = profile_spec(args.profile)
    physics = StepPhysics.load(args.physics) if args.physics else None
    table = []
    for path in sorted(Path(args.dir).glob("*.json")):
        if path.name.startswith("compare"):
            continue
        policy = path.stem
        rows, real = measured(json.loads(path.read_text()))
        extra = physics.outside_ms if physics else outside_ms(rows)
        sim = predict(rows, policy, args, spec, extra, physics)
        row = {"policy": policy, "measured": real, "simulated": sim, "overhead_ms": extra,
               "error_p50": sim["p50"] / real["p50"] - 1,
               "error_p95": sim["p95"] / real["p95"] - 1}  # fmt: skip
        if args.repeats and physics is not None:  # the prediction's spread under step noise
            runs = [predict(rows, policy, args, spec, extra, physics, s)
                    for s in range(args.repeats)]  # fmt: skip
            row["noisy"] = spread = {
                k: {"p10": float(np.percentile(v, 10)), "median": float(np.median(v)),
                    "p90": float(np.percentile(v, 90)),
                    "measured_within_p10_p90": bool(np.percentile(v, 10) <= real[k]
                                                    <= np.percentile(v, 90))}
                for k in ("p50", "p95", "full_path")
                for v in [[r[k] for r in runs]]
            }  # fmt: skip
            row["error_p50_noisy"] = spread["p50"]["median"] / real["p50"] - 1
            row["error_p95_noisy"] = spread["p95"]["median"] / real["p95"] - 1
        table.append(row)
    print("| policy | measured p50 / p95 (s) | simulated p50 / p95 (s) | error p50 / p95 | "
          "full path measured / simulated | captures simulated |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for t in table:
        m, s = t["measured"], t["simulated"]
        print(f"| {t['policy']} | {m['p50'] / 1e3:.2f} / {m['p95'] / 1e3:.2f} | "
              f"{s['p50'] / 1e3:.2f} / {s['p95'] / 1e3:.2f} | {100 * t['error_p50']:+.1f} % / "
              f"{100 * t['error_p95']:+.1f} % | {m['full_path']} / {s['full_path']} | "
              f"{s['captures']} |")  # fmt: skip
    for t in table:
        if "noisy" in t:
            n = t["noisy"]
            print(f"{t['policy']}: {args.repeats} runs with step noise: "
                  + "; ".join(f"{k} p10/median/p90 {n[k]['p10'] / d:.2f} / "
                              f"{n[k]['median'] / d:.2f} / {n[k]['p90'] / d:.2f}"
                              + (" (measured within)" if n[k]["measured_within_p10_p90"] else "")
                              for k, d in (("p50", 1e3), ("p95", 1e3), ("full_path", 1)))
                  + f"; error of the median p50 {100 * t['error_p50_noisy']:+.1f} %, "
                  f"p95 {100 * t['error_p95_noisy']:+.1f} %")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
