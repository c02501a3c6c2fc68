"""`instgenie simulate`: the cluster simulator on one scenario, every routing policy asked for plus
the ideal fleet (every template's cache in every host's DRAM, routed cache-aware).

    instgenie simulate --hosts 8 --gpus 8 --templates 2000 --zipf 1.0 --dram-fraction 0.1 \\
        --load 0.7 --duration-s 100 --warmup-s 40 --out out/sim

Load: --rate R (Poisson, requests/s), --load F (F x the capacity: the ideal fleet's saturation
throughput, report.capacity_rps), or --trace FILE (traces/bursty_arrivals.csv). SLO: --slo-factor
x one edit's unloaded latency (its cache in DRAM, the mask distribution's mean ratio). Writes
DIR/report.json and DIR/latency.png; prints one summary line per policy. Deterministic: one
--seed, one result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from instgenie.loadtest.workload import parse_mask_ratios
from instgenie.scheduler.estimate import Estimator
from instgenie.sim import workload
from instgenie.sim.catalogue import Catalogue, cache_bytes
from instgenie.sim.models import profile_spec
from instgenie.sim.physics import StepPhysics
from instgenie.sim.report import capacity_rps, summarize, unloaded_ms
from instgenie.sim.scenario import Cluster, Scenario, simulate

DEFAULT_PROFILE = "profiles/sdxl-inpaint-full-h200.json"
POLICIES = ("cache-aware", "mask-aware", "least-loaded")
GB = 1e9


def add_simulate_parser(sub) -> None:  # noqa: ANN001 - argparse subparsers
    p = sub.add_parser("simulate", help="discrete-event cluster simulator: routing policies at "
                       "scale, priced by the scheduler's own code", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    a = p.add_argument
    a(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"worker latency profile; default {DEFAULT_PROFILE}",
    )
    a("--model", default=None, help="model of the block list; default: the profile's")
    a("--hosts", type=int, default=2)
    a("--gpus", type=int, default=1, help="workers (GPUs) per host")
    a("--templates", type=int, default=100, help="catalogue size")
    a("--zipf", type=float, default=1.0, help="popularity exponent (0: uniform)")
    a("--dram-gb", type=float, default=None, help="DRAM tier per host, GB (1e9 bytes)")
    a(
        "--dram-fraction",
        type=float,
        default=0.1,
        help="DRAM tier per host as a fraction of the catalogue's cache bytes (without --dram-gb)",
    )
    a("--disk-gb", type=float, default=None, help="disk tier per host, GB")
    a("--disk-fraction", type=float, default=0.5, help="disk tier per host, catalogue fraction")
    a("--dram-gbps", type=float, default=None, help="DRAM->GPU bandwidth; default: profile's fit")
    a("--disk-gbps", type=float, default=None, help="disk read bandwidth; default: profile's fit")
    a("--size", type=int, default=1024, help="image side, pixels")
    a("--steps", type=int, default=20)
    a("--max-batch", type=int, default=8, help="WorkerConfig.max_batch")
    a("--slots", type=int, default=0, help="ServerConfig.worker_slots (0: 2 x max batch)")
    a("--max-queue", type=int, default=0, help="server queue bound (0: unbounded)")
    a("--mask-ratios", default="hist:traces/mask_ratios_mean011.json")
    a("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    a("--load", type=float, default=None, help="arrival rate as a fraction of capacity")
    a("--trace", type=Path, default=None, help="arrival trace CSV (at_s[,template])")
    a("--requests", type=int, default=0, help="arrivals (0: --duration-s worth)")
    a("--duration-s", type=float, default=60.0, help="arrivals over this long (rate / load)")
    a("--warmup-s", type=float, default=0.0, help="arrivals before this are not reported")
    a("--policies", nargs="+", default=list(POLICIES))
    a("--no-ideal", action="store_true", help="skip the ideal fleet")
    a("--slo-factor", type=float, default=5.0, help="SLO = this x the unloaded edit latency")
    a("--physics", type=Path, default=None,
      help="a served loop's step times (bench/calibrate_sim.py's JSON); latencies then include "
      "its time outside the loop. Default: each step takes the profile's price")  # fmt: skip
    a("--step-noise", action="store_true",
      help="with --physics: draw each step's time about its fitted one (the physics' spread, "
      "seeded by --seed); default: every step takes its fitted time")  # fmt: skip
    a("--seed", type=int, default=0)
    a("--out", type=Path, default=None, help="directory for report.json and latency.png")
    p.set_defaults(func=run)


def build(args: argparse.Namespace) -> tuple[Scenario, dict]:
    """The scenario the flags describe, and what the report records about its load."""
    if sum(x is not None for x in (args.rate, args.load, args.trace)) != 1:
        raise SystemExit("simulate: give exactly one of --rate, --load, --trace")
    spec = profile_spec(args.profile, args.model, disk_gbps=args.disk_gbps,
                        dram_gbps=args.dram_gbps)  # fmt: skip
    est = Estimator(spec)
    px = args.size * args.size
    rows = 2 if spec.cfg and spec.default_guidance > 1.0 else 1
    nbytes = cache_bytes(spec, px, args.steps, rows)
    cat = Catalogue.zipf(args.templates, args.zipf, nbytes, args.seed)
    total = cat.total_bytes()
    dram = int(args.dram_gb * GB) if args.dram_gb is not None else int(args.dram_fraction * total)
    disk = int(args.disk_gb * GB) if args.disk_gb is not None else int(args.disk_fraction * total)
    cluster = Cluster(args.hosts, args.gpus, dram, disk, args.max_batch, args.slots,
                      args.max_queue)  # fmt: skip
    rng = np.random.default_rng(args.seed)
    info: dict = {"template_bytes": nbytes, "catalogue_bytes": total, "dram_bytes": dram,
                  "disk_bytes": disk}  # fmt: skip
    physics = StepPhysics.load(args.physics) if args.physics is not None else None
    if args.step_noise and physics is None:
        raise SystemExit("simulate: --step-noise needs --physics (the spread it draws from)")
    base = Scenario(spec, cluster, cat, [], args.size, args.size, args.steps,
                    warmup_ms=1e3 * args.warmup_s, physics=physics,
                    seed=args.seed if args.step_noise else None)  # fmt: skip
    # capacity from the same mask distribution (its own stream: the workload is the same
    # whether or not it is measured)
    cap_rng = np.random.default_rng([args.seed, 2])
    cap_arr = workload.make_arrivals(cat, np.zeros(160), args.mask_ratios, args.size, args.size,
                                     est.strides, cap_rng)  # fmt: skip
    workers = args.hosts * args.gpus
    info["capacity_rps"] = capacity_rps(Scenario(spec, cluster, cat, cap_arr, args.size,
                                                 args.size, args.steps, physics=physics),
                                        workers)  # fmt: skip
    rate = args.rate if args.rate is not None else None
    if args.load is not None:
        rate = args.load * info["capacity_rps"]
    if args.trace is not None:
        times, tpl = workload.offsets_ms(rng, trace=args.trace, n=args.requests)
    else:
        n = args.requests or int(round(rate * args.duration_s))
        times, tpl = workload.offsets_ms(rng, rate, n)
    info["rate_rps"] = rate
    arrivals = workload.make_arrivals(cat, times, args.mask_ratios, args.size, args.size,
                                      est.strides, rng, tpl)  # fmt: skip
    import dataclasses

    return dataclasses.replace(base, arrivals=arrivals), info


def run(args: argparse.Namespace) -> int:
    scenario, info = build(args)
    mean = parse_mask_ratios(args.mask_ratios).mean
    slo = args.slo_factor * unloaded_ms(scenario, mean)
    runs = [(p, p, scenario) for p in args.policies]
    if not args.no_ideal:
        import dataclasses

        ideal = dataclasses.replace(scenario, cluster=dataclasses.replace(scenario.cluster,
                                                                          ideal=True))  # fmt: skip
        runs.append(("ideal", "cache-aware", ideal))
    summaries, latencies = {}, {}
    for name, policy, sc in runs:
        t0 = time.perf_counter()
        result = simulate(sc, policy)
        s = summarize(result, sc, slo)
        s["wall_s"] = time.perf_counter() - t0
        summaries[name] = s
        latencies[name] = np.array(
            [
                j.finish_ms - j.arrival_ms
                for j in result.requests
                if j.arrival_ms >= sc.warmup_ms and j.finish_ms >= 0
            ]
        )
        lat = s["latency_ms"]
        print(
            f"{name:>13}: p50 {lat.get('p50', 0) / 1e3:7.2f} s  p95 {lat.get('p95', 0) / 1e3:7.2f}"
            f" s  p99 {lat.get('p99', 0) / 1e3:7.2f} s  {s['throughput_rps']:.1f} req/s  "
            f"SLO {s['slo_attainment']:.3f}  full {s['full_path']}  captures "
            f"{s['captures_total']}  ({s['wall_s']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    report = {"command": getattr(args, "command_line", ""), "args": _jsonable(vars(args)),
              "unloaded_ms": slo / args.slo_factor, **info, "results": summaries}  # fmt: skip
    print(json.dumps({k: {"p95_ms": v["latency_ms"].get("p95")} for k, v in summaries.items()}))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        from instgenie.sim.plot import plot

        title = (f"{args.hosts} hosts x {args.gpus} GPUs, {args.templates} templates, "
                 f"Zipf {args.zipf}, {info['rate_rps']:.0f} req/s")  # fmt: skip
        plot(latencies, summaries, title, args.out / "latency.png")
    return 0


def _jsonable(d: dict) -> dict:
    kinds = (str, int, float, bool, list, Path, type(None))
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()
            if k != "func" and isinstance(v, kinds)}  # fmt: skip
