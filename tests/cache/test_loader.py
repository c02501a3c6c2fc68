"""Pipelined block loading (CPU, simulated streams): ordering invariants, and exact replay when
every cached row arrives through the staging ring."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from instgenie.cache.loader import BlockLoad, PipelinedLoader
from instgenie.cache.quant import copy_rows
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from tests.conftest import make_image, make_mask, planned_step, png_bytes


class SimEngine:
    """Streams as logs. Copies execute at once, but every ordering rule of the CUDA version is
    checked: a copy into a ring buffer happens only after the copy stream waited for the end of
    the block that consumes the buffer's previous contents; a block's buffer is used only after
    its load's event was recorded."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.waited: set[int] = set()  # ids of events the copy stream waited for
        self.recorded: set[int] = set()
        self.compute_waited: set[int] = set()
        self._n = 0

    def event(self) -> int:
        self._n += 1
        return self._n

    def record_compute(self, ev: int) -> None:
        self.recorded.add(ev)
        self.log.append(("record_compute", ev))

    def record_copy(self, ev: int) -> None:
        self.recorded.add(ev)
        self.log.append(("record_copy", ev))

    def copy_waits(self, ev: int) -> None:
        assert ev in self.recorded, "copy stream waits on an event never recorded"
        self.waited.add(ev)
        self.log.append(("copy_waits", ev))

    def compute_waits(self, ev: int) -> None:
        assert ev in self.recorded
        self.compute_waited.add(ev)
        self.log.append(("compute_waits", ev))

    def copy(self, dst: torch.Tensor, src) -> None:
        copy_rows(dst, src, non_blocking=False)
        self.log.append(("copy", dst.data_ptr(), src.shape.numel()))

    def copies(self, pairs) -> None:
        for dst, src in pairs:
            self.copy(dst, src)

    def session(self):
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        self.log.append(("sync",))


def _loads(num: int, rows: int = 2, L: int = 8, C: int = 4) -> list[BlockLoad]:
    return [
        BlockLoad(b, (rows, L, C), [(0, torch.full((rows, L, C), float(b + 1)))])
        for b in range(num)
    ]


@pytest.mark.parametrize("num_buffers", [2, 3, 5])
def test_ring_reuse_waits_for_consumers(num_buffers: int) -> None:
    eng = SimEngine()
    loader = PipelinedLoader(eng, torch.device("cpu"), torch.float32, num_buffers=num_buffers)
    loads = _loads(7)
    order = list(range(7))
    loader.start_step(loads, order)
    # only the first `num_buffers` loads can be in flight before any block finished
    assert sum(1 for e in eng.log if e[0] == "copy") == num_buffers
    for b in order:
        buf = loader.take(b)
        assert torch.equal(buf, torch.full_like(buf, float(b + 1)))  # its own rows, intact
        buf.add_(100)  # the block writes its fresh rows into the staging buffer
        loader.block_done(b)
    assert loader.bytes_loaded == sum(ld.nbytes for ld in loads)
    # every reuse of a buffer waited for the end of the block that read its previous contents
    copies = [i for i, e in enumerate(eng.log) if e[0] == "copy"]
    assert len(copies) == 7
    assert len([e for e in eng.log if e[0] == "copy_waits"]) == 1 + (7 - num_buffers)


def test_staging_budget_enqueues_every_load_at_once() -> None:
    eng = SimEngine()
    loads = _loads(6)
    one = loads[0].shape[0] * loads[0].shape[1] * loads[0].shape[2] * 4
    loader = PipelinedLoader(eng, torch.device("cpu"), torch.float32, num_buffers=2,
                             max_staging_bytes=6 * one)  # fmt: skip
    loader.start_step(loads, list(range(6)))
    assert sum(1 for e in eng.log if e[0] == "copy") == 6
    for b in range(6):
        assert torch.equal(loader.take(b), torch.full((2, 8, 4), float(b + 1)))
        loader.block_done(b)
    # no buffer was reused, so the copy stream only waited for the previous step's end
    assert [e for e in eng.log if e[0] == "copy_waits"] == [("copy_waits", 1)]
    # a budget for 4 buffers: the first 4 loads at once, the rest as blocks finish
    eng2 = SimEngine()
    loader2 = PipelinedLoader(eng2, torch.device("cpu"), torch.float32, num_buffers=2,
                              max_staging_bytes=4 * one)  # fmt: skip
    loader2.start_step(_loads(6), list(range(6)))
    assert sum(1 for e in eng2.log if e[0] == "copy") == 4


