"""Bounded asynchronous loading in the worker's batcher, bad files failing alone with typed
errors, and the adapter caches' bookkeeping."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from instgenie.errors import (
    LoraBaseMismatch,
    LoraFileError,
    LoraNotFound,
    LoraRankTooLarge,
    LoraUnknownKeys,
)
from instgenie.lora.gate import LoraUse, Use, decide
from instgenie.lora.lru import ByteLru
from instgenie.scheduler.batching import get_policy
from instgenie.scheduler.step import horizon_of
from instgenie.worker.batcher import Batcher
from tests.conftest import tiny_pipeline
from tests.lora.helpers import attach, detach, lora_state, register
from tests.lora.test_lora_engine import _pixels, _request

FAMILY = "sdxl-inpaint"


@pytest.fixture
def gated(tmp_path):
    """A pipeline whose LoRA loads wait for `gate` to open (a slow disk, deterministic)."""
    pipe = tiny_pipeline(FAMILY)
    attach(pipe, tmp_path)
    gate = threading.Event()
    copy = pipe.loras._copy

    def slow_copy(lora_id, part):
        if part == "backbone":  # the text part loads synchronously at the prompt encode
            assert gate.wait(60), "the test never opened the gate"
        return copy(lora_id, part)

    pipe.loras._copy = slow_copy
    yield pipe, tmp_path, gate
    gate.set()
    detach(pipe)


def _serve(pipe, reqs, bound: int, gate, open_after: int):
    """Run `reqs` through a Batcher with async bound `bound`; open the load gate after
    `open_after` steps. Returns ({uid: retired state}, step log)."""
    pipe.lora_async_steps = bound
    b = Batcher(pipe, get_policy("continuous"), max_batch=8)
    for r in reqs:
        b.submit(pipe.preprocess(r))
    done = {}
    while not b.idle:
        if len(b.records) >= open_after:
            gate.set()
        for r in b.iterate():
            assert r.error is None, r.error
            done[r.state.uid] = r.state
    return done, list(b.records)


@pytest.mark.parametrize("bound", [0, 2])
def test_bounded_async_loading(gated, bound: int) -> None:
    pipe, d, gate = gated
    lora_id = register(d, lora_state(pipe, text=False))
    styled = _request(FAMILY, "styled", [(lora_id, 1.0)])
    other = _request(FAMILY, "other", seed=5)
    gate.set()
    sync = _pixels(pipe.run([styled])[0])  # synchronous loading (and now loaded: forget it)
    pipe.loras.forget(lora_id)
    gate.clear()
    done, log = _serve(pipe, [styled, other], bound, gate, open_after=4)
    without = [e.step for e in log if "styled" in e.lora_without]
    held = [e.step for e in log if "styled" in e.lora_held]
    assert without == list(range(bound))  # its first `bound` steps ran without the LoRA
    assert held and held[0] == bound  # then it waited (the other request went on)
    assert all("other" in [u for u, _ in e.members] for e in log[: len(held) + bound])
    state = done["styled"]
    assert state.notes.lora_steps_without == bound and state.notes.lora_held_ms > 0
    got = _pixels(pipe.postprocess([state])[0])
    if bound == 0:
        assert np.array_equal(got, sync)  # K = 0 is synchronous loading exactly
    else:
        assert np.abs(got - sync).max() > 0  # it did run steps without the LoRA


def test_steps_without_a_loading_lora_plan_only_until_the_bound(gated) -> None:
    """A composition with a member running without its loading LoRA lasts at most until that
    member's bound: the step plan's horizon says so (CUDA graphs are captured only where a
    capture pays over that horizon), whatever the members' remaining steps."""
    pipe, d, gate = gated
    lora_id = register(d, lora_state(pipe, text=False))
    pipe.lora_async_steps = 2
    b = Batcher(pipe, get_policy("continuous"), max_batch=8)
    plans = []
    plan = b.plan
    b.plan = lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1]
    b.submit(pipe.preprocess(_request(FAMILY, "styled", [(lora_id, 1.0)])))
    b.submit(pipe.preprocess(_request(FAMILY, "other", seed=5)))
    b.iterate()
    b.iterate()
    gate.set()
    while not b.idle:
        b.iterate()
    assert [e.lora_without for e in list(b.records)[:2]] == [["styled"], ["styled"]]
    assert [p.horizon for p in plans[:2]] == [2, 1]
    assert all(horizon_of(p.members) > 2 for p in plans[:2])  # the members had more steps
    assert all(p.horizon == horizon_of(p.members) for p in plans[2:])


