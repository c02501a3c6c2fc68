"""The denoise loop's state machine on CPU: joins within one step, static batching, aborts,
isolation of a poisoned request, batch keys."""

from __future__ import annotations

import functools

import pytest
import torch

from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.scheduler.batching import get_policy
from instgenie.worker.batcher import Batcher
from tests.conftest import make_image, make_mask, png_bytes, tiny_pipeline


def _state(pipe: EditPipeline, uid: str, steps: int = 4, size: int = 128, seed: int = 0):
    req = EditRequest(uid=uid, image=png_bytes(make_image(size, size, seed=seed)),
                      mask=png_bytes(make_mask(size, size)), prompt=f"p {uid}", seed=seed,
                      num_inference_steps=steps)  # fmt: skip
    return pipe.preprocess(req)


@functools.cache
def _pipe() -> EditPipeline:
    return tiny_pipeline("sd2-inpaint")


def test_continuous_joins_at_the_next_step() -> None:
    pipe = _pipe()
    b = Batcher(pipe, get_policy("continuous"), max_batch=4)
    b.submit(_state(pipe, "a", steps=5))
    b.iterate()
    b.iterate()
    b.submit(_state(pipe, "b", steps=3))  # arrives while a is mid-run
    b.iterate()
    rec = b.records[-1]
    assert rec.joined == ["b"] and rec.members == [("a", 2), ("b", 0)]
    done = []
    while not b.idle:
        done += [r.state.uid for r in b.iterate() if r.error is None]
    assert sorted(done) == ["a", "b"]


def test_static_waits_for_the_batch_to_finish() -> None:
    pipe = _pipe()
    b = Batcher(pipe, get_policy("static"), max_batch=4)
    b.submit(_state(pipe, "a", steps=3))
    b.iterate()
    b.submit(_state(pipe, "b", steps=2))
    steps_before_b = []
    while not any(r.joined == ["b"] for r in b.records):
        b.iterate()
        steps_before_b.append(b.records[-1].members)
    # b joined only once a had left: a ran all 3 steps alone
    assert [m for m in steps_before_b if ("a", 2) in m][0] == [("a", 2)]
    assert b.records[-1].members == [("b", 0)]


def test_abort_frees_the_slot_at_the_next_step() -> None:
    pipe = _pipe()
    b = Batcher(pipe, get_policy("continuous"), max_batch=2)
    for uid in ("a", "b"):
        b.submit(_state(pipe, uid, steps=6))
    b.submit(_state(pipe, "c", steps=2))  # waits: the batch is full
    b.iterate()
    assert [u for u, _ in b.records[-1].members] == ["a", "b"]
    b.abort("a")
    retired = b.iterate()
    assert [(r.state.uid, r.error[0]) for r in retired] == [("a", "cancelled")]
    assert [u for u, _ in b.records[-1].members] == ["b", "c"]  # c took a's slot


def test_poisoned_request_fails_alone() -> None:
    pipe = _pipe()
    b = Batcher(pipe, get_policy("continuous"), max_batch=3)
    states = [_state(pipe, uid, steps=2, seed=i) for i, uid in enumerate("xyz")]
    states[1].latents = states[1].latents.clone()
    states[1].latents[0, 0, 0, 0] = float("nan")  # poison one member of the batch
    for s in states:
        b.submit(s)
    retired = []
    while not b.idle:
        retired += b.iterate()
    result = {r.state.uid: r.error for r in retired}
    assert result["x"] is None and result["z"] is None
    assert result["y"][0] == "internal_error" and "non-finite" in result["y"][1]
    assert torch.isfinite(states[0].latents).all()


def test_batch_holds_one_resolution() -> None:
    pipe = _pipe()
    b = Batcher(pipe, get_policy("continuous"), max_batch=4)
    b.submit(_state(pipe, "big", steps=2, size=128))
    b.submit(_state(pipe, "small", steps=2, size=64))
    b.iterate()
    assert [u for u, _ in b.records[-1].members] == ["big"]
    b.iterate()
    b.iterate()
    assert [u for u, _ in b.records[-1].members] == ["small"]


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown batching policy"):
        get_policy("eager")