def test_skipped_blocks_and_partial_rows() -> None:
    """Blocks that compute all tokens are not loaded; a request's rows land at its offset."""
    eng = SimEngine()
    loader = PipelinedLoader(eng, torch.device("cpu"), torch.float32, num_buffers=2)
    src = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    loads = [BlockLoad(b, (5, 3, 4), [(3, src)]) for b in (1, 4, 5)]
    loader.start_step(loads, [0, 1, 2, 3, 4, 5])
    for b in range(6):
        if b in (1, 4, 5):
            buf = loader.take(b)
            assert torch.equal(buf[3:5], src)
        loader.block_done(b)
    with pytest.raises(KeyError):
        loader.take(2)


@functools.cache
def _pipe() -> EditPipeline:
    return EditPipeline.load("sdxl-inpaint:tiny", dtype="fp64")


@pytest.mark.parametrize("num_buffers", [2, 3])
def test_replay_exact_through_the_staging_ring(num_buffers: int) -> None:
    pipe = _pipe()
    ex = pipe.family.masked
    img, mask = png_bytes(make_image(128, 128, seed=3)), png_bytes(make_mask(128, 128))
    common = dict(prompt="a wool hat", seed=2, num_inference_steps=3)
    key = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
    full = pipe.preprocess(EditRequest(uid="f", image=img, mask=mask, **common))
    while not full.is_done:
        pipe.denoise_step([full])
    eng = SimEngine()
    ex.loading, ex.copy_engine, ex.loader = "pipelined", eng, None
    ex.staging_buffers = num_buffers
    ex.max_staging_bytes = 0  # exercise the ring's reuse, not one buffer per block
    try:
        s = pipe.preprocess(EditRequest(uid="m", image=None, template_id=key, mask=mask, **common))
        while not s.is_done:
            planned_step(pipe, [s], compute_all=frozenset({0, 5, 6}))
        loaded = ex.loader.bytes_loaded
        assert ex.loader.num_buffers == num_buffers
    finally:
        ex.loading, ex.copy_engine, ex.loader = "auto", None, None
        ex.staging_buffers, ex.max_staging_bytes = 3, 2 << 30
    tol = 1e-9 * float(full.latents.abs().max())
    assert float((s.latents - full.latents).abs().max()) <= tol
    meta = pipe.store.meta(key)
    per_step = sum(
        meta.num_rows * L * C * 8 for b, (L, C) in meta.block_shapes.items() if b not in {0, 5, 6}
    )
    assert loaded == per_step  # last step's bytes: every cache-using block, whole rows, fp64


@pytest.mark.parametrize("family", ["sd2-inpaint", "sdxl-inpaint", "flux-fill"])
def test_block_ids_follow_execution_order(family: str) -> None:
    """The loader frees block i's buffer after block i + 1: ids must be execution order."""
    from tests.conftest import tiny_pipeline

    pipe = tiny_pipeline(family)
    fam = pipe.family
    seen: list[int] = []
    handles = [
        fam.backbone.get_submodule(b.name).register_forward_pre_hook(
            lambda *_, i=b.block_id: seen.append(i)
        )
        for b in fam.masked.blocks
    ]
    try:
        req = EditRequest(uid="o", image=png_bytes(make_image()), mask=png_bytes(make_mask()),
                          prompt="a", num_inference_steps=1)  # fmt: skip
        pipe.denoise_step([pipe.preprocess(req)])
    finally:
        for h in handles:
            h.remove()
    assert seen == list(range(fam.masked.num_blocks))


def test_per_batch_reuse_never_crosses_requests() -> None:
    """Token sets are reused across the steps of one batch only: a new request with the same
    uid and template but another mask must get its own."""
    pipe = _pipe()
    img = png_bytes(make_image(128, 128, seed=3))
    key = pipe.build_template(TemplateSpec(image=img, num_inference_steps=2))
    counts = []
    for box in ((0.1, 0.1, 0.3, 0.3), (0.1, 0.1, 0.9, 0.9)):
        s = pipe.preprocess(EditRequest(uid="same", image=None, template_id=key, prompt="p",
                                        mask=png_bytes(make_mask(128, 128, box)),
                                        num_inference_steps=2))  # fmt: skip
        pipe.denoise_step([s])
        ts = pipe.family.masked.last_context._tokens
        counts.append(sum(t.total for t in ts.values()))
        pipe.release(s)
    assert counts[0] < counts[1]
