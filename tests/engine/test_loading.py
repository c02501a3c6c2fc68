"""Model specs and the local-directory path: save a tiny pipeline, load it back offline."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import EulerDiscreteScheduler, PNDMScheduler

from instgenie.engine.family import ModelSpec, load_family
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.weights import is_owned_layout
from instgenie.errors import ModelLoadError
from tests.conftest import make_image, make_mask, png_bytes, tiny_pipeline


def _run(pipe: EditPipeline) -> np.ndarray:
    req = EditRequest(
        uid="l",
        image=png_bytes(make_image(128, 128, seed=9)),
        mask=png_bytes(make_mask(128, 128)),
        prompt="a striped scarf",
        seed=3,
        num_inference_steps=3,
        paste_back=False,
    )
    return np.asarray(pipe.run([req])[0].image)


def test_save_pretrained_round_trip(family: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any hub access would fail loudly
    tiny = tiny_pipeline(family)
    tiny.family.pipe.save_pretrained(tmp_path)
    loaded = EditPipeline.load(f"{family}:{tmp_path}")
    assert loaded.family.spec.is_local_dir
    np.testing.assert_array_equal(_run(loaded), _run(tiny))


def test_loaded_weights_do_not_read_their_files(tmp_path, monkeypatch) -> None:
    """Loaded weights are copied out of the safetensors files' memory maps into aligned memory
    (engine/weights.py): rewriting the files in place after the load changes nothing."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny = tiny_pipeline("flux-fill")
    tiny.family.pipe.save_pretrained(tmp_path)
    loaded = EditPipeline.load(f"flux-fill:{tmp_path}")
    tensors = [t for m in loaded.family.pipe.components.values() if isinstance(m, torch.nn.Module)
               for t in (*m.parameters(), *m.buffers())]  # fmt: skip
    assert tensors and all(is_owned_layout(t) for t in tensors)
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert len(files) == 4  # transformer, VAE, two text encoders
    for f in files:  # in place (same inode): pages of a private map not yet copied would see it
        with open(f, "r+b") as fh:
            fh.write(b"\xff" * f.stat().st_size)
    np.testing.assert_array_equal(_run(loaded), _run(tiny))


def test_multistep_scheduler_replaced_by_euler(tmp_path) -> None:
    pipe = tiny_pipeline("sd2-inpaint").family.pipe
    comps = dict(pipe.components)
    comps["scheduler"] = PNDMScheduler.from_config(pipe.scheduler.config)
    type(pipe)(**comps).save_pretrained(tmp_path)
    fam = load_family(f"sd2-inpaint:{tmp_path}")
    assert isinstance(fam.pipe.scheduler, EulerDiscreteScheduler)
    assert fam.pipe.scheduler.config.beta_schedule == pipe.scheduler.config.beta_schedule


@pytest.mark.parametrize(
    "spec, match",
    [
        ("sdxl-inpaint", "must be FAMILY:SIZE"),
        ("sd3:tiny", "unknown model family"),
        ("flux-fill:huge", "neither one of"),
        ("flux-fill:/nonexistent/dir", "neither one of"),
    ],
)
def test_bad_specs(spec: str, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelSpec.parse(spec)


def test_directory_without_model_index(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="no model_index.json"):
        load_family(f"sdxl-inpaint:{tmp_path}")


def test_wrong_pipeline_in_directory(tmp_path) -> None:
    tiny_pipeline("sdxl-inpaint").family.pipe.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="could not load sd2-inpaint"):
        load_family(f"sd2-inpaint:{tmp_path}")


def test_adapters_satisfy_the_family_protocol(family: str) -> None:
    from instgenie.engine.family import ModelFamily

    fam = tiny_pipeline(family).family
    assert isinstance(fam, ModelFamily)
    assert fam.uses_cfg(7.5) == (family != "flux-fill")
    assert fam.default_size == 128 and fam.granule in (8, 16, 32)