def test_bad_lora_fails_alone(tmp_path) -> None:
    """A registered file that turns out unreadable fails its request with the typed error; the
    batch's other request completes."""
    pipe = tiny_pipeline(FAMILY)
    attach(pipe, tmp_path)
    try:
        good = register(tmp_path, lora_state(pipe, text=False))
        bad = "ab" * 32
        (tmp_path / f"{bad}.safetensors").write_bytes(b"\x00garbage" * 10)
        b = Batcher(pipe, get_policy("continuous"), max_batch=8)
        b.submit(pipe.preprocess(_request(FAMILY, "good", [(good, 1.0)])))
        # a request naming the bad file: text part absent, so it is found at the backbone load
        state = pipe.preprocess(_request(FAMILY, "ok", seed=3))
        state.lora = LoraUse(((bad, 1.0),))
        b.submit(state)
        out = {}
        while not b.idle:
            for r in b.iterate():
                out[r.state.uid] = r.error
        assert out["good"] is None
        assert out["ok"][0] == "lora_invalid_file"
    finally:
        detach(pipe)


def test_typed_errors(tmp_path) -> None:
    pipe = tiny_pipeline(FAMILY)
    attach(pipe, tmp_path, lora_max_rank=8)
    store = pipe.loras
    try:
        state = lora_state(pipe, text=False)
        cases = {}
        cases[LoraFileError] = b"not a safetensors file"
        half = {k: v for k, v in state.items() if "lora_A" in k}
        wrong = dict(state)
        k = next(k for k in wrong if k.endswith("lora_B.weight"))
        wrong[k] = wrong[k][:-1]  # out_features one short: another base model
        unknown = dict(state)
        unknown["unet.no_such_block.to_q.lora_A.weight"] = next(iter(state.values())).clone()
        unknown["unet.no_such_block.to_q.lora_B.weight"] = next(iter(state.values())).T.contiguous()
        big = lora_state(pipe, text=False, rank=16)
        for err, st in ((LoraFileError, half), (LoraBaseMismatch, wrong),
                        (LoraUnknownKeys, unknown), (LoraRankTooLarge, big)):  # fmt: skip
            cases[err] = st
        for err, content in cases.items():
            if isinstance(content, bytes):
                lora_id = "cd" * 32
                (tmp_path / f"{lora_id}.safetensors").write_bytes(content)
            else:
                lora_id = register(tmp_path, content)
            with pytest.raises(err):
                store.weights(lora_id, "backbone")
            assert (lora_id, "backbone") not in store.host  # nothing kept half-way
        # non-finite weights are refused; finite ones whose float32 sum overflows are not
        ka, kb = (next(k for k in state if k.endswith(f"lora_{h}.weight")) for h in "AB")
        for key, value, refused in ((kb, float("inf"), True), (ka, float("nan"), True),
                                    (ka, 3e38, False)):  # fmt: skip
            st = dict(state)
            st[key] = st[key].clone()
            st[key][0, :2] = value
            lora_id = register(tmp_path, st)
            if refused:
                with pytest.raises(LoraFileError, match="non-finite"):
                    store.weights(lora_id, "backbone")
            else:
                assert store.weights(lora_id, "backbone").layers
        with pytest.raises(LoraNotFound):
            pipe.validate(_request(FAMILY, "x", [("ef" * 32, 1.0)]))
    finally:
        detach(pipe)


def test_gate_decisions() -> None:
    assert decide(None, 3) is Use.NONE
    use = LoraUse((("a" * 64, 1.0),))
    assert decide(use, 0) is Use.HOLD
    assert decide(use, 2) is Use.WITHOUT
    use.steps_without = 2
    assert decide(use, 2) is Use.HOLD
    use.adapters = ((object(), 1.0),)
    assert decide(use, 2) is Use.WITH
    use.adapters = ()  # names only text-encoder LoRAs
    assert decide(use, 2) is Use.NONE


def test_byte_lru_keeps_pinned_entries() -> None:
    lru = ByteLru(100)
    assert lru.put("a", 1, 60) == []
    lru.pin("a")
    assert lru.put("b", 2, 60) == []  # over budget, but "a" is pinned and "b" is newest
    assert lru.used == 120
    assert lru.put("c", 3, 30) == ["b"]  # LRU order, pinned skipped
    assert lru.unpin("a") == []  # within budget: kept
    assert lru.put("d", 4, 50) == ["a"]  # the least recently used, now unpinned
    assert lru.keys() == ["c", "d"] and lru.used == 80
    with pytest.raises(RuntimeError):
        lru.unpin("c")
