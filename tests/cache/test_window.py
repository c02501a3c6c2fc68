"""Device step windows (cache/window.py) on CPU with simulated streams: each step's rows are in
their slot before the compute stream reads them, a slot is refilled only after the step that
read it ended, and the next step's copy is enqueued as soon as a step is (one step ahead)."""

from __future__ import annotations

import pytest
import torch

from instgenie.cache.window import SLOTS, StepWindow
from tests.cache.test_loader import SimEngine

STEPS, SHAPES = 5, {0: (2, 8, 4), 1: (2, 16, 2)}


def _host() -> dict[tuple[int, int], torch.Tensor]:
    return {(s, b): torch.full(shape, float(10 * s + b)) for s in range(STEPS)
            for b, shape in SHAPES.items()}  # fmt: skip


def test_steps_arrive_one_ahead_and_slots_wait_for_their_reader() -> None:
    eng, host = SimEngine(), _host()
    reads = []
    win = StepWindow(lambda s, b: reads.append((s, b)) or host[(s, b)], SHAPES, STEPS,
                     torch.float32, torch.device("cpu"), eng)  # fmt: skip
    assert win.nbytes == SLOTS * sum(torch.Size(s).numel() for s in SHAPES.values()) * 4
    for s in range(STEPS):
        win.prepare(s)
        # the compute stream waits for the copy that brought step s
        copy_ev = win._loaded[win.slot(s)][1]
        assert eng.log[-1] == ("compute_waits", copy_ev)
        for b in SHAPES:
            assert torch.equal(win.block(s, b), host[(s, b)])
        mark = len(eng.log)
        win.done(s)
        if s + 1 < STEPS:
            # step s + 1 is copied right away (before step s + 1 is prepared) ...
            new = eng.log[mark:]
            assert [e[0] for e in new if e[0] == "copy"] == ["copy"] * len(SHAPES)
            if s >= 1:  # ... into the slot step s - 1 read, after that step ended
                freed = [e for e in new if e[0] == "copy_waits"]
                assert freed and freed[0][1] == win._freed[win.slot(s + 1)]
            with pytest.raises(RuntimeError, match="not in the window"):
                win.block(s - 1 if s >= 1 else s + 2, 0)
    # every step read from the host exactly once, in order
    assert reads == [(s, b) for s in range(STEPS) for b in SHAPES]
    assert win.bytes_copied == sum(t.nbytes for t in host.values())


def test_close_waits_for_copies_in_flight() -> None:
    eng, host = SimEngine(), _host()
    win = StepWindow(lambda s, b: host[(s, b)], SHAPES, STEPS, torch.float32,
                     torch.device("cpu"), eng)  # fmt: skip
    win.prepare(0)
    win.done(0)  # step 1 is being copied
    pending = {held[1] for held in win._loaded if held is not None}
    win.close()
    assert pending <= eng.compute_waited and win.stacks == {}
