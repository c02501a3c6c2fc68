"""A loop's warm-up before ready (worker/warmup.py): it runs the serving paths (capture, masked
edits alone and batched, in the graph form, whole and cropped VAE decode) on a scratch store,
and leaves no trace a request could see: the loop's cache tiers hold nothing, no composition's
graph is kept, and an edit served after it is bit-identical to one on a model never warmed."""

from __future__ import annotations

import dataclasses
import gc
import uuid
import weakref

import pytest
import torch

from instgenie.cache.budgets import cache_namespace
from instgenie.cache.host_store import HostActivationStore
from instgenie.cache.shm_segment import SHM_DIR, cleanup
from instgenie.cache.store import InMemoryStore
from instgenie.cache.tiered import TieredStore
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.exec_config import ExecConfig
from instgenie.worker import warmup
from tests.conftest import make_image, make_mask, png_bytes


def _edit_after_capture(pipe: EditPipeline) -> tuple[torch.Tensor, str]:
    """A template captured on `pipe` and one masked edit of it: (its latents, its path)."""
    image = png_bytes(make_image(128, 128, seed=4))
    key = pipe.build_template(TemplateSpec(image=image, prompt="a coat", seed=4,
                                           num_inference_steps=3))  # fmt: skip
    state = pipe.preprocess(EditRequest(uid="e", image=None, template_id=key, prompt="a scarf",
                                        mask=png_bytes(make_mask(128, 128, (0.2, 0.2, 0.6, 0.7))),
                                        seed=3, num_inference_steps=3))  # fmt: skip
    while not state.is_done:
        pipe.denoise_step([state])
    return state.latents, state.path.value


def _fresh(family: str, store=None, capture: str = "auto") -> EditPipeline:
    """A pipeline on a model of its own (tiny_pipeline's is shared by the session), running
    the graph form's static buffers without CUDA; its graphs capture compositions while
    serving (`capture` "auto": the warm-up runs each once) or at start ("buckets")."""
    fam = EditPipeline.load(f"{family}:tiny", execution=ExecConfig(graph_capture=capture)).family
    fam.masked.graphs.force_static = True
    return EditPipeline(fam, store=store)


def test_warm_up_runs_the_serving_paths_and_leaves_nothing(family: str, tmp_path) -> None:
    ns = uuid.uuid4().hex[:10]
    tiered = TieredStore(tmp_path, ns, 256 << 20, 0, disk_enabled=False)
    try:
        pipe = _fresh(family, HostActivationStore(tiered, tmp_path))
        fam, graphs = pipe.family, pipe.family.masked.graphs
        prompts = fam.prompts.stats()
        report = warmup.warm_up(pipe, max_batch=8)
        # a capture run, one edit alone, two together: every edit read the scratch cache
        assert report.steps == 3 * warmup.WARMUP_STEPS
        assert report.masked == 1 + len(warmup.MASK_BOXES)
        assert report.decoded == 2 + len(warmup.MASK_BOXES)
        # every edit step took the graph form (a capture run never does: its outputs are written)
        assert graphs.counters["warmup"] == 2 * warmup.WARMUP_STEPS
        assert not graphs._entries, "a warm-up composition (scratch-store buffers) was kept"
        stats = tiered.stats()
        assert stats["entries_dram"] == stats["bytes_dram"] == stats["hits_dram"] == 0, stats
        assert fam.prompts.stats() == prompts  # entries and counters as found
        assert len(fam.cropped.states) == 0 and not fam.cropped.counts
        warmed = _edit_after_capture(pipe)
    finally:
        tiered.close()
        cleanup(ns)
    cold = _edit_after_capture(_fresh(family))
    assert warmed[1] == cold[1] == "masked"
    assert torch.equal(warmed[0], cold[0])


