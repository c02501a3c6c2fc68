"""A request state survives the trip to tensors + meta and back (what crosses processes)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from instgenie.engine.family import load_family
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.messages import EditParams, RequestNotes
from instgenie.worker.state_wire import (
    decoded_image,
    from_parts,
    inputs_from_parts,
    inputs_to_parts,
    to_parts,
)
from tests.conftest import FAMILIES, make_image, make_mask, png_bytes, tiny_pipeline


def test_round_trip_then_identical_denoising() -> None:
    for family in FAMILIES:
        pipe = tiny_pipeline(family)
        req = EditRequest(uid="c", image=png_bytes(make_image(96, 128)), mask=png_bytes(
            make_mask(96, 128)), prompt="a cap", seed=3, num_inference_steps=3)  # fmt: skip
        a = pipe.preprocess(req)
        tensors, meta = to_parts(a)
        assert all(t.device.type == "cpu" for t in tensors.values())
        b = from_parts(tensors, meta, torch.device("cpu"))
        assert b.batch_key == a.batch_key and b.num_steps == a.num_steps
        while not a.is_done:
            pipe.denoise_step([a])
            pipe.denoise_step([b])
        torch.testing.assert_close(a.latents, b.latents, rtol=0, atol=0)
        # the post-processing view (no conditioning) decodes to the same image
        tp, mp = to_parts(b, for_post=True)
        assert not any(k.startswith("cond.") for k in tp)
        c = from_parts(tp, mp, torch.device("cpu"))
        ia, ic = pipe.postprocess([a])[0], pipe.postprocess([c])[0]
        assert np.array_equal(np.asarray(ia.image), np.asarray(ic.image))
        assert ic.num_steps == 3 and ic.image.size == (96, 128)


def test_split_stages_equal_the_one_process_pipeline() -> None:
    """model_stages="loop": a model-less pre process decodes, the loop encodes and VAE-decodes, a
    model-less post process pastes back and encodes; the bytes equal one in-process run."""
    for family in FAMILIES:
        pipe = tiny_pipeline(family)
        codec_only = EditPipeline(load_family(f"{family}:tiny", parts="none"))
        weights = [p for m in codec_only.family.pipe.components.values()
                   if isinstance(m, torch.nn.Module) for p in m.parameters()]  # fmt: skip
        assert weights and all(p.device.type == "meta" for p in weights)  # no model in memory
        req = EditRequest(uid="s", image=png_bytes(make_image(72, 64)), mask=png_bytes(
            make_mask(72, 64)), prompt="a cap", seed=5, num_inference_steps=2)  # fmt: skip
        notes = RequestNotes(template_id="t", capture_key="k")
        uid, inputs, back = inputs_from_parts(
            *inputs_to_parts("s", codec_only.decode_inputs(req), notes)
        )
        assert (uid, back) == ("s", notes)
        state = pipe.encode_inputs(inputs)
        while not state.is_done:
            pipe.denoise_step([state])
        img = pipe.decode_latents([state])[0]
        tensors, meta = to_parts(state, for_post=True, decoded=img)
        post_state = from_parts(tensors, meta, torch.device("cpu"))
        out = codec_only.finish(post_state, decoded_image(tensors, meta))
        assert out.data == pipe.run([req])[0].data


def test_edit_params_carry_every_request_field() -> None:
    """The wire form of an EditRequest (messages.EditParams) has every field but the images:
    a field added to one and not the other would be lost between processes."""
    request = {f.name for f in dataclasses.fields(EditRequest)} - {"image", "mask"}
    assert {f.name for f in dataclasses.fields(EditParams)} == request
