"""Attention backend selection through the pipeline (CPU; the Triton kernel interpreted).

A masked edit must run its attention on the backend it asked for — counted at the dispatch
point, `instgenie.engine.attention._run_backend` — and the Triton kernel and the SDPA loop must
give the same edit (fp32: they differ only in summation order and the kernel's online softmax;
tolerance 1e-5 of the latents' scale). A bad backend setting fails the model load with a typed
error, not the first step that reads a cache.
"""

from __future__ import annotations

import functools

import pytest
import torch

from instgenie.config import ExecConfig
from instgenie.engine import attention
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.errors import ModelLoadError
from tests.conftest import exec_at_start, make_image, make_mask, png_bytes
from triton_kernels.varlen_attention import _interpreting

STEPS = 2


@functools.cache
def fp32_pipeline(family: str) -> EditPipeline:
    return EditPipeline.load(f"{family}:tiny", dtype="fp32")


@pytest.mark.skipif(not _interpreting(), reason="needs TRITON_INTERPRET=1 (CPU kernel)")
@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_masked_edit_runs_the_selected_backend_and_they_agree(family: str, backend_calls) -> None:
    pipe = fp32_pipeline(family)
    # 64 x 64 and no CFG rows: the interpreted kernel is slow (SDXL at 128 x 128 with CFG: 70 s)
    img, mask = png_bytes(make_image(64, 64, seed=2)), png_bytes(make_mask(64, 64))
    key = pipe.build_template(TemplateSpec(image=img, num_inference_steps=STEPS))
    req = EditRequest(uid="e", image=None, template_id=key, mask=mask, prompt="boots", seed=5,
                      guidance_scale=1.0, num_inference_steps=STEPS)  # fmt: skip
    ex = pipe.family.masked
    outs = {}
    try:
        for backend in ("triton", "sdpa"):
            ex.attention_backend = backend
            backend_calls.clear()
            state = pipe.preprocess(req)
            assert state.path == "masked"
            while not state.is_done:
                pipe.denoise_step([state])
            assert set(backend_calls) == {backend} and backend_calls[backend] > 0
            outs[backend] = state.latents
    finally:
        ex.attention_backend = None
    scale = float(outs["sdpa"].abs().max())
    assert float((outs["triton"] - outs["sdpa"]).abs().max()) <= 1e-5 * scale


def test_resolve_backend_names_and_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ValueError, match="unknown attention backend 'bogus'"):
        attention.resolve_backend("bogus", cpu)
    assert attention.resolve_backend("auto", cpu) == "sdpa"
    assert attention.resolve_backend("sdpa", cuda) == "sdpa"
    monkeypatch.setattr(attention, "_flash_fn", lambda: None)
    with pytest.raises(RuntimeError, match="flash-attn is not installed"):
        attention.resolve_backend("flash", cuda)
    monkeypatch.setattr(attention, "_triton_interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        attention.resolve_backend("triton", cpu)
    assert attention.resolve_backend("triton", cuda) == "triton"
    monkeypatch.setattr(attention, "_triton_available", lambda: False)
    assert attention.resolve_backend("auto", cuda) == "sdpa"
    with pytest.raises(RuntimeError, match="triton is unavailable"):
        attention.resolve_backend("triton", cuda)


def test_bad_backend_setting_fails_the_config_or_the_model_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unknown backend is refused by the config (naming the field, or the variable it came
    from); one that cannot run here (flash-attn absent) fails the model load."""
    with pytest.raises(ValueError, match="attention_backend: 'bogus'"):
        ExecConfig(attention_backend="bogus")
    monkeypatch.setenv("INSTGENIE_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="INSTGENIE_ATTENTION_BACKEND"):
        exec_at_start()
    monkeypatch.setenv("INSTGENIE_ATTENTION_BACKEND", "flash")
    monkeypatch.setattr(attention, "_flash_fn", lambda: None)  # flash-attn absent
    with pytest.raises(ModelLoadError, match="attention_backend"):
        EditPipeline.load("sd2-inpaint:tiny", execution=exec_at_start())
