"""GPU benchmark (issue 5): request latency of the three batching policies under Poisson traffic.

One worker (real processes: supervisor, denoise loop, pre, post) per policy, in turn; the same
arrival times and masks for every policy. Edits reference registered templates (masked path, the
cache resident in the loop's GPU memory), mask ratios drawn with mean ~0.19. Not a test. (This
drives one worker directly; `instgenie loadtest` drives a whole server over its REST API.)

    python bench/bench_worker_policies.py --model sdxl-inpaint:full --rates 1.0 2.0 --out X.json
    python bench/bench_worker_policies.py --model sd2-inpaint:tiny --device cpu --quick  # smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from instgenie.config import Config, ModelConfig, WorkerConfig  # noqa: E402
from instgenie.loadtest.workload import rect_mask, template_image  # noqa: E402
from instgenie.messages import RegisterTemplate  # noqa: E402
from instgenie.worker.client import EditHandle, WorkerError, start_worker  # noqa: E402


def workload(n: int, rate: float, size: int, templates: int, seed: int) -> list[dict]:
    """Arrival offsets (s, Poisson at `rate`/s), masks (ratio ~ U(0.08, 0.30), mean 0.19)."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    return [
        dict(at=float(t[i]), template=int(rng.integers(templates)),
             mask=rect_mask(size, size, float(rng.uniform(0.08, 0.30)), rng)[0], seed=int(i))
        for i in range(n)
    ]  # fmt: skip


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_load(client, tids: list[str], load: list[dict], steps: int, fmt: str = "png") -> dict:
    """Submit `load` at its arrival times; wait for every result; latency stats (ms)."""
    handles: list[tuple[EditHandle, float]] = []
    done_at: dict[str, float] = {}
    lock = threading.Lock()
    t0 = time.monotonic()
    for item in load:
        delay = t0 + item["at"] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent = time.monotonic()
        h = client.edit(image=None, template_id=tids[item["template"]], mask=item["mask"],
                        prompt="a red jacket", seed=item["seed"], num_inference_steps=steps,
                        output_format=fmt)  # fmt: skip

        def _done(_f, uid=h.uid) -> None:
            with lock:
                done_at[uid] = time.monotonic()

        h.future.add_done_callback(_done)
        handles.append((h, sent))
    results, errors = [], []
    for h, sent in handles:
        try:
            r = h.result(timeout=1800)
        except WorkerError as e:
            errors.append(e.code)
            continue
        row = dict(latency_ms=1e3 * (done_at[h.uid] - sent), total_ms=r.total_ms,
                   queue_ms=r.queue_ms, pre_ms=r.preprocess_ms, denoise_ms=r.denoise_ms,
                   post_ms=r.postprocess_ms, path=r.path, mask_ratio=r.mask_ratio)  # fmt: skip
        results.append(row)
    wall = time.monotonic() - t0
    lat = [r["latency_ms"] for r in results]
    que = [r["queue_ms"] for r in results]
    return {
        "n": len(load), "ok": len(results), "errors": errors, "wall_s": wall,
        "throughput_rps": len(results) / wall,
        "latency_p50_ms": pct(lat, 50), "latency_p95_ms": pct(lat, 95),
        "latency_mean_ms": statistics.fmean(lat) if lat else float("nan"),
        "queue_p50_ms": pct(que, 50), "queue_p95_ms": pct(que, 95),
        "pre_p50_ms": pct([r["pre_ms"] for r in results], 50),
        "denoise_p50_ms": pct([r["denoise_ms"] for r in results], 50),
        "post_p50_ms": pct([r["post_ms"] for r in results], 50),
        "mask_ratio_mean": statistics.fmean(r["mask_ratio"] for r in results) if results else 0,
        "masked_fraction": sum(r["path"] == "masked" for r in results) / max(1, len(results)),
        "requests": results,
    }  # fmt: skip


