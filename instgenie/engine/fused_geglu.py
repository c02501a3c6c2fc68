"""diffusers' GEGLU (the first half of SDXL/SD2 feed-forwards) with its gating in one Triton pass.

`fuse_geglu(module)` replaces, in place, every `GEGLU` child by a `FusedGEGLU` holding the same
`proj` Linear (same parameters, same state_dict keys). Its forward runs `proj`, then
triton_kernels/geglu.py instead of chunk + gelu + mul; where the kernel does not run (its
`mode`, CPU, a non-contiguous projection) the stock ops run, so with mode "off" a model is
bit-identical to stock diffusers. With the kernel, an output differs from torch's by at most two
ulps plus |h * gate| * 2**-22 (its gelu's 1 + erf form; triton_kernels/geglu.py). Why and what it
buys: docs/decisions/0014-fused-geglu.md.
"""

from __future__ import annotations

import torch
from diffusers.models.activations import GEGLU
from torch import nn

from instgenie.engine.kernels import check_mode, kernel_enabled, optional_kernel

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedGEGLU(GEGLU):
    """GEGLU sharing the `proj` of the GEGLU it replaces; gating through one kernel."""

    def __init__(self, geglu: GEGLU, mode: str = "auto") -> None:
        nn.Module.__init__(self)  # not GEGLU.__init__: it would allocate a second projection
        self.proj = geglu.proj
        #: "auto": the Triton kernel on CUDA; "on": also elsewhere (CPU tests under
        #: TRITON_INTERPRET=1); "off": torch's ops (stock diffusers) (ExecConfig.fused_geglu).
        #: Read at every call (benchmarks toggle it).
        self.mode = check_mode(mode)
        #: forward calls that ran the Triton kernel (observability and tests)
        self.kernel_calls = 0

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        p = self.proj(hidden_states)
        if (
            kernel_enabled(self.mode, p.device)
            and p.dtype in _KERNEL_DTYPES
            and p.is_contiguous()
            and (kernel := optional_kernel("geglu", "geglu")) is not None
        ):
            self.kernel_calls += 1
            return kernel(p)
        h, gate = p.chunk(2, dim=-1)
        return h * self.gelu(gate)


def fuse_geglu(model: nn.Module, mode: str = "auto") -> int:
    """Swap every (stock) GEGLU of `model` for a FusedGEGLU with kernel `mode`; returns how
    many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is GEGLU:
                setattr(parent, name, FusedGEGLU(child, mode))
                swapped += 1
    return swapped
