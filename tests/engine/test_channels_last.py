"""channels_last UNets: Transformer2DModel outputs stay NHWC (`keep_channels_last`), same values,
and mask-aware replay stays exact (tiny models, CPU)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_2d import Transformer2DModel

from instgenie.engine.adapters.unet_inpaint import keep_channels_last
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from tests.conftest import make_image, png_bytes, unet_inputs
from tests.engine.test_masked_exact import MASKS, _close, _full, _run

NHWC = torch.channels_last


def _transformer_outputs(unet) -> list[torch.Tensor]:
    """Run-time outputs of every Transformer2DModel of `unet` (filled by forward hooks)."""
    outs: list[torch.Tensor] = []
    for m in unet.modules():
        if isinstance(m, Transformer2DModel):
            m.register_forward_hook(lambda mod, args, out: outs.append(out[0]))
    return outs


def test_transformer_outputs_stay_channels_last(unet_pair) -> None:
    stock, patched = unet_pair
    stock.to(memory_format=NHWC)
    patched.to(memory_format=NHWC)
    stacks = [m for m in patched.modules() if isinstance(m, Transformer2DModel)]
    assert keep_channels_last(patched) == len(stacks) > 0
    seen_stock, seen = _transformer_outputs(stock), _transformer_outputs(patched)
    kw = unet_inputs(stock)
    with torch.no_grad():
        want = stock(**kw).sample
        got = patched(**kw).sample
    # stock diffusers converts every stack's output back to NCHW; patched ones stay NHWC
    assert len(seen) == len(seen_stock) == len(stacks)
    assert all(t.is_contiguous() for t in seen_stock)
    assert all(t.is_contiguous(memory_format=NHWC) and not t.is_contiguous() for t in seen)
    for a, b in zip(seen, seen_stock, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_nchw_maps_keep_stock_behaviour(unet_pair) -> None:
    # An NCHW UNet with the patch: the stock method runs (NCHW outputs, identical values).
    stock, patched = unet_pair
    keep_channels_last(patched)
    seen = _transformer_outputs(patched)
    kw = unet_inputs(stock)
    with torch.no_grad():
        assert torch.equal(patched(**kw).sample, stock(**kw).sample)
    assert seen and all(t.is_contiguous() for t in seen)


@pytest.mark.parametrize("family", ["sdxl-inpaint", "sd2-inpaint"])
def test_masked_replay_exact_in_channels_last(family: str) -> None:
    # The replay invariant of tests/engine/test_masked_exact.py with the UNet in NHWC and patched.
    pipe = EditPipeline.load(f"{family}:tiny", dtype="fp64")
    pipe.family.unet.to(memory_format=NHWC)
    assert keep_channels_last(pipe.family.unet) > 0
    img, mask = png_bytes(make_image(128, 128, seed=1)), png_bytes(MASKS["ellipse"])
    common = dict(prompt="a red felt hat", seed=5, num_inference_steps=4)
    key = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
    edit = EditRequest(uid="e", image=None, template_id=key, mask=mask, paste_back=False, **common)
    masked = _run(pipe, pipe.preprocess(edit))
    assert masked.path == "masked" and masked.notes.cache == "hit"
    full = _full(pipe, EditRequest(uid="f", image=img, mask=mask, paste_back=False, **common))
    _close(masked.latents, full.latents)


def test_env_flag_defaults_to_channels_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """ExecConfig.channels_last: on by default; INSTGENIE_UNET_CHANNELS_LAST=0 (or false, no,
    off) turns it off in a config built at start, and --channels-last wins over it."""
    from tests.conftest import exec_at_start

    monkeypatch.delenv("INSTGENIE_UNET_CHANNELS_LAST", raising=False)
    assert exec_at_start().channels_last
    for off in ("0", "false", "no", "off"):
        monkeypatch.setenv("INSTGENIE_UNET_CHANNELS_LAST", off)
        assert not exec_at_start().channels_last
    assert exec_at_start("--channels-last").channels_last
