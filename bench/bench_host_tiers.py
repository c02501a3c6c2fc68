"""GPU benchmark (issue 24): a masked edit whose template cache lives in GPU memory against the
same edit served from the host DRAM tier (the real shared-memory store), in one process, one
card, side by side. Not a test; results in docs/benchmarks/host-tiers-*.md.

Variants (each runs the same edits, 20 steps, batch 1 and batch B joined together):
  gpu            InMemoryStore on the device, CUDA graphs (the serving default without a cache root)
  dram-eager     HostActivationStore, graphs off: eager steps, cached rows DMA'd by the pipelined
                 loader (what the serving path did before decision 0029)
  dram-view      graphs on, no step windows: the copy kernel reads the pinned pages over PCIe on
                 the composition's own side-stream loader, inside the graph
  dram-window    graphs on, device step windows (the default): each step DMA'd one step ahead
  disk-eager     a template larger than DRAM, streamed from disk, eager (no windows)
  disk-window    the same with device step windows (graphs on)
Also: the cost of pinning one template's segment (what every request paid before) and of a
later open (the mapping is kept).

    python bench/bench_host_tiers.py --model sdxl-inpaint:full --batch 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_masked_step import add_exec_args, environment, exec_config  # noqa: E402
from instgenie.cache import hostmem  # noqa: E402
from instgenie.cache.host_store import HostActivationStore  # noqa: E402
from instgenie.cache.shm_segment import cleanup  # noqa: E402
from instgenie.cache.store import InMemoryStore  # noqa: E402
from instgenie.cache.tiered import TieredStore  # noqa: E402
from instgenie.engine.family import load_family  # noqa: E402
from instgenie.engine.graphs import StepGraphs  # noqa: E402
from instgenie.engine.imageio import encode_image  # noqa: E402
from instgenie.engine.pipeline import EditPipeline  # noqa: E402
from instgenie.engine.request import EditRequest  # noqa: E402
from instgenie.engine.stepbench import ratio_mask, template_image  # noqa: E402
from instgenie.engine.templates import TemplateSpec  # noqa: E402


def edit_batch(
    pipe: EditPipeline,
    keys: list[str],
    masks: list[bytes],
    steps: int,
    planner=None,  # noqa: ANN001 - batch -> compute-all block ids (a load planner), or None
) -> dict:
    """Denoise len(keys) edits joined together; per-step CUDA times and the final latents."""
    reqs = [
        EditRequest(
            uid=f"e{i}",
            image=None,
            template_id=k,
            mask=m,
            prompt="a red jacket",
            seed=40 + i,
            num_inference_steps=steps,
            paste_back=False,
        )  # fmt: skip
        for i, (k, m) in enumerate(zip(keys, masks, strict=True))
    ]
    states = [pipe.preprocess(r) for r in reqs]
    assert all(s.path == "masked" for s in states), [s.notes for s in states]
    ex = pipe.family.masked
    events, loaded = [], []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while not all(s.is_done for s in states):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        pipe.prepare_reads(states)
        plan = pipe.plan_step(states, horizon=steps - states[0].step_index)
        if planner is not None:
            plan = dataclasses.replace(plan, compute_all=planner(states))
        pipe.denoise_step(states, plan)
        b.record()
        events.append((a, b))
        ctx = ex.last_context
        loaded.append(ctx.loader.bytes_loaded if ctx is not None and ctx.loader else 0)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    ms = [a.elapsed_time(b) for a, b in events]
    return {"s": secs, "step_ms": ms, "bytes": loaded, "latents": [s.latents for s in states]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="sdxl-inpaint:full")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", default=None, help="fitted profile: the load planner on")
    p.add_argument("--out", default=None)
    add_exec_args(p)
    args = p.parse_args()
    execution = exec_config(args)
    dev = torch.device("cuda")
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "host_tiers.json")
    fam = load_family(args.model, device="cuda", execution=execution)
    size = fam.default_size
    root = Path(tempfile.mkdtemp(prefix="igc-bench-"))
    ns = uuid.uuid4().hex[:10]
    tiered = TieredStore(root, ns, 120 << 30, 0, disk_enabled=False)
    host = HostActivationStore(tiered, root)
    gpu = EditPipeline(fam, store=InMemoryStore(dev))
    dram = EditPipeline(fam, store=host)
    # DRAM smaller than one template: captured straight to disk, streamed back step by step
    ns_disk = uuid.uuid4().hex[:10]
    small = TieredStore(root / "disk", ns_disk, 1 << 30, 60 << 30)
    disk = EditPipeline(fam, store=HostActivationStore(small, root / "disk"))
    result: dict = {"env": environment(dev, execution), "model": args.model, "size": size,
                    "steps": args.steps, "batch": args.batch, "ratio": args.ratio,
                    "argv": sys.argv, "rows": []}  # fmt: skip

    def save(row: dict | None = None) -> None:
        if row is not None:
            print(json.dumps(row), flush=True)
        out.write_text(json.dumps(result, indent=1))

    keys: dict[str, list[str]] = {"gpu": [], "dram": [], "disk": []}
    for seed in (0, 1):
        png = encode_image(template_image(size), "png")
        spec = TemplateSpec(image=png, prompt=f"a person {seed}", seed=seed,
                            num_inference_steps=args.steps)  # fmt: skip
        for name, pipe in (("gpu", gpu), ("dram", dram), ("disk", disk)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            keys[name].append(pipe.build_template(spec))
            torch.cuda.synchronize()
            save({"capture": name, "s": round(time.perf_counter() - t0, 2),
                  "bytes": pipe.store.meta(keys[name][-1]).nbytes})  # fmt: skip
    # what every request paid before: registering / unregistering its whole segment
    h = tiered.acquire(keys["dram"][0])
    costs = []
    for _ in range(2):
        t0 = time.perf_counter()
        hostmem.pin(h.data)
        t1 = time.perf_counter()
        hostmem.unpin(h.data)
        costs.append((t1 - t0, time.perf_counter() - t1))
    h.close()
    t0 = time.perf_counter()
    host.open(keys["dram"][0]).close()  # first open: maps and pins (once per process)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    host.open(keys["dram"][0]).close()
    later = time.perf_counter() - t0
    result["pin"] = {"bytes": host.meta(keys["dram"][0]).nbytes,
                     "register_s": [round(a, 3) for a, _ in costs],
                     "unregister_s": [round(b, 3) for _, b in costs],
                     "first_open_s": round(first, 3), "later_open_s": round(later, 4)}  # fmt: skip
    save(result["pin"])

    ex = fam.masked
    planner = None
    if args.profile:
        from instgenie.engine.costspec import model_cost_spec
        from instgenie.engine.step_pricing import StepPricer
        from instgenie.scheduler.fits import Profile

        spec = model_cost_spec(fam, str(dram.store_dtype()), Profile.load_file(args.profile))
        planner = StepPricer(spec, fam.device).compute_all
    masks = [encode_image(ratio_mask(size, size, args.ratio + 0.02 * i, fam.granule), "png")
             for i in range(args.batch)]  # fmt: skip
    # (name, pipeline, graph mode, step windows)
    variants = [
        ("gpu", gpu, "all", "auto"), ("dram-eager", dram, "off", "off"),
        ("dram-view", dram, "all", "off"), ("dram-window", dram, "all", "auto"),
        ("disk-eager", disk, "off", "off"), ("disk-window", disk, "all", "auto"),
    ]  # fmt: skip
    graphs = {name: StepGraphs(dev, mode) for name, _, mode, _ in variants}
    for n in sorted({1, args.batch}):
        row: dict = {"batch": n}
        ref = None
        for rep in range(args.repeats + 1):  # rep 0 warms up (captures) every variant
            for name, pipe, _, windows in variants:
                ex.graphs, ex.windows = graphs[name], windows
                ks = [keys[name.split("-")[0]][i % 2] for i in range(n)]
                before = dict(ex.graphs.counters)
                r = edit_batch(pipe, ks, masks[:n], args.steps, planner)
                calls = {k: v - before[k] for k, v in ex.graphs.counters.items()}
                if rep == 0:
                    if ref is None:
                        ref = r["latents"]
                    row[f"maxdiff_{name}"] = max(
                        float((a.float() - b.float()).abs().max())
                        for a, b in zip(r["latents"], ref, strict=True)
                    )
                    continue
                row.setdefault(f"s_{name}", []).append(round(r["s"], 4))
                row.setdefault(f"step_ms_{name}", []).append(
                    round(statistics.median(r["step_ms"]), 2)
                )
                row[f"graphs_{name}"] = calls  # the last repeat's steps by kind
                row[f"bytes_per_step_{name}"] = int(statistics.median(r["bytes"]))
        for name, *_ in variants:
            row[f"median_s_{name}"] = statistics.median(row[f"s_{name}"])
        for name, *_ in variants[1:]:
            row[f"{name}_vs_gpu"] = round(row[f"median_s_{name}"] / row["median_s_gpu"], 3)
        result["rows"].append(row)
        save(row)
    tiered.close()
    small.close()
    cleanup(ns)
    cleanup(ns_disk)
    save({"done": True})


if __name__ == "__main__":
    main()
