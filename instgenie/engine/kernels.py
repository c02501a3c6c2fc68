"""Optional Triton kernels (triton_kernels/), imported on first use.

`optional_kernel` returns the function, or None where Triton is missing or broken; every caller
then runs the torch ops the kernel replaces, so a machine without a working Triton still serves.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

import torch

from instgenie.config import KERNEL_MODES  # a fused kernel's switch (ExecConfig.fused_*)

log = logging.getLogger(__name__)


def check_mode(mode: str) -> str:
    """`mode` if it is a kernel switch, else ValueError."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernel mode {mode!r}: expected one of {', '.join(KERNEL_MODES)}")
    return mode


def kernel_enabled(mode: str, device: torch.device) -> bool:
    """A kernel switch: "on" everywhere (CPU tests under TRITON_INTERPRET=1), "auto" on CUDA
    only, "off" never."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


@functools.cache
def optional_kernel(module: str, name: str) -> Callable | None:
    """`module.name` from triton_kernels, or None (logged once) if it cannot be imported."""
    try:
        return getattr(importlib.import_module(f"triton_kernels.{module}"), name)
    except Exception as exc:  # triton missing or broken: the torch ops
        log.warning("Triton kernel %s.%s unavailable, using torch ops: %s", module, name, exc)
        return None
