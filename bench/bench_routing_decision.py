"""CPU cost of one mask-aware routing decision (MaskAware.choose), as the API process pays it.

SDXL-shaped CostSpec (70 blocks: 10 of width 640 at stride 16, 60 of width 1280 at stride 32)
with the committed H200 profile's fits; two workers holding 8 requests each (7 template edits
at different progress, 1 full-path edit); caches on the GPU or in host DRAM (the planner's DP
runs). Reports the first decision (no step price cached) and the mean over decisions whose held
requests advance by one step each time (what a live server sees). Not a test.

    python3 bench/bench_routing_decision.py [--decisions 200] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from instgenie.scheduler.fits import Profile
from instgenie.scheduler.routing import MaskAware
from instgenie.scheduler.spec import BlockSpec, CostSpec, profile_fits
from instgenie.scheduler.views import RouteRequest, WorkerView

PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "sdxl-inpaint-full-h200.json"


def sdxl_spec() -> CostSpec:
    prof = Profile.load_file(PROFILE)
    blocks = []
    for i in range(70):
        c, s = (640, 16) if i < 10 else (1280, 32)
        blocks.append(BlockSpec(block_id=i, kind="unet", channels=c, ff_macs=12 * c * c,
                                context_dim=2048, mlp=0, stride=s))  # fmt: skip
    return CostSpec(
        model=prof.model, granule=32, text_len=77, cfg=True, default_guidance=5.0,
        default_steps=20, cache_dtype="float16", blocks=blocks, **profile_fits(prof),
        profile=str(PROFILE),
    )  # fmt: skip


def run(tier: str, decisions: int) -> dict:
    spec, policy = sdxl_spec(), MaskAware()
    px, ratios = 1024 * 1024, ((16, 0.2), (32, 0.22))

    def req(template, done=0):  # noqa: ANN001, ANN202
        return RouteRequest(template_id=template, num_steps=20, pixels=px, token_ratios=ratios,
                            steps_done=done)  # fmt: skip

    times = []
    for j in range(decisions):
        held = tuple([req("T", (2 * k + j) % 20) for k in range(7)] + [req(None, j % 20)])
        workers = [WorkerView(index=i, device=f"cuda:{i}", in_flight=8, slots=16,
                              templates_ready=frozenset({"T"}), template_tiers={"T": tier},
                              requests=held, max_batch=8, cost=spec)
                   for i in range(2)]  # fmt: skip
        t0 = time.perf_counter()
        policy.choose(req("T"), workers)
        times.append(1e3 * (time.perf_counter() - t0))
    return {"tier": tier, "first_ms": times[0], "mean_ms": statistics.fmean(times),
            "p95_ms": sorted(times)[int(0.95 * len(times))], "decisions": decisions}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decisions", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = [run(tier, args.decisions) for tier in ("gpu", "dram")]
    out = {"machine": platform.processor() or platform.machine(), "rows": rows}
    for r in rows:
        print(json.dumps(r))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