def test_a_request_of_another_resolution_is_not_starved() -> None:
    """A steady stream of 128² requests keeps the batch busy; a 64² request queued among them
    runs once the batch holding the earlier ones drains (before: the later 128² requests kept
    joining ahead of it, for as long as they kept coming)."""
    pipe = _pipe()
    b = Batcher(pipe, get_policy("continuous"), max_batch=2)
    b.submit(_state(pipe, "a0", steps=2))
    b.iterate()
    b.submit(_state(pipe, "small", steps=2, size=64))
    ran_small_at = None
    for i in range(1, 12):
        b.submit(_state(pipe, f"a{i}", steps=2))  # one more 128² request every step
        b.iterate()
        members = [u for u, _ in b.records[-1].members]
        if "small" in members:
            ran_small_at = len(b.records)
            assert members == ["small"]
            break
    assert ran_small_at is not None and ran_small_at <= 4, ran_small_at


def _spy_plans(pipe, monkeypatch: pytest.MonkeyPatch) -> list:
    """The StepPlans the pipeline is given (each step still runs)."""
    plans = []
    step = pipe.denoise_step

    def spy(batch, plan=None):
        plans.append(plan)
        step(batch, plan)

    monkeypatch.setattr(pipe, "denoise_step", spy)
    return plans


def test_horizon_is_the_steps_until_a_member_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request waiting for a place does not shorten it (it joins only when one leaves)."""
    pipe = tiny_pipeline("sd2-inpaint")
    plans = _spy_plans(pipe, monkeypatch)
    b = Batcher(pipe, get_policy("continuous"), max_batch=2)
    for uid, steps in (("a", 4), ("x", 2), ("c", 3)):  # c waits: the batch holds two
        b.submit(_state(pipe, uid, steps=steps))
    while not b.idle:
        b.iterate()
    # a + x until x leaves; a + c until a leaves; c's last step alone
    assert [p.horizon for p in plans] == [2, 1, 2, 1, 1]
    assert [p.joined for p in plans] == [("a", "x"), (), ("c",), (), ()]
    assert [p.leaving for p in plans] == [(), ("x",), (), ("a",), ("c",)]
    assert [[(m.uid, m.step) for m in p.members] for p in plans] == [
        [("a", 0), ("x", 0)], [("a", 1), ("x", 1)], [("a", 2), ("c", 0)], [("a", 3), ("c", 1)],
        [("c", 2)],
    ]  # fmt: skip
    assert [r.joined for r in b.records][2] == ["c"]
    # the step log is the plan's record
    assert [r.members for r in b.records] == [[(m.uid, m.step) for m in p.members] for p in plans]


def test_batcher_passes_the_horizon_and_logs_how_steps_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipe = tiny_pipeline("sd2-inpaint")
    graphs = pipe.family.masked.graphs
    plans = _spy_plans(pipe, monkeypatch)
    b = Batcher(pipe, get_policy("continuous"), max_batch=4)
    b.submit(_state(pipe, "a", steps=4))
    b.iterate()
    b.submit(_state(pipe, "b", steps=2))
    b.submit(_state(pipe, "c", steps=2))
    while not b.idle:
        b.iterate()
    # a alone (4 left); a + b + c until b and c leave (2 steps); a's last step alone
    assert [p.horizon for p in plans] == [4, 2, 1, 1]
    assert [r.graph for r in b.records] == ["eager"] * 4  # CPU: no graphs
    monkeypatch.setattr(graphs, "force_static", True)  # the graph form on CPU: warm-ups
    # compositions captured while serving (the "buckets" default captures only at start)
    monkeypatch.setattr(graphs, "capture", "auto")
    b.submit(_state(pipe, "d", steps=2))
    while not b.idle:
        b.iterate()
    assert [r.graph for r in b.records][-2:] == ["warmup"] * 2
