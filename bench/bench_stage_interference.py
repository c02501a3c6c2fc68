"""GPU benchmark (issue 5): where should the GPU stages (text encoders, VAE) of a worker run?

The denoise loop times one masked step (batch 4, m = 0.2) alone, then while a separate process
runs pre-processing (decode, prompt encode, VAE encode) + post-processing (VAE decode, paste-back,
JPEG encode) back to back (the worst case: a stage process that is never idle) on the same GPU,
then with that stage process on the CPU. The stage process reports its own latencies each time.
Not a test.

    python bench/bench_stage_interference.py --model sdxl-inpaint:full --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_masked_step import add_exec_args, environment, exec_config  # noqa: E402
from instgenie.config import ExecConfig, from_dict, to_dict  # noqa: E402
from instgenie.engine.imageio import encode_image  # noqa: E402
from instgenie.engine.pipeline import EditPipeline  # noqa: E402
from instgenie.engine.request import EditRequest  # noqa: E402
from instgenie.engine.stepbench import StepBench, ratio_mask, template_image  # noqa: E402


def stage_process(
    model: str, device: str, size: int, seconds: float, execution: ExecConfig
) -> None:
    """Child: pre + post back to back for `seconds` after a warm-up; prints one JSON line."""
    from instgenie.engine.family import load_family

    pipe = EditPipeline(load_family(model, device=device, parts="stages", execution=execution))
    image = encode_image(template_image(size), "png")
    mask = encode_image(ratio_mask(size, size, 0.2, pipe.family.granule), "png")
    pre, post = [], []

    def once(i: int) -> None:
        req = EditRequest(uid=f"s{i}", image=image, mask=mask, prompt=f"a red jacket {i}", seed=i,
                          num_inference_steps=20, output_format="jpeg")  # fmt: skip
        t0 = time.perf_counter()
        state = pipe.preprocess(req)
        t1 = time.perf_counter()
        pipe.postprocess([state])
        t2 = time.perf_counter()
        pre.append(1e3 * (t1 - t0))
        post.append(1e3 * (t2 - t1))

    once(10_000)  # warm-up (seeds must be >= 0)
    once(10_001)
    pre.clear()
    post.clear()
    print("busy", flush=True)
    end, i = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        once(i)
        i += 1
    print(json.dumps({"device": device, "requests": i, "pre_ms_p50": statistics.median(pre),
                      "post_ms_p50": statistics.median(post)}), flush=True)  # fmt: skip


def spawn(args, device: str, seconds: float, execution: ExecConfig) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--stage", device, "--model", args.model,
           "--size", str(args.size), "--seconds", str(seconds),
           "--stage-execution", json.dumps(to_dict(execution))]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    assert proc.stdout.readline().strip() == "busy"
    return proc


def finish(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=600)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="sdxl-inpaint:full")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # child mode: its device
    p.add_argument("--out", default=None)
    p.add_argument("--stage-execution", default=None, help=argparse.SUPPRESS)  # child: JSON
    add_exec_args(p)
    args = p.parse_args()
    if args.stage:  # the parent's ExecConfig, as a worker's children get theirs
        execution = from_dict(ExecConfig, json.loads(args.stage_execution))
        stage_process(args.model, args.stage, args.size, args.seconds, execution)
        return
    execution = exec_config(args)
    pipe = EditPipeline.load(args.model, device="cuda", execution=execution)
    bench = StepBench.setup(pipe, args.size)
    states = bench.states(0.2, args.batch, masked=True)
    report: dict = {"environment": environment(pipe.family.device, execution), "args": vars(args)}
    report["step_ms_alone"] = bench.time_ms(states, 3, args.iters)
    for device in ("cuda", "cpu"):
        seconds = args.seconds if device == "cuda" else 3 * args.seconds
        proc = spawn(args, device, seconds, execution)
        report[f"step_ms_with_{device}_stages"] = bench.time_ms(states, 0, args.iters)
        report[f"stages_on_{device}_with_loop"] = finish(proc)
    proc = spawn(args, "cuda", args.seconds / 2, execution)
    report["stages_on_cuda_alone"] = finish(proc)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
