"""GPU micro-benchmark (issue 4 decision): how to move a cached block's unmasked rows from
pinned host memory into a GPU staging buffer. Not a test.

  whole   copy every row (one DMA), the masked rows are overwritten on the device later
  gather  CPU index_select of the unmasked rows into a pinned bounce buffer, one DMA, device
          index_copy into place
  runs    one DMA per contiguous run of unmasked rows
  mapped  a Triton kernel reads the unmasked rows straight from mapped pinned memory
          (triton_kernels/row_gather.py)

    python bench/bench_row_copy.py --out $OUT/row_copy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton_kernels.row_gather import row_gather  # noqa: E402

SHAPES = {  # name: (rows, grid side, channels, dtype)
    "sdxl-64x64x640": (2, 64, 640, torch.float16),
    "sdxl-32x32x1280": (2, 32, 1280, torch.float16),
    "flux-64x64x3072": (1, 64, 3072, torch.bfloat16),
}


def unmasked_index(side: int, ratio: float) -> torch.Tensor:
    """Token indices outside a centred square covering `ratio` of a side x side grid."""
    w = max(1, round(side * ratio**0.5))
    a = (side - w) // 2
    keep = torch.ones(side, side, dtype=torch.bool)
    keep[a : a + w, a : a + w] = False
    return keep.flatten().nonzero().squeeze(1)


def runs_of(idx: torch.Tensor) -> list[tuple[int, int]]:
    out, start, prev = [], None, None
    for i in idx.tolist():
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append((start, prev + 1))
            start = prev = i
    if start is not None:
        out.append((start, prev + 1))
    return out


def timed(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.2, 0.5])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "row_copy.json"))
    args = p.parse_args()
    dev = torch.device("cuda")
    rows_out = []
    for name, (R, side, C, dtype) in SHAPES.items():
        L = side * side
        src = torch.randn(R * L, C, dtype=torch.float32).to(dtype).pin_memory()
        staging = torch.empty(R * L, C, dtype=dtype, device=dev)
        bounce = torch.empty(R * L, C, dtype=dtype).pin_memory()
        for ratio in args.ratios:
            idx1 = unmasked_index(side, ratio)
            idx = torch.cat([idx1 + r * L for r in range(R)])
            idx_dev = idx.to(dev)
            k = idx.numel()
            runs = runs_of(idx)
            useful = k * C * src.element_size()

            def whole():
                staging.copy_(src, non_blocking=True)

            def gather():
                torch.index_select(src, 0, idx, out=bounce[:k])
                dev_rows = bounce[:k].to(dev, non_blocking=True)
                staging.index_copy_(0, idx_dev, dev_rows)

            def by_runs():
                for a, b in runs:
                    staging[a:b].copy_(src[a:b], non_blocking=True)

            def mapped():
                row_gather(src, idx_dev, staging)

            ref = None
            row = {"shape": name, "mask_ratio": ratio, "rows_kept": k, "runs": len(runs),
                   "useful_mb": round(useful / 2**20, 2)}  # fmt: skip
            for vname, fn in (("whole", whole), ("gather", gather), ("runs", by_runs),
                              ("mapped", mapped)):  # fmt: skip
                staging.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                got = staging[idx_dev].float().cpu()
                if ref is None:
                    ref = src[idx].float()
                assert torch.equal(got, ref), (name, ratio, vname)
                ms = timed(fn, args.iters)
                row[f"ms_{vname}"] = round(ms, 4)
                row[f"useful_gbps_{vname}"] = round(useful / ms / 1e6, 1)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    env = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"env": env, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
