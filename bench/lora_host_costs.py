"""Host (CPU) costs of per-request LoRA that no GPU timing shows (issue 30):

- hook: host time of LoraBatch.apply per adapted layer, the two kernel launches replaced by
  no-ops (what every hooked layer adds to an eager step or a CUDA-graph capture), microseconds;
- finite: the LoRA file's non-finite check over an SDXL-sized rank-64 LoRA's weights (560
  layers' down/up pairs), isfinite().all() against lora.files._finite, one thread, seconds.

    python bench/lora_host_costs.py
"""

from __future__ import annotations

import json
import subprocess
import time

import torch

import triton_kernels.segmented_lora as kernel
from instgenie.lora import apply
from instgenie.lora.apply import DeviceAdapter, Group, LoraBatch
from instgenie.lora.files import _finite


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def hook_us(calls: int = 20000) -> float:
    kernel._shrink_kernel = kernel._expand_kernel = _NoLaunch()
    apply.SEGMENTED_KERNEL = "on"
    key = ("unet", "x")

    def adapter(rank: int, seed: int) -> DeviceAdapter:
        g = torch.Generator().manual_seed(seed)
        down, up = torch.randn(rank, 64, generator=g), torch.randn(rank, 64, generator=g).T
        return DeviceAdapter(f"a{seed}", {key: (down, up, 0.5)})

    groups = [Group(0, 2, ((adapter(8, 1), 1.0),)), Group(2, 4, ((adapter(16, 2), 0.5),))]
    batch = LoraBatch(groups, 4, torch.device("cpu"), torch.float32)
    x, y = torch.randn(4, 100, 64), torch.randn(4, 100, 64)
    for _ in range(200):
        batch.apply(key, x, y)
    t0 = time.perf_counter()
    for _ in range(calls):
        batch.apply(key, x, y)
    return 1e6 * (time.perf_counter() - t0) / calls


def finite_s() -> dict[str, float]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 1280), (1280, 64)] * 420 + [(64, 640), (640, 64)] * 140
    weights = [torch.randn(*s, generator=g) for s in shapes]
    out = {}
    for name, check in (("isfinite_all", lambda t: bool(torch.isfinite(t).all())),
                        ("sum", _finite)):  # fmt: skip
        t0 = time.perf_counter()
        assert all(check(w) for w in weights)
        out[name] = time.perf_counter() - t0
    return out


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    res = {"commit": commit, "torch": torch.__version__, "hook_us": hook_us(),
           "finite_s": finite_s()}  # fmt: skip
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