@pytest.mark.parametrize("capture", ["auto", "buckets"])
@pytest.mark.parametrize("fails", [False, True], ids=["ok", "fails"])
def test_warm_up_frees_its_scratch_cache(
    family: str, fails: bool, capture: str, monkeypatch
) -> None:
    """Nothing keeps the warm-up template's cache (on a GPU: device memory) alive once the
    warm-up returns, graph form included — bucket graphs too, which it keeps unbound — also
    when it fails (then it returns None and the worker serves cold): the device tier sizes
    itself from the memory free then. One request per batch (max_batch 1)."""
    refs: list[weakref.ref] = []

    class Recorded(InMemoryStore):
        def open(self, key: str):
            entry = self._ready[key]
            refs.extend(weakref.ref(t) for t in (entry, *entry.stacked.values()))
            return super().open(key)

    def broken_decode(self, batch):
        raise RuntimeError("CUDA out of memory (injected)")

    monkeypatch.setattr(warmup, "InMemoryStore", Recorded)
    if fails:
        monkeypatch.setattr(EditPipeline, "decode_latents", broken_decode)
    pipe = _fresh(family, capture=capture)
    graphs = pipe.family.masked.graphs
    prompts = pipe.family.prompts.stats()
    report = warmup.warm_up(pipe, max_batch=1)
    if fails:
        assert report is None
    elif capture == "auto":
        assert (report.steps, report.masked, report.decoded) == (3 * warmup.WARMUP_STEPS, 2, 3)
    else:  # bucket graphs kept (every rung the tiny mask fits), none bound
        assert report.graphs >= 2, report
        assert graphs.buckets.entries and graphs.buckets._bound is None
    gc.collect()
    assert refs and not [r for r in refs if r() is not None], "the scratch cache outlived it"
    if capture == "auto" or fails:
        assert not graphs._entries
    assert pipe.family.prompts.stats() == prompts


def test_warm_up_fits_the_limits() -> None:
    """A pixel cap below the family's default size and a step cap below WARMUP_STEPS: the
    warm-up runs within them instead of failing on every start."""
    base = EditPipeline.load("sd2-inpaint:tiny")
    granule = base.family.granule
    side = base.family.default_size // 2 // granule * granule
    limits = dataclasses.replace(base.limits, max_image_pixels=side * side + granule, max_steps=2)
    pipe = EditPipeline(base.family, limits)
    assert warmup._size(pipe) == side
    report = warmup.warm_up(pipe, max_batch=2)
    assert report is not None and report.steps == 3 * 2


@pytest.mark.parametrize(
    ("setting", "device", "on"),
    [
        ("auto", "cuda", True),
        ("auto", "cuda:1", True),
        ("auto", "cpu", False),
        ("on", "cpu", True),
        ("off", "cuda", False),
    ],  # fmt: skip
)
def test_warm_up_setting(setting: str, device: str, on: bool) -> None:
    assert warmup.wanted(setting, device) is on


def test_a_warmed_worker_serves_exactly_and_keeps_no_trace(tmp_path, capfd, monkeypatch) -> None:
    """warmup="on" on CPU: the worker starts with an empty step log and no segment in its host
    DRAM tier (the warm-up ran on a scratch store, outside the batcher), and its first edit is
    byte-identical to the in-process pipeline's."""
    from tests.worker.test_worker import _config, _direct, _fields, _worker

    root = str(tmp_path / "cache")
    namespace = cache_namespace(root)
    monkeypatch.setenv("INSTGENIE_LOG_LEVEL", "INFO")  # the loop logs its warm-up's report
    try:
        with _worker(_config(warmup="on", cache_root=root)) as (handle, _):
            logged = capfd.readouterr().err
            assert "warmed up before ready: WarmupReport(steps=12, masked=3, decoded=4" in logged
            assert handle.client.step_log() == []
            assert not list(SHM_DIR.glob(f"igc_{namespace}_*"))
            assert handle.client.stats()["templates_registered"] == 0
            fields = _fields("warm", 3, seed=5, prompt="a felt hat")
            done = handle.client.run_edit(**fields)
            assert done.data == _direct(fields) and done.path == "full"
            assert [
                m.partition(":")[2] for e in handle.client.step_log() for m, _ in e.members
            ] == ["warm"] * 3
    finally:
        cleanup(namespace)
