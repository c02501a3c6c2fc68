"""Vectorised per-request scheduler math equals per-request diffusers scheduler copies.

float32: bit for bit. float16/bfloat16: within one rounding of the sigma products (see the
module docstring of instgenie.engine.noise_schedule for why bitwise equality is device-dependent).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

from instgenie.engine.adapters.flux_fill import SCHEDULER_CONFIG as FLUX_CFG
from instgenie.engine.adapters.sdxl_inpaint import SCHEDULER_CONFIG as SDXL_CFG
from instgenie.engine.noise_schedule import euler_scale_input, euler_step, flow_match_step

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        assert torch.equal(actual, expected)
    else:  # one rounding of a product, propagated through one add: 2 ulp relative
        eps = torch.finfo(actual.dtype).eps
        torch.testing.assert_close(actual, expected, rtol=2 * eps, atol=2 * eps)


def _copies(cls, cfg, steps_list, **kw):
    out = []
    for n in steps_list:
        s = cls(**cfg)
        s.set_timesteps(n, **kw)
        s.set_begin_index(0)
        out.append(s)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_euler_matches_scheduler_copies(dtype: torch.dtype, prediction_type: str) -> None:
    cfg = dict(SDXL_CFG, prediction_type=prediction_type)
    steps_list, idx = [10, 25, 7], [3, 0, 6]  # different step counts and positions
    scheds = _copies(EulerDiscreteScheduler, cfg, steps_list)
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(3, 4, 8, 8, generator=g).to(dtype)
    out = torch.randn(3, 4, 8, 8, generator=g).to(dtype)

    ref_scaled, ref_next = [], []
    for j, s in enumerate(scheds):
        s._step_index = idx[j]
        t = s.timesteps[idx[j]]
        ref_scaled.append(s.scale_model_input(sample[j : j + 1], t))
        ref_next.append(s.step(out[j : j + 1], t, sample[j : j + 1], return_dict=False)[0])

    sig = torch.stack([s.sigmas[i] for s, i in zip(scheds, idx, strict=True)])
    nxt = torch.stack([s.sigmas[i + 1] for s, i in zip(scheds, idx, strict=True)])
    assert_same(euler_scale_input(sample, sig), torch.cat(ref_scaled))
    assert_same(euler_step(out, sample, sig, nxt, prediction_type), torch.cat(ref_next))


@pytest.mark.parametrize("dtype", DTYPES)
def test_flow_match_matches_scheduler_copies(dtype: torch.dtype) -> None:
    steps_list, idx = [12, 4, 30], [11, 1, 9]
    scheds = []
    for n in steps_list:
        s = FlowMatchEulerDiscreteScheduler(**FLUX_CFG)
        s.set_timesteps(sigmas=[1.0 - k / n for k in range(n)], mu=0.9)
        s.set_begin_index(0)
        scheds.append(s)
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(3, 16, 8, generator=g).to(dtype)
    out = torch.randn(3, 16, 8, generator=g).to(dtype)
    ref = []
    for j, s in enumerate(scheds):
        s._step_index = idx[j]
        ref.append(
            s.step(out[j : j + 1], s.timesteps[idx[j]], sample[j : j + 1], return_dict=False)[0]
        )
    sig = torch.stack([s.sigmas[i] for s, i in zip(scheds, idx, strict=True)])
    nxt = torch.stack([s.sigmas[i + 1] for s, i in zip(scheds, idx, strict=True)])
    assert_same(flow_match_step(out, sample, sig, nxt), torch.cat(ref))


def test_unknown_prediction_type_rejected() -> None:
    x = torch.ones(1, 1)
    with pytest.raises(ValueError, match="prediction_type"):
        euler_step(x, x, torch.ones(1), torch.zeros(1), "flow")
