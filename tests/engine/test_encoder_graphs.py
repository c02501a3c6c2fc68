"""Text towers replayed from CUDA graphs (engine/encoder_graphs.py): a replay returns what the
tower's own forward returns, outputs outlive the next replay, ineligible calls run eagerly.

On CPU the graph form runs without CUDA (StepGraphs.force_static): every call goes through the
static input buffers, so the key and the copy of each call's inputs are checked here; capture and
replay are checked on the device (marked gpu)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from instgenie.config import ModelConfig, add_dataclass_args, dataclass_from_args
from instgenie.engine.encoder_graphs import GraphedForward, graph_text_encoders
from instgenie.engine.family import family_options, load_family
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from tests.conftest import make_image, make_mask, png_bytes

PROMPTS = ("a red dress", "a blue hat with a feather", "gold buttons", "a green scarf")


def _ids(fam, prompt: str, tower: str = "text_encoder") -> torch.Tensor:
    tok = fam.pipe.tokenizer if tower == "text_encoder" else fam.pipe.tokenizer_2
    length = getattr(fam, "text_len", 77) if "T5" in type(tok).__name__ else 77
    return tok(
        prompt, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
    ).input_ids


def _same(a, b) -> bool:
    """Equal pytrees of tensors (ModelOutput, tuples): same structure, torch.equal leaves."""
    la, sa = torch.utils._pytree.tree_flatten(a)
    lb, sb = torch.utils._pytree.tree_flatten(b)
    return sa == sb and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(la, lb, strict=True)
    )


# ---- CPU: the static form, eligibility, wiring -------------------------------------------------
def test_static_form_feeds_every_call_its_own_inputs() -> None:
    fam = load_family("sdxl-inpaint:tiny")
    tower = fam.pipe.text_encoder_2
    refs = [tower(_ids(fam, p), output_hidden_states=True) for p in PROMPTS[:3]]
    wrapped = GraphedForward(tower, torch.device("cpu"))
    wrapped.graphs.force_static = True  # the graph form's static buffers without CUDA
    with torch.no_grad():  # None is an argument too (SD2 passes attention_mask=None)
        outs = [tower(_ids(fam, p), None, output_hidden_states=True) for p in PROMPTS[:3]]
    for out, ref in zip(outs, refs, strict=True):
        assert type(out) is type(ref) and len(out.hidden_states) == len(ref.hidden_states)
        assert _same(out, ref)
    assert len(wrapped.graphs._entries) == 1  # one shape, one key: every call reused its buffers
    assert wrapped.counters["warmup"] == 3 and wrapped.counters["eager"] == 0
    wrapped.remove()
    assert "forward" not in tower.__dict__  # the class's forward again


def test_ineligible_calls_run_the_towers_own_forward() -> None:
    fam = load_family("sdxl-inpaint:tiny")
    tower = fam.pipe.text_encoder
    wrapped = GraphedForward(tower, torch.device("cpu"))
    wrapped.graphs.force_static = True
    ids = _ids(fam, PROMPTS[0])
    ref = tower.__class__.forward(tower, ids)
    out = tower(ids)  # autograd on: never through a graph
    with torch.no_grad(), FlopCounterMode(display=False):
        tower(ids)  # a dispatch mode (FLOP counting) is active
    with torch.no_grad():
        assert wrapped.eligible((ids,), {})
        assert not wrapped.eligible((ids,), {"flags": {"a"}})  # unhashable: cannot key a graph
        assert not wrapped.eligible((), {"flag": True})  # no tensor input
    assert wrapped.counters["eager"] == 2 and not wrapped.graphs._entries
    assert torch.equal(out.last_hidden_state, ref.last_hidden_state)


def test_only_cuda_towers_are_wrapped_and_the_switch_reaches_the_adapter() -> None:
    fam = load_family("flux-fill:tiny")
    assert graph_text_encoders(fam.pipe, torch.device("cpu")) == {}
    assert fam.text_graphs == {} and "forward" not in fam.pipe.text_encoder.__dict__
    parser = __import__("argparse").ArgumentParser()
    add_dataclass_args(parser, ModelConfig)
    off = dataclass_from_args(ModelConfig, parser.parse_args(["--no-text-encoder-graphs"]))
    assert ModelConfig().text_encoder_graphs and not off.text_encoder_graphs
    assert family_options(off)["text_encoder_graphs"] is False
    assert fam.warm_up_text_graphs() == 0.0 and fam.prompts.misses == 0  # nothing to capture


@pytest.mark.parametrize("family", ["sdxl-inpaint", "sd2-inpaint", "flux-fill"])
def test_encode_texts_is_what_the_prompt_cache_keeps(family: str) -> None:
    fam = load_family(f"{family}:tiny")
    do_cfg = fam.uses_cfg(fam.default_guidance)
    with torch.inference_mode():
        fam.prepare(_request("a", PROMPTS[1]), *_inputs(), 96, 128)
        ((entry, _),) = fam.prompts._entries.values()
        fresh = fam.encode_texts(PROMPTS[1], "blurry", do_cfg)
    assert len(entry) == len(fresh) and all(
        torch.equal(a, b) for a, b in zip(entry, fresh, strict=True) if a is not None
    )


# ---- GPU: capture, replay, failures ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("tower", ["text_encoder", "text_encoder_2"])
@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_replays_match_the_eager_forward_and_outlive_the_next_replay(family, tower, dtype) -> None:
    """Every call returns its graph's result (the first captures): the same ids give the same
    bits on the first and a later call; float32 equals the eager forward exactly, float16 within
    a rounding step; a returned output survives the replays after it."""
    fam = load_family(f"{family}:tiny", device="cuda", dtype=dtype)
    wrapped = fam.text_graphs[tower]
    module = getattr(fam.pipe, tower)
    kw = {"output_hidden_states": True} if family == "sdxl-inpaint" else {}
    ids = [_ids(fam, p, tower).cuda() for p in PROMPTS]
    with torch.inference_mode():
        outs = [module(x, **kw) for x in ids]  # capture (after a warm-up), then replays
        again = module(ids[0], **kw)
        refs = [wrapped.eager(x, **kw) for x in ids]
    assert wrapped.counters == {"capture": 1, "warmup": 1, "eager": 0, "replay": 4}
    assert _same(outs[0], again)  # the capture call's result is the replay's
    for out, ref in zip(outs, refs, strict=True):  # outs[0] was returned before 4 replays
        if dtype == "fp32":
            assert _same(out, ref)
        else:
            for a, b in zip(*(torch.utils._pytree.tree_leaves(o) for o in (out, ref)), strict=True):
                torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    assert not torch.equal(outs[0][0], outs[1][0])  # the prompts differ: not one stale buffer


@pytest.mark.gpu
def test_a_capture_that_fails_leaves_the_tower_eager_and_the_device_usable(caplog) -> None:
    class Syncing(torch.nn.Module):  # .item() synchronises: not capturable
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3, device="cuda"))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w * float(x.sum().item() > 0)

    m = Syncing()
    graphed = graph_text_encoders(type("P", (), {"text_encoder": m})(), torch.device("cuda"))
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        outs = [m(torch.full((3,), float(i + 1), device="cuda")) for i in range(3)]
    assert [o.tolist() for o in outs] == [[1.0] * 3, [2.0] * 3, [3.0] * 3]
    assert "capture failed" in caplog.text and m.forward.graphs.mode == "off"
    assert list(graphed) == ["text_encoder"] and graphed["text_encoder"].counters["replay"] == 0
    # the failed capture did not leave the CUDA generator marked as capturing
    assert torch.randn(2, device="cuda").isfinite().all()
    load_family("sdxl-inpaint:tiny", device="cuda", dtype="fp16")  # seeded random weights


def _inputs():
    return make_image(128, 96, seed=3), make_mask(128, 96)


def _request(uid: str, prompt: str) -> EditRequest:
    image, mask = make_image(128, 96, seed=3), make_mask(128, 96)
    return EditRequest(uid=uid, image=png_bytes(image), mask=png_bytes(mask), prompt=prompt,
                       negative_prompt="blurry", seed=7, num_inference_steps=3,
                       paste_back=False)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sdxl-inpaint", "sd2-inpaint", "flux-fill"])
def test_images_with_encoder_graphs(family: str) -> None:
    """Distinct prompts with the prompt cache off (every request encodes), then the first prompt
    again: in float32 the images equal those of eager towers; in float16 a prompt gives the same
    image as its first request and as a later one (every encode comes from the graph)."""
    pipes = {
        (dtype, graphs): EditPipeline.load(
            f"{family}:tiny",
            device="cuda",
            dtype=dtype,
            prompt_cache_bytes=0,
            text_encoder_graphs=graphs,
        )  # fmt: skip
        for dtype in ("fp32", "fp16")
        for graphs in (True, False)
    }
    assert pipes["fp32", True].family.text_graphs and not pipes["fp32", False].family.text_graphs
    images = {k: [] for k in pipes}
    for i, prompt in enumerate([*PROMPTS, PROMPTS[0]]):
        for k, pipe in pipes.items():
            images[k].append(np.asarray(pipe.run([_request(f"{k}{i}", prompt)])[0].image))
    for a, b in zip(images["fp32", True], images["fp32", False], strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(images["fp16", True][0], images["fp16", True][-1])
    for pipe in pipes.values():
        for wrapped in pipe.family.text_graphs.values():
            assert wrapped.counters["capture"] == 1 and wrapped.counters["replay"] >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sdxl-inpaint", "sd2-inpaint", "flux-fill"])
def test_warm_up_captures_before_the_first_request(family: str) -> None:
    """What a worker does before it reports ready: after it, a request's encodes are replays
    only, and the prompt cache is as it was."""
    pipe = EditPipeline.load(f"{family}:tiny", device="cuda", dtype="fp16")
    fam = pipe.family
    assert fam.warm_up_text_graphs() > 0
    assert (fam.prompts.misses, len(fam.prompts)) == (0, 0)
    before = {k: dict(w.counters) for k, w in fam.text_graphs.items()}
    assert before and all(c["capture"] == 1 and c["warmup"] == 1 for c in before.values())
    pipe.run([_request("a", PROMPTS[1])])
    for k, w in fam.text_graphs.items():
        assert w.counters["capture"] == 1 and w.counters["warmup"] == 1
        assert w.counters["replay"] > before[k]["replay"]
