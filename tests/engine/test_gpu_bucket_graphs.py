"""GPU check of bucketed step graphs (engine/bucket_graphs.py; marked gpu, run on the device with
--gpu): graphs captured while warming replay later compositions of their bucket."""

from __future__ import annotations

import pytest
import torch

from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from tests.conftest import make_image, make_mask, png_bytes
from tests.engine.test_gpu_masked import _run, cuda_pipeline

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    "family, setting",
    [("sdxl-inpaint", "off"), ("sdxl-inpaint", "auto"), ("flux-fill", "off"), ("flux-fill", "kv")],
)
def test_bucket_graphs_replay_any_composition_of_their_bucket(family: str, setting: str) -> None:
    """graph_capture "buckets": graphs captured while warming (one per bucket met) replay
    later compositions of their bucket — A, B (another template and mask of the same size),
    A again, then a staggered pair — without capturing, bit-identical to the warming run and
    within rounding of the eager plain path (with sparse convs, "auto", a bucket computes the
    conv blocks on whole maps where the plain path computes their tiles: the same values up to
    the convolutions' rounding)."""
    from instgenie.engine.graphs import StepGraphs
    from instgenie.worker import warmup
    from tests.engine.test_graphs import _run_staggered

    pipe = cuda_pipeline(family, setting)
    ex = pipe.family.masked
    keys = [pipe.build_template(TemplateSpec(image=png_bytes(make_image(128, 128, seed=s)),
                                             num_inference_steps=6)) for s in (1, 2)]  # fmt: skip
    a, b = (0.125, 0.125, 0.375, 0.375), (0.5, 0.5, 0.75, 0.75)

    def req(uid: str, key: str, box) -> EditRequest:
        return EditRequest(uid=uid, image=None, template_id=key, seed=len(uid), prompt=uid,
                           mask=png_bytes(make_mask(128, 128, box)), num_inference_steps=6,
                           paste_back=False)  # fmt: skip

    def serve() -> list[torch.Tensor]:
        out = [_run(pipe, r).latents for r in
               (req("a", keys[0], a), req("b", keys[1], b), req("a2", keys[0], a))]  # fmt: skip
        return out + _run_staggered(pipe, [req("p", keys[0], a), req("q", keys[1], b)])

    saved = ex.graphs
    try:
        ex.graphs = StepGraphs(ex.device, "off")
        eager = serve()
        graphs = ex.graphs = StepGraphs(ex.device, "all", capture="buckets")
        graphs.warming = True
        warm = serve()
        captured = dict(graphs.counters)
        graphs.warming = False
        served = serve()
        counters = dict(graphs.counters)
        # the warm-up itself: it captures every rung, then serving replays
        graphs = ex.graphs = StepGraphs(ex.device, "all", capture="buckets")
        report = warmup.warm_up(pipe, max_batch=2)
        after_warm_up = dict(graphs.counters)
        again = serve()
        final = dict(graphs.counters)
    finally:
        ex.graphs = saved
    assert captured["capture"] >= 2, captured
    assert counters["capture"] == captured["capture"], "serving captured a graph"
    assert counters["replay"] - captured["replay"] >= 4 * 6, counters
    for e, w, s, g in zip(eager, warm, served, again, strict=True):
        assert torch.equal(w, s) and torch.equal(s, g)
        # sparse convs: the bucket's whole maps against the plain path's tiles (convolutions of
        # other shapes: cuDNN may round them differently)
        tol = 1e-5 if setting != "auto" else 1e-3
        assert float((e - s).abs().max()) <= tol * float(e.abs().max()), (e - s).abs().max()
    assert report is not None and report.graphs >= len(graphs.buckets.entries) > 0
    assert (
        final["capture"] == after_warm_up["capture"] and final["replay"] > after_warm_up["replay"]
    )
