"""Train one reference model: its VAE on the pool's images, then its backbone and text towers
together on the family's objective (objectives.py); save the EMA weights in fp16, diffusers
layout, with `training.json` (the settings, the loss curves, the device, the time).

Seeded: the pool is write.entry(seed, i); initial weights, batches, masks, noise and timesteps
come from generators seeded with `seed`. A GPU's kernels are not bit-reproducible, so a retrain
reproduces the curves, not the bytes. `max_minutes` stops a phase early (the step reached is
recorded); after warm-up the learning rate falls on a cosine to lr_final x lr over the steps or
the minutes, whichever run out first (lr_final 1: constant). Any stopping point, and every
checkpoint written on the way (checkpoint_minutes), is a finished model (EMA weights).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from instgenie.reference import configs
from instgenie.reference.objectives import OBJECTIVES
from instgenie.reference.pool import Pool
from instgenie.reference.settings import TrainConfig

log = logging.getLogger(__name__)


def _autocast(dev: torch.device, amp: str = "bf16"):  # noqa: ANN202
    if dev.type == "cuda" and amp == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Batches:
    """Random batches of the pool on `device`: a random mask kind per image, or the whole image
    with probability full_mask_p. Before the VAE is trained: images in [-1, 1] (`images`); after
    `encode(vae)`: the pool's latents (`latents`), the images dropped."""

    def __init__(self, pool: Pool, device: torch.device, seed: int, full_mask_p: float,
                 edit_p: float = 0.0) -> None:  # fmt: skip
        self.images = torch.from_numpy(pool.images).to(device)  # uint8 NHWC
        self.masks = torch.from_numpy(pool.masks).to(device)  # bool (N, kinds, S, S)
        self.captions = pool.captions
        self.partners = None if pool.partners is None else torch.from_numpy(pool.partners)
        self.rng = np.random.default_rng(seed)
        self.full_mask_p = full_mask_p
        self.edit_p = edit_p if pool.partners is not None else 0.0
        self.device = device

    def _pick(self, b: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]:
        n, kinds = self.masks.shape[:2]
        idx = self.rng.integers(n, size=b)
        kind = self.rng.integers(kinds, size=b)
        full = torch.from_numpy(self.rng.random(b) < self.full_mask_p).to(self.device)
        i, k = torch.from_numpy(idx).to(self.device), torch.from_numpy(kind).to(self.device)
        return idx, i, k, full

    def _images(self, i: torch.Tensor) -> torch.Tensor:
        return self.images[i].permute(0, 3, 1, 2).float() / 127.5 - 1

    def images_crops(self, b: int, crop: int) -> torch.Tensor:
        """`b` images, one random `crop` x `crop` window (the same for the batch)."""
        _, i, _, _ = self._pick(b)
        side = self.images.shape[1]
        y, x = (int(v) for v in self.rng.integers(side - crop + 1, size=2))
        return self._images(i)[:, :, y : y + crop, x : x + crop]

    @torch.no_grad()
    def encode(self, vae: Any, amp: str, chunk: int = 64) -> None:
        """Encode the pool once: each image's posterior (mean, std) and each mask kind's masked
        image's posterior mean (masked = image * (mask < 0.5): zero where edited), fp16."""
        n, kinds = self.masks.shape[:2]
        means, stds, masked, twins = [], [], [], []

        def masked_latents(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            return torch.stack([vae.encode(x * ~self.masks[i, k][:, None]).latent_dist.mean
                                for k in range(kinds)], dim=1).half()  # fmt: skip

        for s in range(0, n, chunk):
            i = torch.arange(s, min(n, s + chunk), device=self.device)
            x = self._images(i)
            with _autocast(self.device, amp):
                post = vae.encode(x).latent_dist
                means.append(post.mean.half())
                stds.append(post.std.half())
                masked.append(masked_latents(x, i))
                if self.edit_p:  # the twin's pixels outside image i's masks
                    twins.append(masked_latents(self._images(self.partners[i.cpu()]), i))
        with _autocast(self.device, amp):  # a whole-image mask leaves a zero image
            self.blank = vae.encode(torch.zeros_like(x[:1])).latent_dist.mean.half()[0]
        self.lat_mean, self.lat_std = torch.cat(means), torch.cat(stds)
        self.masked_lat = torch.cat(masked)
        self.twin_lat = torch.cat(twins) if twins else None
        del self.images

    def latents(self, b: int, gen: torch.Generator):  # noqa: ANN201
        """(image latents: a posterior sample, masked-image latents, masks (B, 1, S, S) float,
        captions, edit (B,) bool): raw latents, float32. An edit row (share edit_p of the
        masked rows) shows the twin's pixels outside the mask: its loss counts inside the mask
        only (objectives.py), where the caption, not the context, says what to paint."""
        idx, i, k, full = self._pick(b)
        mean, std = self.lat_mean[i].float(), self.lat_std[i].float()
        lat = mean + std * torch.randn(mean.shape, device=self.device, generator=gen)
        masked = self.masked_lat[i, k].float()
        edit = torch.from_numpy(self.rng.random(b) < self.edit_p).to(self.device) & ~full
        if self.twin_lat is not None and bool(edit.any()):
            masked[edit] = self.twin_lat[i[edit], k[edit]].float()
        masked[full] = self.blank.float()
        masks = self.masks[i, k][:, None].float()
        masks[full] = 1.0
        return lat, masked, masks, [self.captions[j] for j in idx], edit


class Curve:
    """Mean loss per `every` steps, with the seconds since the phase began."""

    def __init__(self, every: int) -> None:
        self.every, self.points, self._acc, self._t0 = every, [], [], time.monotonic()

    def add(self, step: int, loss: float) -> None:
        self._acc.append(loss)
        if len(self._acc) == self.every:
            self.points.append([step, round(float(np.mean(self._acc)), 6),
                                round(time.monotonic() - self._t0, 1)])  # fmt: skip
            log.info("step %d loss %.5f", step, self.points[-1][1])
            self._acc = []

    def elapsed_min(self) -> float:
        return (time.monotonic() - self._t0) / 60


def _differences(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x[..., 1:, :] - x[..., :-1, :], x[..., :, 1:] - x[..., :, :-1]


def _reconstruction_loss(rec: torch.Tensor, images: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """L1 + grad_weight x L1 of the image gradients + colour_weight x L1 of 8 x 8 means (a
    region's colour, what the region classifier reads)."""
    loss = (rec - images).abs().mean()
    for a, b in zip(_differences(rec), _differences(images), strict=True):
        loss = loss + cfg.grad_weight * (a - b).abs().mean()
    if cfg.colour_weight:
        loss = (
            loss + cfg.colour_weight * (F.avg_pool2d(rec, 8) - F.avg_pool2d(images, 8)).abs().mean()
        )
    return loss


def _optimize(opt: torch.optim.Optimizer, loss: torch.Tensor, params: list[torch.Tensor],
              curve: Curve, step: int) -> None:  # fmt: skip
    """One optimizer step on `loss` (gradients clipped to norm 1), logged on `curve`."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    curve.add(step, float(loss.detach()))


def train_vae(vae: Any, batches: Batches, cfg: TrainConfig, gen: torch.Generator) -> dict:
    dev = batches.device
    vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, betas=(0.9, 0.99), weight_decay=0)
    curve = Curve(cfg.log_every)
    step = 0
    for step in range(1, cfg.vae_steps + 1):
        images = batches.images_crops(cfg.vae_batch, cfg.vae_crop)
        with _autocast(dev, cfg.amp):
            post = vae.encode(images).latent_dist
            rec = vae.decode(post.sample(gen)).sample.float()
        loss = _reconstruction_loss(rec, images, cfg) + cfg.kl_weight * post.kl().float().mean()
        _optimize(opt, loss, list(vae.parameters()), curve, step)
        if cfg.vae_minutes and curve.elapsed_min() >= cfg.vae_minutes:
            break
    vae.eval().requires_grad_(False)
    return {"steps": step, "curve": curve.points}


def finetune_decoder(vae: Any, batches: Batches, cfg: TrainConfig, gen: torch.Generator) -> dict:
    """Train the VAE's decoder (and post-quant conv) alone on whole images, decoding posterior
    samples of the frozen encoder: the latent space a trained backbone learnt stays as it is,
    while the decoder learns to render those latents' colours faithfully (decision 0045). Whole
    images, not crops: the decoder's GroupNorms then see the statistics they see in use. A share
    colour_augment of the images have their RGB channels permuted: the pool's garments come in
    the train split's colour x pattern combinations only, and a codec must render every colour
    (a held-out solid red decoded orange before). The learning rate falls on a cosine to
    lr_final over the steps or vae_minutes. With encoder_lr the encoder and quant conv train
    too (the KL term back in the loss): a new latent space, for a backbone that trains on it."""
    dev = batches.device
    vae.eval().requires_grad_(False)
    parts = [([vae.decoder, vae.post_quant_conv], cfg.decoder_lr)]
    if cfg.encoder_lr:
        parts.append(([vae.encoder, vae.quant_conv], cfg.encoder_lr))
    parts = [([m for m in modules if m is not None], lr) for modules, lr in parts]  # Flux: no convs
    for modules, _ in parts:
        for m in modules:
            m.train().requires_grad_(True)  # only what trains leaves eval mode
    groups = [([p for m in modules for p in m.parameters()], lr) for modules, lr in parts]
    params = [p for group, _ in groups for p in group]
    opt = torch.optim.AdamW([{"params": g, "lr": lr, "base_lr": lr} for g, lr in groups],
                            betas=(0.9, 0.99), weight_decay=0)  # fmt: skip
    curve = Curve(cfg.log_every)
    side, step = batches.images.shape[1], 0
    for step in range(1, cfg.decoder_steps + 1):
        minutes = curve.elapsed_min() / cfg.vae_minutes if cfg.vae_minutes else 0.0
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * _cosine(max(step / cfg.decoder_steps, minutes), cfg)
        images = batches.images_crops(cfg.vae_batch, side)
        for i in np.flatnonzero(batches.rng.random(len(images)) < cfg.colour_augment):
            images[i] = images[i, torch.from_numpy(batches.rng.permutation(3)).to(dev)]
        with _autocast(dev, cfg.amp):
            with torch.set_grad_enabled(bool(cfg.encoder_lr)):
                post = vae.encode(images).latent_dist
                z = post.sample(gen)
            rec = vae.decode(z).sample.float()
        loss = _reconstruction_loss(rec, images, cfg)
        if cfg.encoder_lr:
            loss = loss + cfg.kl_weight * post.kl().float().mean()
        _optimize(opt, loss, params, curve, step)
        if cfg.vae_minutes and curve.elapsed_min() >= cfg.vae_minutes:
            break
    vae.eval().requires_grad_(False)
    trained = [{"lr": lr, "parameters": sum(p.numel() for p in group)} for group, lr in groups]
    return {"steps": step, "curve": curve.points, "groups": trained}


@torch.no_grad()
def latent_stats(vae: Any, batches: Batches, gen: torch.Generator, n: int = 256) -> dict:
    """Mean and standard deviation of the VAE's latents over `n` pool images: the shift factor
    (Flux) and 1 / std as the scaling factor, so the backbone sees unit-variance latents."""
    lats = []
    for _ in range(max(1, n // 32)):
        images = batches.images_crops(32, batches.images.shape[1])
        lats.append(vae.encode(images).latent_dist.sample(gen).float())
    z = torch.cat(lats)
    return {"mean": float(z.mean()), "std": float(z.std())}


def latent_scaling(stats: dict, family: str) -> dict:
    """The VAE config's scaling (1 / std) and, for Flux, shift (the mean) of `stats`."""
    scaling = {"scaling_factor": round(1.0 / stats["std"], 5)}
    if family == "flux-fill":
        scaling["shift_factor"] = round(stats["mean"], 5)
    return scaling


def lr_factor(cfg: TrainConfig, step: int, minutes: float) -> float:
    """Linear warm-up over cfg.warmup steps, then a cosine from 1 to cfg.lr_final over the
    run's progress (the larger of its share of steps and of max_minutes)."""
    warm = min(1.0, step / cfg.warmup) if cfg.warmup else 1.0
    progress = step / cfg.steps
    if cfg.max_minutes:
        progress = max(progress, minutes / cfg.max_minutes)
    return warm * _cosine(progress, cfg)


def _cosine(progress: float, cfg: TrainConfig) -> float:
    """From 1 at progress 0 to cfg.lr_final at progress >= 1, on a half cosine."""
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr_final + (1 - cfg.lr_final) * cosine


def _assign(params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v.to(p.dtype))


def checkpoint(pipe: Any, params: list[torch.Tensor], ema: list[torch.Tensor], out: Path,
               progress: dict) -> None:  # fmt: skip
    """Write the EMA weights as a finished model (fp16, diffusers layout) to `out` without
    disturbing training: a copy of the pipeline takes them."""
    live = [p.detach().clone() for p in params]
    _assign(params, ema)
    snapshot = copy.deepcopy(pipe)
    _assign(params, live)
    save(snapshot, out, {"checkpoint.json": json.dumps(progress) + "\n"})
    log.info("checkpoint at step %d: %s", progress["step"], out)


class BackboneStep:
    """The backbone and text towers in training: one call is one optimizer step (the family's
    objective on a batch of `batches`, backward, clipping, AdamW) and the EMA update. What
    train_backbone repeats and bench/train_speed.py times."""

    def __init__(self, pipe: Any, family: str, uncond_p: float, lr: float,
                 noise_offset: float = 0.0, multires_noise: float = 0.0) -> None:  # fmt: skip
        self.objective = OBJECTIVES[family](pipe, uncond_p, noise_offset, multires_noise)
        self.params = [p for m in self.objective.modules for p in m.parameters()]
        for m in self.objective.modules:
            m.train().requires_grad_(True)
        self.ema = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)

    def __call__(self, batches: Batches, batch: int, amp: str, gen: torch.Generator,
                 lr: float, ema_decay: float) -> float:  # fmt: skip
        """One step at learning rate `lr`; the batch's loss."""
        for group in self.opt.param_groups:
            group["lr"] = lr
        lat, masked, masks, captions, edit = batches.latents(batch, gen)
        with _autocast(batches.device, amp):
            loss = self.objective.loss(lat, masked, masks, captions, gen, edit)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        with torch.no_grad():
            live = [p.detach().float() for p in self.params]
            torch._foreach_lerp_(self.ema, live, 1 - ema_decay)
        return float(loss.detach())

    def finish(self) -> None:
        """The EMA weights into the modules, which leave training."""
        _assign(self.params, self.ema)
        for m in self.objective.modules:
            m.eval().requires_grad_(False)


def train_backbone(pipe: Any, batches: Batches, cfg: TrainConfig, gen: torch.Generator,
                   out: Path | None = None) -> dict:  # fmt: skip
    step_once = BackboneStep(pipe, cfg.family, cfg.uncond_p, cfg.lr, cfg.noise_offset,
                             cfg.multires_noise)  # fmt: skip
    curve = Curve(cfg.log_every)
    step, last_checkpoint = 0, 0.0
    for step in range(1, cfg.steps + 1):
        lr = cfg.lr * lr_factor(cfg, step, curve.elapsed_min())
        decay = min(cfg.ema, (1 + step) / (10 + step))
        curve.add(step, step_once(batches, cfg.batch, cfg.amp, gen, lr, decay))
        minutes = curve.elapsed_min()
        if cfg.max_minutes and minutes >= cfg.max_minutes:
            break
        if out is not None and cfg.checkpoint_minutes and \
                minutes - last_checkpoint >= cfg.checkpoint_minutes:  # fmt: skip
            checkpoint(pipe, step_once.params, step_once.ema, out,
                       {"step": step, "curve": curve.points})  # fmt: skip
            last_checkpoint = minutes
    step_once.finish()
    return {"steps": step, "curve": curve.points}


def train(cfg: TrainConfig, pool: Pool, out: Path, device: str = "cuda") -> dict:
    """Train `cfg.family` on `pool`; write the pipeline (fp16) and training.json to `out`."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # cuDNN's fused attention failed in backward here (mha_graph.execute, H200, torch 2.11)
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    batches = Batches(pool, dev, cfg.seed, cfg.full_mask_p, cfg.edit_p)
    t0 = time.monotonic()
    if cfg.init:
        pipe = configs.load_pipeline(cfg.family, cfg.init).to(dev)
        vae_log = {"steps": 0, "curve": [], "from": cfg.init}
        if cfg.decoder_steps:
            vae_log["reconstruction_psnr_db_before"] = reconstruction_psnr(pipe.vae, batches)
            vae_log["decoder"] = finetune_decoder(pipe.vae, batches, cfg, gen)
        stats = latent_stats(pipe.vae, batches, gen)
        if cfg.decoder_steps and cfg.encoder_lr:  # a new latent space: its own scaling
            pipe.vae.register_to_config(**latent_scaling(stats, cfg.family))
        scaling = {k: pipe.vae.config[k] for k in ("scaling_factor", "shift_factor")
                   if pipe.vae.config.get(k) is not None}  # fmt: skip
    else:
        pipe = configs.new_pipeline(cfg.family).to(dev)
        vae_log = train_vae(pipe.vae, batches, cfg, gen)
        stats = latent_stats(pipe.vae, batches, gen)
        scaling = latent_scaling(stats, cfg.family)
        pipe.vae.register_to_config(**scaling)
    pipe.set_progress_bar_config(disable=True)
    if dev.type == "cuda" and cfg.family == "sdxl-inpaint" and cfg.memory_format == "channels_last":
        # NHWC convolutions (cuDNN's fast path for bf16; decision 0004 for inference)
        pipe.unet.to(memory_format=torch.channels_last)
    vae_rec = reconstruction_psnr(pipe.vae, batches)
    t_enc = time.monotonic()
    backbone_log = {"steps": 0, "curve": []}
    if cfg.steps:  # steps 0: the VAE alone (a decoder fine-tune keeps the backbone as it was)
        batches.encode(pipe.vae, cfg.amp)
    encode_s = time.monotonic() - t_enc
    if cfg.steps:
        backbone_log = train_backbone(pipe, batches, cfg, gen, out)
    seconds = time.monotonic() - t0
    save(pipe, out)
    record = {
        "family": cfg.family, "config": dataclasses.asdict(cfg), "pool_images": len(pool),
        "pool_twins": pool.partners is not None,
        "side": int(pool.images.shape[1]), "vae": {**vae_log, "latents": stats, **scaling,
                                                   "reconstruction_psnr_db": vae_rec,
                                                   "pool_encode_s": round(encode_s, 1)},
        "backbone": backbone_log, "seconds": round(seconds, 1),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "parameters": parameter_counts(pipe),
    }  # fmt: skip
    (out / "training.json").write_text(json.dumps(record) + "\n")
    return record


@torch.no_grad()
def reconstruction_psnr(vae: Any, batches: Batches, n: int = 64) -> float:
    """PSNR (dB, 8-bit) of the VAE's mean reconstruction of `n` pool images."""
    images = batches.images_crops(n, batches.images.shape[1])
    rec = vae.decode(vae.encode(images).latent_dist.mode()).sample.float().clamp(-1, 1)
    mse = F.mse_loss((rec + 1) * 127.5, (images + 1) * 127.5)
    return round(float(10 * torch.log10(255.0**2 / mse)), 2)


def parameter_counts(pipe: Any) -> dict[str, int]:
    return {name: sum(p.numel() for p in m.parameters())
            for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}  # fmt: skip


def save(pipe: Any, out: Path, files: dict[str, str] | None = None) -> None:
    """fp16 safetensors in diffusers layout (the VAE too: force_upcast is off, its activations
    stay in range at 256 px), with `files` (name -> text) beside them. `out` is replaced whole,
    so a reader never sees a half-written model."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pipe.to(torch.device("cpu"), torch.float16)
    pipe.save_pretrained(str(tmp), safe_serialization=True)
    for name, text in (files or {}).items():
        (tmp / name).write_text(text)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
