"""Conv2d whose bias is added by a vectorised Triton kernel instead of torch's broadcast add_.

`fuse_conv_bias(module)` replaces, in place, every plain biased `nn.Conv2d` by a `BiasKernelConv2d`
holding the same weight and bias Parameters (same state_dict keys). On CUDA, torch itself runs
such a convolution as cuDNN's unbiased convolution followed by a broadcast `add_` — a strided,
non-vectorised kernel (triton_kernels/bias_add.py); here the same convolution runs without bias
and the kernel adds it in place, with the same single rounding: bit-identical outputs (tested on
the device), for NCHW and channels_last outputs. Where the kernel does not run (its `mode`, CPU)
the stock module forward runs. Why and what it buys: docs/decisions/0015-conv-bias-kernel.md.
"""

from __future__ import annotations

import torch
from torch import nn

from instgenie.engine.kernels import check_mode, kernel_enabled, optional_kernel

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class BiasKernelConv2d(nn.Conv2d):
    """nn.Conv2d sharing the Parameters of the Conv2d it replaces; bias added by the kernel."""

    def __init__(self, conv: nn.Conv2d, mode: str = "auto") -> None:
        nn.Module.__init__(self)  # not Conv2d.__init__: it would allocate new parameters
        for name in ("in_channels", "out_channels", "kernel_size", "stride", "padding",
                     "dilation", "transposed", "output_padding", "groups", "padding_mode",
                     "_reversed_padding_repeated_twice"):  # fmt: skip
            setattr(self, name, getattr(conv, name))
        self.weight, self.bias = conv.weight, conv.bias  # the same Parameters
        #: "auto": the Triton kernel on CUDA; "on": also elsewhere (CPU tests under
        #: TRITON_INTERPRET=1); "off": torch's biased convolution (stock diffusers)
        #: (ExecConfig.fused_conv_bias). Read at every call (benchmarks toggle it).
        self.mode = check_mode(mode)
        #: forward calls that ran the Triton kernel (observability and tests)
        self.kernel_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            kernel_enabled(self.mode, x.device)
            and x.dtype in _KERNEL_DTYPES
            and self.bias is not None
            and self.bias.dtype == x.dtype
            and (kernel := optional_kernel("bias_add", "add_channel_bias_")) is not None
        ):
            y = self._conv_forward(x, self.weight, None)
            if y.is_contiguous() or y.is_contiguous(memory_format=torch.channels_last):
                self.kernel_calls += 1
                return kernel(y, self.bias)
            return y.add_(self.bias.reshape(1, -1, 1, 1))  # another layout: torch's add
        return super().forward(x)


def fuse_conv_bias(model: nn.Module, mode: str = "auto") -> int:
    """Swap every plain biased Conv2d of `model` for a BiasKernelConv2d with kernel `mode`;
    returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Conv2d and child.bias is not None:
                setattr(parent, name, BiasKernelConv2d(child, mode))
                swapped += 1
    return swapped
