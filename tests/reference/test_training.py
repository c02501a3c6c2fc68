"""`instgenie train-reference` and the reference architectures: the tokenizers hold every
dataset word as one token, the shipped models are the architectures configs.py builds, and a
CPU smoke run of the training command writes an fp16 diffusers directory that the engine loads
and edits with, with its loss curves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open

from instgenie.cli import main
from instgenie.engine.family import REF_ROOT
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.reference import configs
from instgenie.reference.evaluate import png


def test_every_dataset_word_is_one_token_and_the_shipped_tokenizers_agree() -> None:
    from transformers import AutoTokenizer

    clip, t5 = configs.clip_tokenizer(), configs.t5_tokenizer()
    for word in configs._words():
        assert len(clip.tokenize(word)) == 1, word
        if word.isalpha():
            assert len(t5.tokenize(f" {word}")) == 1, word
    caption = "a person in a purple checked long-sleeved shirt on a light blue panelled wall"
    shipped = AutoTokenizer.from_pretrained(REF_ROOT / "sdxl-inpaint" / "tokenizer")
    assert shipped(caption).input_ids == clip(caption).input_ids
    shipped_t5 = AutoTokenizer.from_pretrained(REF_ROOT / "flux-fill" / "tokenizer_2")
    assert shipped_t5(caption).input_ids == t5(caption).input_ids


@pytest.mark.parametrize(
    ("family", "part", "config"),
    [("sdxl-inpaint", "unet", configs.UNET), ("flux-fill", "transformer", configs.TRANSFORMER)],
)
def test_the_shipped_models_are_the_architectures_configs_builds(family, part, config) -> None:
    shipped = json.loads((REF_ROOT / family / part / "config.json").read_text())
    for k, v in config.items():
        want = list(v) if isinstance(v, tuple) else v
        assert shipped[k] == want, k


@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_a_cpu_training_run_writes_an_fp16_pipeline_the_engine_edits_with(
    family: str, tmp_path: Path, capsys
) -> None:
    out = tmp_path / family
    rc = main(["train-reference", "--family", family, "--out", str(out), "--device", "cpu",
               "--scenes", "6", "--size", "64", "--vae-steps", "2", "--vae-batch", "2",
               "--vae-crop", "32", "--steps", "2", "--batch", "2", "--log-every", "1",
               "--amp", "fp32"])  # fmt: skip
    assert rc == 0
    record = json.loads((out / "training.json").read_text())
    assert record["vae"]["steps"] == 2 and len(record["vae"]["curve"]) == 2
    assert record["backbone"]["steps"] == 2 and len(record["backbone"]["curve"]) == 2
    assert record["vae"]["scaling_factor"] > 0
    part = "unet" if family == "sdxl-inpaint" else "transformer"
    with safe_open(str(out / part / "diffusion_pytorch_model.safetensors"), "pt") as f:
        name = next(iter(f.keys()))
        assert str(f.get_tensor(name).dtype) == "torch.float16"
    pipe = EditPipeline.load(f"{family}:{out}")
    image = np.full((64, 64, 3), 120, np.uint8)
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    res = pipe.run(
        [
            EditRequest(
                uid="a",
                image=png(image),
                mask=png(mask),
                prompt="a person in a red t-shirt",
                num_inference_steps=2,
            )
        ]
    )[0]
    got = np.asarray(res.image)
    assert got.shape == (64, 64, 3)
    assert (got[mask == 0] == 120).all()  # pasted back
    assert not (got[mask == 255] == 120).all()  # painted
    Image.fromarray(got)  # a real image
