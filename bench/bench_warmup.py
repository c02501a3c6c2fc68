"""GPU benchmark: what a loop's warm-up before ready costs (worker/warmup.py, decision 0049),
run twice in one process on SDXL-inpaint `full`: the first on a fresh machine compiles the
kernels (Triton's on-disk cache), the second is what every later worker start on the host pays;
and what it leaves behind (free device memory, graphs kept). Not a test. Results:
docs/benchmarks/warmup-h100.md.

    python bench/bench_warmup.py
"""

from __future__ import annotations

import logging
import time

import torch

from instgenie.engine.pipeline import EditPipeline
from instgenie.worker import warmup


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    t0 = time.perf_counter()
    pipe = EditPipeline.load("sdxl-inpaint:full", device="cuda")
    torch.cuda.synchronize()
    print("load s", round(time.perf_counter() - t0, 1), torch.cuda.get_device_name(0),
          torch.__version__)  # fmt: skip
    free0, _ = torch.cuda.mem_get_info()
    alloc0 = torch.cuda.memory_allocated()
    report = warmup.warm_up(pipe, 8)
    free1, _ = torch.cuda.mem_get_info()
    print("report", report)
    print("free GB before/after", round(free0 / 1e9, 2), round(free1 / 1e9, 2),
          "allocated delta MB", round((torch.cuda.memory_allocated() - alloc0) / 1e6, 1),
          "graphs kept", len(pipe.family.masked.graphs._entries))  # fmt: skip
    print("graph counters", pipe.family.masked.graphs.counters)
    again = warmup.warm_up(pipe, 8)
    print("second warm-up (already compiled) ms", round(again.ms))


if __name__ == "__main__":
    main()
