"""Workers of one host sharing a cache root (worker.cache_root) and capturing the same template
at once: one capture records it, the other loop waits for it; neither build fails, and edits
batched with the losing capture are unaffected. Real loops, pipelines and host store (CPU)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from pathlib import Path

import pytest
import torch

from instgenie.config import Config, WorkerConfig
from instgenie.engine.family import load_family
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.messages import EditFailed, Finished, TemplateReady
from instgenie.tensorshm import process_prefix, release
from instgenie.worker.child_runtime import make_store
from instgenie.worker.loop import Loop
from instgenie.worker.names import capture_uid
from tests.conftest import make_image, make_mask, png_bytes


class _Runtime:
    """What a Loop uses of its ChildRuntime: the config, an empty inbox, an outbox, activity
    marks."""

    def __init__(self, cfg: Config) -> None:
        self.wcfg, self.sent = cfg.worker, []
        self.shm_prefix = process_prefix("igtsc")  # Finished packs its image here

    def recv(self, timeout_ms: int | None):  # noqa: ANN201 - no messages in these tests
        return None

    def doing(self, what: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def send(self, msg) -> None:  # noqa: ANN001
        self.sent.append(msg)
        if isinstance(msg, Finished):
            release(msg.latents)  # post-processing would


@pytest.fixture
def loops(tmp_path: Path):
    cfg = Config(worker=WorkerConfig(cache_root=str(tmp_path), cache_dram_bytes=256 << 20,
                                     cache_disk_bytes=0))  # fmt: skip
    out = []
    for _ in range(2):
        pipe = EditPipeline(load_family("sd2-inpaint:tiny"), cfg.limits, make_store(cfg))
        out.append(Loop(_Runtime(cfg), pipe, None))
    yield out
    ns = hashlib.sha256(str(tmp_path.resolve()).encode()).hexdigest()[:12]
    for seg in Path("/dev/shm").glob(f"igc_{ns}_*"):
        seg.unlink()


def _capture(loop: Loop, tid: str, seed: int):  # noqa: ANN202
    spec = TemplateSpec(image=png_bytes(make_image(64, 64, seed=seed)), prompt="t",
                        num_inference_steps=2)  # fmt: skip
    key = loop.pipe.register_template(spec)  # the pre process's part
    state = loop.pipe.prepare_capture(key)
    state.uid = capture_uid(tid)
    state.notes = dataclasses.replace(state.notes, template_id=tid)
    return key, state


def _edit(loop: Loop, uid: str):  # noqa: ANN202
    image, mask = png_bytes(make_image(64, 64, seed=9)), png_bytes(make_mask(64, 64))
    req = EditRequest(uid=uid, image=image, mask=mask, prompt="t", num_inference_steps=2)
    return loop.pipe.preprocess(req)


def _run(loops: list[Loop]) -> None:
    """Step the loops side by side until every one is idle and waits for nothing."""
    for _ in range(100):
        for loop in loops:
            loop.poll_awaiting(force=True)
            if not loop.batcher.idle:
                loop.retire(loop.batcher.iterate())
        if all(lp.batcher.idle and not lp.awaiting for lp in loops):
            return
    raise AssertionError("the loops never settled")


def _answers(loop: Loop) -> list:
    return [m for m in loop.rt.sent if isinstance(m, (TemplateReady, EditFailed, Finished))]


def test_a_capture_already_running_elsewhere_is_waited_for(loops: list[Loop]) -> None:
    tid = "ab" * 32
    (k0, s0), (k1, s1) = _capture(loops[0], tid, 1), _capture(loops[1], tid, 1)
    assert k0 == k1
    loops[0].admit(s0)
    loops[0].retire(loops[0].batcher.iterate())  # step 0: the entry is reserved ("building")
    loops[1].admit(s1)  # before: answered TemplateReady(ok=False, "building") at once
    assert loops[1].batcher.idle and k1 in loops[1].awaiting
    _run(loops)
    for loop in loops:
        (ready,) = _answers(loop)
        assert isinstance(ready, TemplateReady) and ready.ok, ready
    assert loops[0].pipe.store.status(k0) == "ready"


def test_two_captures_started_together_record_once_and_fail_nothing(loops: list[Loop]) -> None:
    """Both loops attach a writer before either reserves the entry (end of step 0): the second
    to reserve loses. Before, its step raised and failed its whole batch, here an unrelated
    edit too."""
    tid = "cd" * 32
    (_, s0), (k1, s1) = _capture(loops[0], tid, 2), _capture(loops[1], tid, 2)
    loops[0].admit(s0)
    loops[1].admit(s1)
    loops[1].admit(_edit(loops[1], "7:edit"))
    assert not loops[1].awaiting  # both captures run
    _run(loops)
    (ready0,) = _answers(loops[0])
    assert isinstance(ready0, TemplateReady) and ready0.ok, ready0
    got = {type(m).__name__: m for m in _answers(loops[1])}
    assert set(got) == {"TemplateReady", "Finished"}, got
    assert got["TemplateReady"].ok and got["Finished"].uid == "7:edit"
    assert loops[1].pipe.store.status(k1) == "ready"


def test_a_capture_whose_latents_go_non_finite_is_not_stored(loops: list[Loop]) -> None:
    """Its build fails, and nothing is left "ready" that a re-registration would accept and
    every edit would read NaN rows from."""
    key, state = _capture(loops[0], "ef" * 32, 3)
    with torch.inference_mode():
        state.latents.fill_(float("nan"))  # what an fp16 overflow does (faults.poison)
    loops[0].admit(state)
    _run(loops[:1])
    (ready,) = _answers(loops[0])
    assert isinstance(ready, TemplateReady) and not ready.ok and "non-finite" in ready.message
    assert loops[0].pipe.store.status(key) == "absent"
