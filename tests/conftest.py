"""Shared fixtures: synthetic images/masks and session-cached tiny pipelines."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import io
import os

import torch

# Triton decides at import whether its @jit functions (its own standard library included) are
# interpreted, and the imports below import triton (through diffusers). Without a GPU the
# kernels can only run interpreted: default to that here, before anything imports triton, so a
# plain `pytest` works like scripts/test.sh. On a GPU machine nothing is set (compiled kernels;
# TRITON_INTERPRET=1 still selects the interpreter explicitly).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# Hermetic: a config left at cache_root "auto" (the default) takes INSTGENIE_CACHE_ROOT, and an
# empty one means no host cache (templates in the loop's device memory, as every test that names
# no cache root expects). Set here, before anything runs, so that the worker and server
# subprocesses inherit it and nothing ever writes into the user's ~/.cache or /dev/shm segments
# that outlive the run; tests of the derivation pass their own probes (tests/cache/test_budgets.py)
# or set the variable themselves.
os.environ["INSTGENIE_CACHE_ROOT"] = ""

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image, ImageDraw

from instgenie.engine.adapters.base import AdapterBase
from instgenie.engine.adapters.sd2_inpaint import SD2Inpaint
from instgenie.engine.adapters.sdxl_inpaint import SDXLInpaint
from instgenie.engine.pipeline import EditPipeline

FAMILIES = ("sd2-inpaint", "sdxl-inpaint", "flux-fill")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true", help="run tests marked gpu (needs CUDA)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--gpu"):
        return
    skip = pytest.mark.skip(reason="GPU test: run with --gpu on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def png_bytes(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def make_image(width: int = 128, height: int = 128, seed: int = 0) -> Image.Image:
    """A structured RGB test image: gradients, shapes and mild noise (never constant)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    base = np.stack([x, y, 0.5 + 0.5 * np.sin(6 * (x + y) + seed)], axis=-1)
    arr = (base * 200 + rng.normal(0, 8, base.shape)).clip(0, 255).astype(np.uint8)
    img = Image.fromarray(arr, "RGB")
    draw = ImageDraw.Draw(img)
    cx, cy = rng.integers(width // 4, 3 * width // 4), rng.integers(height // 4, 3 * height // 4)
    draw.ellipse([cx - width // 6, cy - height // 6, cx + width // 6, cy + height // 6],
                 fill=tuple(int(v) for v in rng.integers(0, 255, 3)))  # fmt: skip
    return img


def make_mask(width: int = 128, height: int = 128, box: tuple[float, ...] = (0.25, 0.3, 0.7, 0.75)):
    """White (edit) rectangle given as fractions (x0, y0, x1, y1) on black."""
    m = Image.new("L", (width, height), 0)
    x0, y0, x1, y1 = box
    ImageDraw.Draw(m).rectangle(
        [int(x0 * width), int(y0 * height), int(x1 * width) - 1, int(y1 * height) - 1], fill=255
    )
    return m


@functools.cache
def tiny_pipeline(family: str) -> EditPipeline:
    return EditPipeline.load(f"{family}:tiny")


def planned_step(pipe: EditPipeline, batch: list, **fields) -> None:
    """One step of `batch` under the plan the pipeline makes (plan_step), with `fields` of the
    StepPlan replaced (e.g. compute_all, horizon): a step's inputs travel as its plan."""
    pipe.prepare_reads(batch)
    pipe.denoise_step(batch, dataclasses.replace(pipe.plan_step(batch), **fields))


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def backend_calls(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Counts varlen attention calls per backend at the dispatch point (the real backends run)."""
    from instgenie.engine import attention

    calls: collections.Counter = collections.Counter()
    run = attention._run_backend

    def counted(*args):
        calls[args[-1]] += 1
        return run(*args)

    monkeypatch.setattr(attention, "_run_backend", counted)
    return calls


# ---- tiny UNets on CPU, for the fused-kernel module swaps -----------------------------------


def tiny_components(adapter: type[AdapterBase]) -> dict:
    """Random-weight tiny components of a family, float32 on CPU."""
    return adapter.build_components(
        "tiny", build=adapter.builder("cpu", torch.float32, frozenset())
    )


@pytest.fixture(params=[SDXLInpaint, SD2Inpaint], ids=["sdxl", "sd2"])
def unet_pair(request: pytest.FixtureRequest):
    """(stock tiny UNet, an independent copy to swap modules in)."""
    unet = tiny_components(request.param)["unet"].eval()
    return unet, copy.deepcopy(unet)


def unet_inputs(unet, seed: int = 0) -> dict:
    """Random UNet forward arguments: batch 2, two timesteps, 7 text tokens (+ SDXL's added
    conditioning)."""
    g = torch.Generator().manual_seed(seed)
    cfg = unet.config
    s = cfg.sample_size
    kw = dict(
        sample=torch.randn(2, cfg.in_channels, s, s, generator=g),
        timestep=torch.tensor([500.0, 20.0]),
        encoder_hidden_states=torch.randn(2, 7, cfg.cross_attention_dim, generator=g),
    )
    if cfg.addition_embed_type == "text_time":
        kw["added_cond_kwargs"] = {
            "text_embeds": torch.randn(2, cfg.projection_class_embeddings_input_dim - 6 * 8,
                                       generator=g),
            "time_ids": torch.rand(2, 6, generator=g) * 64,
        }  # fmt: skip
    return kw


def swapped_unet_run(unet_pair, fuse, kind, mode: str, seed: int = 0):
    """Swap modules into the second UNet of `unet_pair` with `fuse` in kernel mode `mode`, run
    both UNets on the same inputs. Returns (swapped output, stock output, kernel call count of
    every swapped module of type `kind`)."""
    stock, fused = unet_pair
    fuse(fused, mode)
    kw = unet_inputs(stock, seed=seed)
    with torch.no_grad():
        want = stock(**kw).sample
        got = fused(**kw).sample
    calls = [m.kernel_calls for m in fused.modules() if isinstance(m, kind)]
    assert calls, f"no {kind.__name__} in the UNet"
    return got, want, calls


def set_kernel_mode(model, kind: type, mode: str) -> None:
    """Switch every swapped-in fused module of type `kind` in `model` to kernel `mode`."""
    for m in model.modules():
        if isinstance(m, kind):
            m.mode = mode


def exec_at_start(*flags: str):
    """The ExecConfig a command builds at start: its `flags` (--cuda-graphs off, ...), else the
    INSTGENIE_* variables set now, else the defaults."""
    import argparse

    from instgenie.config import ExecConfig, add_dataclass_args, dataclass_from_args

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, ExecConfig)
    return dataclass_from_args(ExecConfig, parser.parse_args(list(flags)))
