"""Fault injection for the reliability tests (RELIABILITY.md: "fault hooks set by env variables").

INSTGENIE_FAULTS="pre=P1,post=P2,nan=P3,stall=P4" makes a request whose prompt is exactly P1 fail
with an exception in pre-processing, P2 in post-processing, P3 get NaN latents when it joins the
denoise loop, and P4 freeze the loop (one endless step, heartbeats still going) once it is in the
running batch. "hold=P5" holds the loop (heartbeats still going) while a request with prompt P5
is in the running batch and the file named by INSTGENIE_FAULT_GATE exists: a gate tests open by
deleting the file. "slowenc=P6" holds the loop's encode of a request with prompt P6 the same way
(a long model stage call outside the steps). Unset (production): every hook is one dict lookup
and does nothing.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterable

from instgenie.engine.request import RequestState
from instgenie.env import fault_gate, faults

KINDS = ("pre", "post", "nan", "stall", "hold", "slowenc")


class InjectedFault(RuntimeError):
    """Raised by a fault hook (a test asked for it)."""


@functools.cache
def _faults() -> dict[str, str]:
    table = faults()
    unknown = set(table) - set(KINDS)
    if unknown:
        raise ValueError(f"INSTGENIE_FAULTS: unknown kinds {sorted(unknown)}; known: {KINDS}")
    return table


def _hit(kind: str, prompt: str) -> bool:
    marker = _faults().get(kind)
    return marker is not None and prompt == marker


def check(kind: str, prompt: str) -> None:
    """Raise InjectedFault if `prompt` is the marker of fault `kind` ("pre" or "post")."""
    if _hit(kind, prompt):
        raise InjectedFault(f"injected {kind}-processing fault")


def poison(state: RequestState) -> None:
    """NaN latents for the "nan" marker."""
    if _hit("nan", state.request.prompt):
        state.latents.fill_(float("nan"))


def stall(states: Iterable[RequestState]) -> None:
    """Never return if a running request carries the "stall" marker."""
    if any(_hit("stall", s.request.prompt) for s in states):
        while True:
            time.sleep(3600)


def hold(states: Iterable[RequestState]) -> None:
    """Wait while a running request carries the "hold" marker and the gate file exists."""
    if any(_hit("hold", s.request.prompt) for s in states):
        _wait_gate()


def slow_encode(prompt: str) -> None:
    """Wait while the gate file exists if `prompt` is the "slowenc" marker."""
    if _hit("slowenc", prompt):
        _wait_gate()


def _wait_gate() -> None:
    gate = fault_gate()
    while gate and os.path.exists(gate):
        time.sleep(0.02)