def step_stats(entries) -> dict:
    by_size: dict[int, list[float]] = {}
    for e in entries:
        by_size.setdefault(len(e.members), []).append(e.duration_ms)
    return {
        "steps": len(entries),
        "mean_batch": statistics.fmean(len(e.members) for e in entries) if entries else 0.0,
        "step_ms_p50_by_batch": {b: pct(v, 50) for b, v in sorted(by_size.items())},
    }


def bench_policy(args, policy: str, loads: dict[float, list[dict]]) -> dict:
    cfg = Config(
        model=ModelConfig(model=args.model, device=args.device),
        worker=WorkerConfig(policy=policy, max_batch=args.max_batch, max_queue=4096,
                            model_stages=args.model_stages,
                            stall_timeout_s=900.0, heartbeat_timeout_s=120.0),
    )  # fmt: skip
    t = time.monotonic()
    out: dict = {"policy": policy}
    with start_worker(cfg, timeout=900) as w:
        out["start_s"] = time.monotonic() - t
        c = w.client
        tids = []
        for i in range(args.templates):
            tid = f"{i + 1:02x}" * 32
            ready = c.register_template(
                RegisterTemplate(template_id=tid, image=template_image(args.size, i), prompt="",
                                 seed=i, num_inference_steps=args.steps), timeout=1800)  # fmt: skip
            out.setdefault("templates", []).append(
                {"build_ms": ready.build_ms, "bytes_by_tier": ready.bytes_by_tier}
            )
            tids.append(tid)
        warm = workload(args.max_batch, 1000.0, args.size, args.templates, seed=99)
        run_load(c, tids, warm[:1], args.steps)  # alone, then a full batch: shapes warmed up
        run_load(c, tids, warm, args.steps)
        for rate, load in loads.items():
            since = len(c.step_log())
            res = run_load(c, tids, load, args.steps, args.output_format)
            res.update(step_stats(c.step_log(since_step=since)))
            out[f"rate_{rate}"] = res
            print(f"{policy:>17} rate {rate}/s: P50 {res['latency_p50_ms']:.0f} ms, "
                  f"P95 {res['latency_p95_ms']:.0f} ms, queue P95 {res['queue_p95_ms']:.0f} ms, "
                  f"mean batch {res['mean_batch']:.2f}", flush=True)  # fmt: skip
    return out


#: defaults of the flags that --quick changes: (full run, --quick smoke run)
SIZES = dict(size=(1024, 64), steps=(20, 3), templates=(2, 1), max_batch=(8, 2), requests=(40, 6),
             rates=([1.0, 2.0], [2.0]))  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """--quick changes the defaults of the SIZES flags only: a flag given explicitly is kept."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="sdxl-inpaint:full")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--templates", type=int)
    p.add_argument("--max-batch", type=int)
    p.add_argument("--requests", type=int)
    p.add_argument("--rates", type=float, nargs="+")
    p.add_argument("--policies", nargs="+",
                   default=["continuous", "static", "naive-continuous"])  # fmt: skip
    p.add_argument("--model-stages", default="loop", choices=["loop", "process"])
    p.add_argument("--output-format", default="png", choices=["png", "jpeg", "webp"],
                   help="the API's default is png (CPU-heavy to encode at 1024²)")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: smaller defaults for " + ", ".join(
                       "--" + k.replace("_", "-") for k in SIZES))  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    for k, (full, quick) in SIZES.items():
        if getattr(args, k) is None:  # not given (None is no valid value of these flags)
            setattr(args, k, copy.copy(quick if args.quick else full))
    return args


def main() -> None:
    args = parse_args()
    loads = {r: workload(args.requests, r, args.size, args.templates, seed=7) for r in args.rates}
    report = {"args": {k: v for k, v in vars(args).items()}, "policies": []}
    try:
        import torch

        from bench.bench_masked_step import environment

        report["environment"] = environment(torch.device(args.device))
    except Exception as e:  # noqa: BLE001 - environment info is best effort
        report["environment"] = {"error": str(e)}
    for policy in args.policies:
        report["policies"].append(bench_policy(args, policy, loads))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
