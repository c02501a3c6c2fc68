"""`instgenie train-reference` and the reference architectures: the tokenizers hold every
dataset word as one token, the shipped models are the architectures configs.py builds, and a
CPU smoke run of the training command writes an fp16 diffusers directory that the engine loads
and edits with, with its loss curves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
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


def test_a_twin_pool_pairs_each_scene_with_its_recoloured_edit() -> None:
    """pool.render(twins=True): images 2j and 2j + 1 are one scene and its edit (write.edited_of):
    same masks, same pixels outside the garment, another garment and caption."""
    from instgenie.dataset.render import GARMENT, render
    from instgenie.dataset.write import entry, scene_of
    from instgenie.reference import pool

    p = pool.render(3, 64, seed=0, workers=1)
    assert len(p) == 6 and list(p.partners) == [1, 0, 3, 2, 5, 4]
    for j in range(0, 6, 2):
        assert (p.masks[j] == p.masks[j + 1]).all()
        assert p.captions[j] != p.captions[j + 1]
    meta, image, _ = next(
        entry(0, i, 64) for i in range(50) if entry(0, i, 64)[0]["split"] == "train"
    )
    assert (p.images[0] == image).all() and p.captions[0] == meta["caption"]
    assert p.captions[1] == meta["edit"]["prompt"]
    garment = render(scene_of(meta), 64)[1] == GARMENT
    near = np.asarray(Image.fromarray(garment).filter(ImageFilter.MaxFilter(5)))  # + edge blur
    assert (p.images[0][~near] == p.images[1][~near]).all()
    assert (p.images[0][garment] != p.images[1][garment]).any(-1).mean() > 0.5
    plain = pool.render(3, 64, seed=0, workers=1, twins=False)
    assert len(plain) == 3 and plain.partners is None and (plain.images[1] == p.images[2]).all()


def test_edit_rows_see_the_twins_context_and_count_only_inside_the_mask() -> None:
    """train.Batches with edit_p = 1: every masked row's masked-image latents are its twin's
    (not its own), and objectives.cell_weights zeroes an edit row's loss outside the mask (grown
    by one cell), so that a prediction error there changes nothing."""
    import torch

    from instgenie.reference import objectives, pool
    from instgenie.reference.train import Batches

    vae = configs.new_pipeline("sdxl-inpaint").vae.eval()
    p = pool.render(4, 64, seed=0, workers=1)
    gen = torch.Generator().manual_seed(0)
    batches = Batches(p, torch.device("cpu"), 0, full_mask_p=0.0, edit_p=1.0)
    batches.encode(vae, "fp32", chunk=4)
    state = batches.rng.bit_generator.state
    _, masked, _, _, edit = batches.latents(8, gen)
    batches.rng.bit_generator.state = state
    _, i, k, _ = batches._pick(8)  # the rows latents() drew
    assert edit.all()
    for r in range(8):
        assert torch.equal(masked[r], batches.twin_lat[i[r], k[r]].float())
    # where a mask leaves part of the garment visible, the twin's context is another one
    assert not all(torch.equal(masked[r], batches.masked_lat[i[r], k[r]].float())
                   for r in range(8))  # fmt: skip
    plain = Batches(p, torch.device("cpu"), 0, full_mask_p=0.0, edit_p=0.0)
    plain.encode(vae, "fp32", chunk=4)
    assert plain.twin_lat is None and not plain.latents(8, gen)[-1].any()

    m = torch.zeros(2, 1, 64, 64)
    m[:, :, :16, :16] = 1
    w = objectives.cell_weights(m, torch.tensor([True, False]), (8, 8))
    assert w[1].sum() == 64  # a plain row counts every cell
    assert w[0, 0, :3, :3].all() and w[0].sum() == 9  # 2 x 2 cells touched, grown by one
    err = torch.rand(2, 1, 8, 8)
    bumped = err.clone()
    bumped[0, 0, 5:, 5:] += 100.0  # outside the edit row's cells
    assert torch.equal(objectives.row_means(err, w)[0], objectives.row_means(bumped, w)[0])


def test_the_learning_rate_warms_up_then_falls_on_a_cosine_by_steps_or_minutes() -> None:
    from instgenie.reference.settings import TrainConfig
    from instgenie.reference.train import lr_factor

    cfg = TrainConfig("sdxl-inpaint", steps=1000, warmup=100, lr_final=0.1, max_minutes=10)
    assert lr_factor(cfg, 50, 0.0) == pytest.approx(
        0.5 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 0.05)))
    )
    assert lr_factor(cfg, 500, 0.0) == pytest.approx(0.55)  # half the steps
    assert lr_factor(cfg, 10, 5.0) == pytest.approx(0.1 * 0.55)  # half the minutes, warming up
    assert lr_factor(cfg, 1000, 0.0) == pytest.approx(0.1)
    constant = TrainConfig("sdxl-inpaint", steps=1000, warmup=100)
    assert lr_factor(constant, 700, 3.0) == 1.0


def test_a_checkpoint_writes_the_ema_weights_and_leaves_training_untouched(tmp_path: Path) -> None:
    import torch

    from instgenie.reference.train import checkpoint

    pipe = configs.load_pipeline("flux-fill", str(REF_ROOT / "flux-fill"))
    pipe.to(torch.float32)
    params = list(pipe.transformer.parameters())
    live = [p.detach().clone() for p in params]
    ema = [p.detach().clone() + 0.5 for p in params]
    checkpoint(pipe, params, ema, tmp_path / "ck", {"step": 7, "curve": []})
    assert all(torch.equal(p, q) for p, q in zip(params, live, strict=True))
    assert json.loads((tmp_path / "ck" / "checkpoint.json").read_text())["step"] == 7
    with safe_open(str(tmp_path / "ck" / "transformer" / "diffusion_pytorch_model.safetensors"),
                   "pt") as f:  # fmt: skip
        assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())
    saved = configs.load_pipeline("flux-fill", str(tmp_path / "ck")).transformer
    assert all(torch.equal(p, e.half().float())
               for p, e in zip(saved.parameters(), ema, strict=True))  # fmt: skip


def test_shaped_noise_adds_low_frequency_power_at_unit_variance() -> None:
    """objectives.shaped_noise: with no shaping it is the generator's white noise; offset and
    multi-resolution noise keep each row at unit variance and raise the variance of its regional
    means (what a noise-prediction model must learn not to read as colour) by the expected
    amount."""
    from instgenie.reference.objectives import shaped_noise

    shape, dev = (64, 4, 64, 64), torch.device("cpu")

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(3)

    white = shaped_noise(shape, dev, gen())
    assert torch.equal(white, torch.randn(shape, generator=gen()))
    for offset, multires in [(0.1, 0.0), (0.0, 0.4), (0.1, 0.4)]:
        n = shaped_noise(shape, dev, gen(), offset, multires)
        assert torch.allclose(n.std(dim=(1, 2, 3)), torch.ones(64), atol=1e-5)
        assert abs(float(n.mean())) < 0.05
    # whole-image means per row and channel: white noise 1 / 4096 of a unit variance; offset
    # noise 0.1 adds 0.01 / (1 + 0.01)
    assert float(white.mean(dim=(2, 3)).var()) < 1e-3
    offset = shaped_noise(shape, dev, gen(), 0.1, 0.0)
    assert 0.006 < float(offset.mean(dim=(2, 3)).var()) < 0.016

    # 16 x 16 regions (a garment's size on the 64 x 64 latent grid): multi-resolution noise
    # carries the coarse levels' power there (discount 0.4: levels 3-6 hold ~0.004 of 1.19)
    def region_var(x: torch.Tensor) -> float:
        return float(torch.nn.functional.avg_pool2d(x, 16).var())

    multires = shaped_noise(shape, dev, gen(), 0.0, 0.4)
    assert region_var(white) < 0.006
    assert region_var(multires) > 2 * region_var(white)


def test_a_decoder_fine_tune_changes_the_decoder_alone(tmp_path: Path) -> None:
    """`--init DIR --steps 0 --decoder-steps N` (decision 0045): the decoder and post-quant conv
    train; the encoder (so the latent space), its scaling and the backbone stay byte for byte,
    and the record holds the decoder's curve and the reconstruction before and after."""
    from safetensors.torch import load_file

    src = REF_ROOT / "sdxl-inpaint"
    out = tmp_path / "dec"
    rc = main(["train-reference", "--family", "sdxl-inpaint", "--init", str(src), "--out",
               str(out), "--device", "cpu", "--scenes", "4", "--size", "64", "--steps", "0",
               "--decoder-steps", "2", "--vae-batch", "2", "--colour-augment", "1",
               "--log-every", "1", "--amp", "fp32"])  # fmt: skip
    assert rc == 0
    record = json.loads((out / "training.json").read_text())
    assert record["backbone"]["steps"] == 0
    assert record["vae"]["decoder"]["steps"] == 2 and len(record["vae"]["decoder"]["curve"]) == 2
    assert "reconstruction_psnr_db_before" in record["vae"]
    name = "diffusion_pytorch_model.safetensors"
    before, after = load_file(src / "vae" / name), load_file(out / "vae" / name)
    assert before.keys() == after.keys()
    trained = [k for k in before if k.startswith(("decoder.", "post_quant_conv."))]
    assert all(torch.equal(before[k], after[k]) for k in before.keys() - set(trained))
    # two steps at lr 2e-4 move most decoder tensors past fp16's resolution (not every one:
    # a norm weight near 1 moves by less than its fp16 step)
    moved = sum(not torch.equal(before[k], after[k]) for k in trained)
    assert moved > len(trained) // 2, (moved, len(trained))
    unet_before, unet_after = load_file(src / "unet" / name), load_file(out / "unet" / name)
    assert all(torch.equal(unet_before[k], unet_after[k]) for k in unet_before)
    config = lambda d: json.loads((d / "vae" / "config.json").read_text())  # noqa: E731
    assert config(out)["scaling_factor"] == config(src)["scaling_factor"]


