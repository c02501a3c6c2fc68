"""Per-request LoRA on the GPU: cold-adapter edit latency, synchronous vs bounded asynchronous
loading (K = 1, 3, 5), and batch-8 throughput with 8 different LoRAs vs one shared vs none,
through the worker's batcher (the loop's code: gate, step plan, graphs). Issue 30.

    python bench/lora_serving.py --model sdxl-inpaint:full --out docs/benchmarks/data/lora-h100.json

LoRAs: random rank-`--rank` pairs on every attention projection (to_q/k/v/out.0, Flux's add_*
too) of the backbone and the first text encoder's q/k/v/out projections, a typical style LoRA.
"Cold" = forgotten from the host and device caches (the file stays in the page cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.lora import apply
from instgenie.scheduler.batching import get_policy
from instgenie.worker.batcher import Batcher
from tests.conftest import make_image, make_mask, png_bytes
from tests.lora.helpers import attach, lora_state, register

PICKS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def _requests(n: int, size: int, steps: int, loras, seed0: int = 0) -> list[EditRequest]:
    image, mask = png_bytes(make_image(size, size, seed=1)), png_bytes(make_mask(size, size))
    return [
        EditRequest(uid=f"r{seed0 + i}", image=image, mask=mask, prompt="a red silk dress",
                    seed=seed0 + i, num_inference_steps=steps, loras=tuple(loras[i]))
        for i in range(n)
    ]  # fmt: skip


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


#: where the last _serve's time went (seconds from submission): prompt encodes done, first step
#: started, last step ended (host), finished (device synchronised)
PHASES: dict[str, float] = {}


def _serve(pipe: EditPipeline, reqs, bound: int) -> tuple[float, list, dict]:
    """Seconds from submission (prompt encode included) to the last retirement."""
    pipe.lora_async_steps = bound
    b = Batcher(pipe, get_policy("continuous"), max_batch=len(reqs))
    _sync()
    t0, wall0 = time.perf_counter(), time.time()
    for r in reqs:
        b.submit(pipe.preprocess(r))
    PHASES.clear()
    PHASES["encoded"] = time.perf_counter() - t0
    done = {}
    while not b.idle:
        for r in b.iterate():
            assert r.error is None, r.error
            done[r.state.uid] = r.state
    PHASES["host_done"] = time.perf_counter() - t0
    _sync()
    total = time.perf_counter() - t0
    if b.records:
        PHASES["first_step"] = b.records[0].t_start - wall0
    PHASES["finished"] = total
    return total, list(b.records), done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="sdxl-inpaint:full")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-repeats", type=int, help="timed batch-8 runs (default: --repeats)")
    ap.add_argument("--skip-batch", action="store_true", help="cold latency only")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run with a tiny model")
    ap.add_argument("--profile", help="a text file: the torch profiler's tables of a cold edit")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    pipe = EditPipeline.load(args.model, device=args.device)
    d = Path(tempfile.mkdtemp())
    attach(pipe, d)
    ids = [register(d, lora_state(pipe, rank=args.rank, seed=i, std=0.02, picks=PICKS))
           for i in range(9)]  # fmt: skip
    nbytes = (d / f"{ids[0]}.safetensors").stat().st_size
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    res: dict = {"model": args.model, "size": args.size, "steps": args.steps, "rank": args.rank,
                 "lora_file_bytes": nbytes, "device": device,
                 "torch": torch.__version__}  # fmt: skip
    # correctness on this device: the kernel against the torch ops, a mixed batch's step
    reqs = _requests(3, args.size, 2, [[(ids[0], 1.0)], [], [(ids[1], 0.5), (ids[2], 1.0)]])
    outs = {}
    graphs = pipe.family.masked.graphs
    graph_mode, graphs.mode = graphs.mode, "off"  # both eager: the comparison is of the ops
    for mode in ("auto", "off"):
        apply.SEGMENTED_KERNEL = mode
        _, _, done = _serve(pipe, reqs, 0)
        outs[mode] = torch.cat([done[r.uid].latents.float() for r in reqs])
    apply.SEGMENTED_KERNEL = "auto"
    graphs.mode = graph_mode
    res["kernel_vs_torch_max_abs"] = float((outs["auto"] - outs["off"]).abs().max())
    # warm-up (graphs, kernels) with a LoRA and without
    _serve(pipe, _requests(1, args.size, args.steps, [[(ids[8], 1.0)]]), 0)
    _serve(pipe, _requests(1, args.size, args.steps, [[]]), 0)
    # cold-adapter latency: batch 1, the adapter forgotten before each run
    lat: dict[str, list[float]] = {}
    # warm: the adapter on the device (the LoRA's step cost); host: only in host memory (pinned,
    # parsed); the others: cold (forgotten from both, read from the file)
    for label, loras, bound in [("no_lora", [], 0), ("warm", [(ids[8], 1.0)], 0),
                                ("host_sync", [(ids[8], 1.0)], 0),
                                ("host_k1", [(ids[8], 1.0)], 1), ("sync", [(ids[8], 1.0)], 0),
                                ("async_k1", [(ids[8], 1.0)], 1), ("async_k3", [(ids[8], 1.0)], 3),
                                ("async_k5", [(ids[8], 1.0)], 5)]:  # fmt: skip
        for rep in range(args.repeats):
            if label == "warm":
                pipe.loras.poll(ids[8], "backbone", wait=True)
                pipe.loras.poll(ids[8], "text", wait=True)
            elif label.startswith("host"):
                pipe.loras.weights(ids[8], "backbone")
                pipe.loras.weights(ids[8], "text")
                pipe.loras.forget(ids[8], host=False)
            else:
                pipe.loras.forget(ids[8])
            s, log, done = _serve(pipe, _requests(1, args.size, args.steps, [loras], rep), bound)
            lat.setdefault(label, []).append(s)
            without = sum(1 for e in log if e.lora_without)
            res.setdefault("steps_without", {})[label] = without
            # where the time goes: each step's host time and kind (graph replay, capture, ...)
            res.setdefault("cold_steps", {})[label] = [
                (round(e.duration_ms, 1), e.graph, bool(e.lora_held)) for e in log
            ]
            res.setdefault("cold_phases_s", {}).setdefault(label, []).append(
                {k: round(v, 4) for k, v in PHASES.items()}
            )
            res.setdefault("cold_loads_ms", {})[label] = [
                (part, round(ms, 1)) for _, part, ms in pipe.loras.loaded[-2:]
            ]
        res.setdefault("cold_latency_s", {})[label] = statistics.median(lat[label])
    res["cold_latency_runs_s"] = lat
    if args.profile:  # one more cold synchronous edit under the torch profiler: where time goes
        from torch.profiler import ProfilerActivity, profile

        pipe.loras.forget(ids[8])
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device != "cpu" else [])
        with profile(activities=acts) as prof:
            _serve(pipe, _requests(1, args.size, args.steps, [[(ids[8], 1.0)]], 50), 0)
        table = prof.key_averages()
        Path(args.profile).write_text(
            table.table(sort_by="self_cpu_time_total", row_limit=40)
            + "\n"
            + table.table(sort_by="cpu_time_total", row_limit=40)
        )
    res["loads_ms"] = [ms for _, part, ms in pipe.loras.loaded if part == "backbone"][-5:]
    # batch-8 throughput, adapters warm (on the device)
    batches = [] if args.skip_batch else [("none", [[]] * 8), ("shared", [[(ids[0], 1.0)]] * 8),
                         ("distinct", [[(ids[i], 1.0)] for i in range(8)])]  # fmt: skip
    for label, loras in batches:
        _serve(pipe, _requests(8, args.size, args.steps, loras, 100), 0)  # load + warm graphs
        times, step_ms = [], []
        for rep in range(args.batch_repeats or args.repeats):
            s, log, _ = _serve(pipe, _requests(8, args.size, args.steps, loras, 200 + rep), 0)
            times.append(s)
            step_ms += [e.duration_ms for e in log[1:]]
        res.setdefault("batch8_images_per_s", {})[label] = 8 / statistics.median(times)
        res.setdefault("batch8_step_ms_median", {})[label] = statistics.median(step_ms)
    res["graph_calls"] = dict(graphs.counters)  # the timed steps replayed from CUDA graphs
    print(json.dumps(res, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
