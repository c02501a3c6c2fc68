"""A loop's warm-up before ready (worker/warmup.py): it runs the serving paths (capture, masked
edits alone and batched, in the graph form, whole and cropped VAE decode) on a scratch store,
and leaves no trace a request could see: the loop's cache tiers hold nothing, no composition's
graph is kept, and an edit served after it is bit-identical to one on a model never warmed."""

from __future__ import annotations

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
from instgenie.worker import warmup
from tests.conftest import make_image, make_mask, png_bytes, tiny_pipeline


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


def test_warm_up_runs_the_serving_paths_and_leaves_nothing(family: str, tmp_path) -> None:
    ns = uuid.uuid4().hex[:10]
    tiered = TieredStore(tmp_path, ns, 256 << 20, 0, disk_enabled=False)
    try:
        store = HostActivationStore(tiered, tmp_path)
        pipe = EditPipeline(tiny_pipeline(family).family, store=store)
        graphs = pipe.family.masked.graphs
        graphs.force_static = True  # the graph form's static buffers without CUDA
        report = warmup.warm_up(pipe, max_batch=8)
        # a capture run, one edit alone, two together: every edit read the scratch cache
        assert report.steps == 3 * warmup.WARMUP_STEPS
        assert report.masked == 1 + len(warmup.MASK_BOXES)
        assert report.decoded == 2 + len(warmup.MASK_BOXES)  # the capture's whole, edits cropped
        # every edit step took the graph form (a capture run never does: its outputs are written)
        assert graphs.counters["warmup"] == 2 * warmup.WARMUP_STEPS
        assert not graphs._entries, "a warm-up composition (scratch-store buffers) was kept"
        stats = tiered.stats()
        assert stats["entries_dram"] == stats["bytes_dram"] == stats["hits_dram"] == 0, stats
        warmed = _edit_after_capture(pipe)
    finally:
        tiered.close()
        cleanup(ns)
    cold = _edit_after_capture(tiny_pipeline(family))
    assert warmed[1] == cold[1] == "masked"
    assert torch.equal(warmed[0], cold[0])


def test_warm_up_with_one_request_per_batch_frees_its_scratch_cache(
    family: str, monkeypatch
) -> None:
    """Nothing keeps the warm-up template's cache (on a GPU: device memory) alive once the
    warm-up returns, graph form included: the device tier sizes itself from the memory free
    then."""
    refs: list[weakref.ref] = []

    class Recorded(InMemoryStore):
        def open(self, key: str):
            entry = self._ready[key]
            refs.extend(weakref.ref(t) for t in (entry, *entry.stacked.values()))
            return super().open(key)

    monkeypatch.setattr(warmup, "InMemoryStore", Recorded)
    pipe = tiny_pipeline(family)
    pipe.family.masked.graphs.force_static = True
    report = warmup.warm_up(pipe, max_batch=1)
    assert (report.steps, report.masked, report.decoded) == (3 * warmup.WARMUP_STEPS, 2, 3)
    gc.collect()
    assert refs and not [r for r in refs if r() is not None], "the scratch cache outlived it"


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
