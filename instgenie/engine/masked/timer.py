"""Per-block latency of a step (the profiler): CUDA events on the compute stream, or the host
clock on CPU."""

from __future__ import annotations

import time

import torch


class BlockTimer:
    """Per-block latency: CUDA events on the compute stream (host clock on CPU), in ms."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: dict[int, list] = {}

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self, block_id: int) -> None:
        self._marks[block_id] = [self._mark(), None]

    def stop(self, block_id: int) -> None:
        self._marks[block_id][1] = self._mark()

    def results_ms(self) -> dict[int, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {b: a.elapsed_time(z) for b, (a, z) in self._marks.items()}
        return {b: 1e3 * (z - a) for b, (a, z) in self._marks.items()}