def test_a_decoder_fine_tune_without_a_trained_model_is_a_usage_error(
    tmp_path: Path, capsys
) -> None:
    """--decoder-steps needs --init: refused before any pool is rendered."""
    pool, out = tmp_path / "p.npz", tmp_path / "o"
    rc = main(["train-reference", "--family", "sdxl-inpaint", "--out", str(out), "--pool",
               str(pool), "--decoder-steps", "5", "--device", "cpu"])  # fmt: skip
    assert rc == 2
    assert "--init" in capsys.readouterr().err
    assert not pool.exists() and not out.exists()


@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_a_whole_vae_fine_tune_moves_the_encoder_rescales_and_trains_the_backbone(
    family: str, tmp_path: Path, capsys
) -> None:
    """`--encoder-lr` with `--decoder-steps`: the encoder (and quant conv where the VAE has one)
    trains too, at its own learning rate, the latent scaling (and Flux's shift) is measured again
    on the new latents, and the backbone trains on them; without a backbone run (--steps 0), a
    decoder run, or with a negative rate it is refused, and so is such a TrainConfig."""
    from safetensors.torch import load_file

    from instgenie.reference.settings import TrainConfig

    src = REF_ROOT / family
    out = tmp_path / "vae"
    common = ["train-reference", "--family", family, "--init", str(src), "--device", "cpu",
              "--scenes", "4", "--size", "64", "--vae-batch", "2", "--batch", "2",
              "--log-every", "1", "--amp", "fp32"]  # fmt: skip
    rc = main([*common, "--out", str(out), "--decoder-steps", "2", "--encoder-lr", "3e-4",
               "--decoder-lr", "2e-4", "--steps", "1"])  # fmt: skip
    assert rc == 0
    record = json.loads((out / "training.json").read_text())
    assert record["vae"]["decoder"]["steps"] == 2 and record["backbone"]["steps"] == 1
    vae = configs.load_pipeline(family, src).vae
    count = lambda *ms: sum(p.numel() for m in ms if m is not None for p in m.parameters())  # noqa: E731
    assert record["vae"]["decoder"]["groups"] == [
        {"lr": 2e-4, "parameters": count(vae.decoder, vae.post_quant_conv)},
        {"lr": 3e-4, "parameters": count(vae.encoder, vae.quant_conv)},
    ]
    name = "diffusion_pytorch_model.safetensors"
    before, after = load_file(src / "vae" / name), load_file(out / "vae" / name)
    for part in ("encoder.", "decoder."):
        keys = [k for k in before if k.startswith(part)]
        moved = sum(not torch.equal(before[k], after[k]) for k in keys)
        assert moved > len(keys) // 2, (part, moved, len(keys))
    config = json.loads((out / "vae" / "config.json").read_text())
    latents = record["vae"]["latents"]
    assert config["scaling_factor"] == record["vae"]["scaling_factor"]
    assert config["scaling_factor"] == pytest.approx(1 / latents["std"], rel=1e-4)
    if family == "flux-fill":
        assert config["shift_factor"] == pytest.approx(latents["mean"], abs=1e-5)
    for bad in (["--decoder-steps", "2", "--steps", "0"], ["--steps", "1"]):
        rc = main([*common, "--out", str(tmp_path / "no"), "--encoder-lr", "1e-4", *bad])
        assert rc == 2 and "--encoder-lr" in capsys.readouterr().err
    rc = main([*common, "--out", str(tmp_path / "no"), "--encoder-lr=-1e-4",
               "--decoder-steps", "2", "--steps", "1"])  # fmt: skip
    assert rc == 2 and "--encoder-lr" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match="encoder_lr"):
        TrainConfig(family=family, init=str(src), encoder_lr=1e-4, decoder_steps=2, steps=0)
