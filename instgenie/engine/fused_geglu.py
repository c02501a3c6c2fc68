"""diffusers' GEGLU (the first half of SDXL/SD2 feed-forwards) with its gating in one Triton pass.

`fuse_geglu(module)` replaces, in place, every `GEGLU` child by a `FusedGEGLU` holding the same
`proj` Linear (same parameters, same state_dict keys). Its forward runs `proj`, then
triton_kernels/geglu.py instead of chunk + gelu + mul; where the kernel does not run (MODE,
CPU, a non-contiguous projection) the stock ops run, so with MODE = "off" a model is
bit-identical to stock diffusers. With the kernel, an output differs from torch's by at most two
ulps plus |h * gate| * 2**-22 (its gelu's 1 + erf form; triton_kernels/geglu.py). Why and what it
buys: docs/decisions/0014-fused-geglu.md.
"""

from __future__ import annotations

import torch
from diffusers.models.activations import GEGLU
from torch import nn

from instgenie import env
from instgenie.engine.kernels import kernel_enabled, optional_kernel

#: "auto": the Triton kernel on CUDA; "on": also elsewhere (CPU tests under TRITON_INTERPRET=1);
#: "off": torch's ops (stock diffusers). Read at every call (benchmarks toggle it).
MODE = env.fused_geglu()

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedGEGLU(GEGLU):
    """GEGLU sharing the `proj` of the GEGLU it replaces; gating through one kernel."""

    def __init__(self, geglu: GEGLU) -> None:
        nn.Module.__init__(self)  # not GEGLU.__init__: it would allocate a second projection
        self.proj = geglu.proj
        #: forward calls that ran the Triton kernel (observability and tests)
        self.kernel_calls = 0

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        p = self.proj(hidden_states)
        if (
            kernel_enabled(MODE, p.device)
            and p.dtype in _KERNEL_DTYPES
            and p.is_contiguous()
            and (kernel := optional_kernel("geglu", "geglu")) is not None
        ):
            self.kernel_calls += 1
            return kernel(p)
        h, gate = p.chunk(2, dim=-1)
        return h * self.gelu(gate)


def fuse_geglu(model: nn.Module) -> int:
    """Swap every (stock) GEGLU of `model` for a FusedGEGLU; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is GEGLU:
                setattr(parent, name, FusedGEGLU(child))
                swapped += 1
    return swapped
