"""GroupNorm (+ the SiLU after it) of diffusers UNets and VAEs through one Triton kernel pair.

`fuse_group_norms(module)` swaps, in place and keeping every parameter (same tensors, same
state_dict keys):

* each `ResnetBlock2D` whose norm2 feeds its SiLU nonlinearity directly (`time_embedding_norm`
  "default" or "group", not "scale_shift"): norm1 and
  norm2 become `FusedGroupNorm(silu=True)`, its `nonlinearity` becomes identity, and a pre-hook on
  `time_emb_proj` applies the SiLU that diffusers' forward applied to the time embedding through
  the same `nonlinearity` module (unless `skip_time_act`);
* each `Transformer2DModel`'s input GroupNorm: `FusedGroupNorm(silu=False)`;
* a `conv_norm_out` GroupNorm followed by a SiLU `conv_act` (UNet, VAE encoder/decoder): fused,
  `conv_act` becomes identity.

The forward of every swapped module computes exactly what the pair computed. The kernel reads
NCHW-contiguous and 4-D channels_last inputs (VAE decoders pass channels_last tensors on after
their mid-block attention); where it does not run (its `mode`, CPU, other layouts or dtypes) the
same torch ops run, so with mode "off" a model is bit-identical to stock diffusers. With the kernel,
results differ from torch's by about one rounding of the output dtype
(triton_kernels/group_norm.py).
Why and what it buys: docs/decisions/0013-fused-group-norm.md.
"""

from __future__ import annotations

import torch
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from torch import nn

from instgenie.engine.kernels import check_mode, kernel_enabled, optional_kernel

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NHWC = torch.channels_last


def _kernel():
    return optional_kernel("group_norm", "group_norm")


class FusedGroupNorm(nn.GroupNorm):
    """nn.GroupNorm that also applies the SiLU following it when `silu`; shares the parameters
    of the GroupNorm it replaces."""

    def __init__(self, norm: nn.GroupNorm, silu: bool, mode: str = "auto") -> None:
        super().__init__(norm.num_groups, norm.num_channels, norm.eps, affine=False)
        self.affine = norm.affine
        self.weight, self.bias = norm.weight, norm.bias  # the same Parameters (or None)
        self.silu = silu
        #: "auto": the Triton kernel on CUDA; "on": also elsewhere (CPU tests under
        #: TRITON_INTERPRET=1); "off": torch's group_norm + silu (stock diffusers)
        #: (ExecConfig.fused_group_norm). Read at every call (benchmarks toggle it).
        self.mode = check_mode(mode)
        #: forward calls that ran the Triton kernel (observability and tests)
        self.kernel_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._use_kernel(x)
        if kernel is not None:
            self.kernel_calls += 1
            return kernel(x, self.num_groups, self.weight, self.bias, self.eps, self.silu)
        y = nn.functional.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return nn.functional.silu(y) if self.silu else y

    def _use_kernel(self, x: torch.Tensor):
        if not kernel_enabled(self.mode, x.device):
            return None
        if x.dtype not in _KERNEL_DTYPES or x.dim() < 2:
            return None
        if not (x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=_NHWC))):
            return None
        for p in (self.weight, self.bias):
            if p is not None and p.dtype != x.dtype:
                return None
        return _kernel()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", silu={self.silu}"


def _silu_input(_module: nn.Module, args: tuple) -> tuple:
    # ResnetBlock2D applied nonlinearity(temb) before time_emb_proj; that module is identity now
    return (nn.functional.silu(args[0]),) + args[1:]


def _plain_group_norm(m: object) -> bool:
    return type(m) is nn.GroupNorm


def fuse_group_norms(model: nn.Module, mode: str = "auto") -> int:
    """Swap every fusable GroupNorm of `model` (see the module doc), each with kernel `mode`
    (FusedGroupNorm.mode); returns how many."""
    swapped = 0
    for mod in list(model.modules()):
        if isinstance(mod, ResnetBlock2D):
            if (
                mod.time_embedding_norm != "scale_shift"  # else norm2 is followed by scale/shift
                and type(mod.nonlinearity) is nn.SiLU
                and _plain_group_norm(mod.norm1)
                and _plain_group_norm(mod.norm2)
            ):
                mod.norm1 = FusedGroupNorm(mod.norm1, silu=True, mode=mode)
                mod.norm2 = FusedGroupNorm(mod.norm2, silu=True, mode=mode)
                if mod.time_emb_proj is not None and not mod.skip_time_act:
                    mod.time_emb_proj.register_forward_pre_hook(_silu_input)
                mod.nonlinearity = nn.Identity()
                swapped += 2
        elif isinstance(mod, Transformer2DModel) and _plain_group_norm(getattr(mod, "norm", None)):
            mod.norm = FusedGroupNorm(mod.norm, silu=False, mode=mode)
            swapped += 1
        if (
            _plain_group_norm(getattr(mod, "conv_norm_out", None))
            and type(getattr(mod, "conv_act", None)) is nn.SiLU
        ):
            mod.conv_norm_out = FusedGroupNorm(mod.conv_norm_out, silu=True, mode=mode)
            mod.conv_act = nn.Identity()
            swapped += 1
    return swapped
