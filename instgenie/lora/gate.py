"""Bounded asynchronous loading (Katz / SwiftDiffusion's BAL), as a per-step decision.

An edit whose backbone adapters are not on the device yet runs its steps without them, at most
K of them (LoraConfig.lora_async_steps); after K it is held out of the batch until they arrive,
while the batch's other requests go on. K = 0: held from its first step, so it computes exactly
what synchronous loading computes. Pure Python: the loop's batcher asks, the store answers
whether each load finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Use(StrEnum):
    NONE = "none"  # the request names no backbone adapter
    WITH = "with"  # its adapters are loaded: this step applies them
    WITHOUT = "without"  # still loading, under the bound: this step runs without them
    HOLD = "hold"  # still loading, bound reached: not in this step


@dataclass
class LoraUse:
    """One request's adapters: what it asked for, and how its steps ran."""

    #: (lora id, user scale) in request order
    refs: tuple[tuple[str, float], ...]
    #: its text-encoder adapters applied at its prompt encode
    text: tuple = ()
    #: its backbone adapters on the device ((DeviceAdapter, scale), ...); None while loading
    adapters: tuple[tuple[Any, float], ...] | None = None
    #: steps it ran without them (bounded async), and its step indices that did
    steps_without: int = 0
    without_steps: list[int] | None = None
    #: time it was held out of the batch waiting for them, ms
    held_ms: float = 0.0


def decide(use: LoraUse | None, bound: int) -> Use:
    if use is None or not use.refs:
        return Use.NONE
    if use.adapters is not None:
        return Use.WITH if use.adapters else Use.NONE
    return Use.WITHOUT if use.steps_without < bound else Use.HOLD
