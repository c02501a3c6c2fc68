"""GPU micro-benchmark (decisions 0014, 0015): the GEGLU gating and conv-bias Triton kernels
against the torch ops they replace, at SDXL shapes. Not a test.

    python bench/bench_fused_kernels.py --out $OUT/fused_kernels.json

Each case: median µs (triton.testing.do_bench) of the kernel and of torch's ops on the same
input, their ratio, and the kernel's effective bandwidth (bytes read + written / time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_masked_step import environment  # noqa: E402
from triton_kernels.bias_add import add_channel_bias_, add_channel_bias_reference  # noqa: E402
from triton_kernels.geglu import geglu, geglu_reference  # noqa: E402

#: SDXL feed-forward projections (rows x tokens x 2F): batch 8 with CFG at the 32² and 64²
#: levels, batch 1, and the masked tokens (m = 0.2) of batch 1 at the 32² level
GEGLU_SHAPES = [(16, 1024, 2 * 5120), (16, 4096, 2 * 2560), (2, 1024, 2 * 5120), (2, 205, 2 * 5120)]
#: SDXL UNet convolution outputs (N, C, H, W), batch 8 and 1 with CFG
BIAS_SHAPES = [(16, 320, 128, 128), (16, 640, 64, 64), (16, 1280, 32, 32), (2, 320, 128, 128)]


def case(name: str, shape, kernel, torch_op, moved_bytes: int) -> dict:
    k_ms = triton.testing.do_bench(kernel)
    t_ms = triton.testing.do_bench(torch_op)
    row = {
        "op": name, "shape": list(shape), "us_kernel": round(k_ms * 1e3, 1),
        "us_torch": round(t_ms * 1e3, 1), "speedup": round(t_ms / k_ms, 2),
        "kernel_gb_s": round(moved_bytes / (k_ms * 1e-3) / 1e9),
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    rows = []
    for shape in GEGLU_SHAPES:
        x = torch.randn(shape, device=dev, dtype=dtype)
        moved = x.numel() * x.element_size() * 3 // 2  # read 2F, write F per token
        rows.append(case("geglu", shape, lambda x=x: geglu(x), lambda x=x: geglu_reference(x),
                         moved))  # fmt: skip
    for shape in BIAS_SHAPES:
        y = torch.randn(shape, device=dev, dtype=dtype)
        b = torch.randn(shape[1], device=dev, dtype=dtype)
        moved = 2 * y.numel() * y.element_size()  # read and write y in place
        rows.append(case("conv_bias", shape, lambda y=y, b=b: add_channel_bias_(y, b),
                         lambda y=y, b=b: add_channel_bias_reference(y, b), moved))  # fmt: skip
    out = {"env": environment(dev), "dtype": args.dtype, "argv": sys.argv, "cases": rows}
    path = Path(args.out or Path(os.environ.get("OUT", ".")) / "fused_kernels.json")
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
