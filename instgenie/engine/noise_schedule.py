"""Per-request sigma/timestep tables and vectorised scheduler steps.

Diffusers schedulers keep a shared `_step_index` and read one scalar sigma per call, which cannot
serve a batch whose members sit at different steps. Here each request gets its own tables, built
once from a private copy of the pipeline's scheduler, and one step for the whole batch is a few
element-wise ops with per-sample sigmas of shape (B, 1, ...).

Exactness: the operations are diffusers' own, in the same order, so in float32 the result equals
`scheduler.step` bit for bit (tests/engine/test_noise_schedule.py). In float16/bfloat16 diffusers
combines the low-precision model output with a 0-d float32 sigma, and PyTorch sometimes rounds that
scalar to float16 first and sometimes not (it differs by op and device: CPU `mul` rounds, `div` and
CUDA CPU-scalar operands do not). Here the scalar products are always taken in float32 and rounded
once, so low-precision results agree with diffusers to within one rounding of those products.
Only Euler-family schedulers are supported: multistep ones (PNDM, DPM++) keep history that is
per-request state we do not carry; SD2's default PNDM is replaced by Euler (see MODELS.md).
"""

from __future__ import annotations

import torch
from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

SUPPORTED_SCHEDULERS = (EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler)


def _bcast(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, ..., 1) with `like`'s rank."""
    return x.reshape(x.shape[0], *([1] * (like.dim() - 1)))


def _mul(x: torch.Tensor, scalar: torch.Tensor) -> torch.Tensor:
    """x * scalar with float32 math and one rounding to x's dtype (scalar: (B, 1, ...) float32)."""
    return (x.to(torch.float32) * scalar).to(x.dtype)


def euler_scale_input(sample: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """EulerDiscreteScheduler.scale_model_input for per-sample sigma (B,) float32."""
    denom = _bcast((sigma**2 + 1) ** 0.5, sample)
    return (sample.to(torch.float32) / denom).to(sample.dtype)


def euler_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """EulerDiscreteScheduler.step (s_churn = 0) for per-sample sigma, sigma_next (B,) float32."""
    sample = sample.to(torch.float32)
    s = _bcast(sigma, sample)
    if prediction_type == "epsilon":
        pred_original = sample - _mul(model_output, s)
    elif prediction_type == "v_prediction":
        pred_original = _mul(model_output, -s / (s**2 + 1) ** 0.5) + (sample / (s**2 + 1))
    elif prediction_type in ("sample", "original_sample"):
        pred_original = model_output
    else:
        raise ValueError(f"unsupported prediction_type {prediction_type!r}")
    derivative = (sample - pred_original) / s
    dt = _bcast(sigma_next, sample) - s
    return (sample + derivative * dt).to(model_output.dtype)


def flow_match_step(
    model_output: torch.Tensor, sample: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler.step (deterministic) for per-sample sigmas (B,) float32."""
    sample = sample.to(torch.float32)
    dt = _bcast(sigma_next - sigma, sample)
    return (sample + _mul(model_output, dt)).to(model_output.dtype)
