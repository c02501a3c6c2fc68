"""Device step windows: a host-tier template's next step, DMA'd into device memory ahead of use.

A CUDA graph reads fixed device addresses and takes a request's step as an index held on the
device (engine/graphs.py). A window gives a host-tier cache (DRAM, or a disk stream's pinned
staging) that form: per block, a (SLOTS, rows, L, C) device tensor whose slot `step % SLOTS`
holds step `step`. The graph reads it exactly as it reads a GPU-resident stack, with the slot as
its index, and the copies are plain host -> device DMA on the copy stream, at full PCIe speed
and outside the graph, one step ahead of the compute stream:

- prepare(s), before step s is enqueued: the compute stream waits until slot s % SLOTS holds
  step s (copied now if it is not there: a request's first step);
- done(s), after step s is enqueued: records its end on the compute stream, then enqueues the
  copy of step s + 1 into the next slot, after the compute stream's end of step s + 1 - SLOTS
  (the slot's previous reader): it overlaps step s's compute, and a disk stream's blocking read
  of step s + 1 happens while the device computes step s;
- close(): the compute stream waits for every copy still in flight, so the memory, freed in the
  compute stream's order, is never handed out while a copy writes it.
Invariants: a request prepares its steps in increasing order, each at most once before its
done(); a slot is overwritten only after the step that read it ended (event). Units: bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from instgenie.cache.loader import CopyEngine
from instgenie.cache.quant import QuantizedRows
from instgenie.cache.store import on_device

#: steps held per window: the one being computed and the one being copied
SLOTS = 2


class StepWindow:
    def __init__(
        self,
        read: Callable[[int, int], torch.Tensor],
        shapes: dict[int, tuple[int, int, int]],
        num_steps: int,
        dtype: torch.dtype,
        device: torch.device,
        engine: CopyEngine,
    ) -> None:
        """read(step, block) -> the block's host rows (rows, L, C) of that step (pinned memory:
        the copies are asynchronous DMA); shapes: block -> (rows, L, C)."""
        self.read, self.num_steps, self.engine = read, num_steps, engine
        self.stacks = {b: torch.empty((SLOTS, *s), dtype=dtype, device=device)
                       for b, s in shapes.items()}  # fmt: skip
        self.nbytes = sum(t.numel() * t.element_size() for t in self.stacks.values())
        self._loaded: list[tuple[int, Any] | None] = [None] * SLOTS  # (step, copy-end event)
        self._freed: list[Any] = [None] * SLOTS  # compute-stream event: the slot's reader ended
        #: host -> device bytes copied (observability)
        self.bytes_copied = 0

    @staticmethod
    def slot(step: int) -> int:
        return step % SLOTS

    def _load(self, step: int) -> None:
        slot = self.slot(step)
        held = self._loaded[slot]
        if held is not None and held[0] == step:
            return
        with self.engine.session():
            if self._freed[slot] is not None:
                self.engine.copy_waits(self._freed[slot])
            pairs = [(stack[slot], self.read(step, b)) for b, stack in self.stacks.items()]
            self.engine.copies(pairs)
            ev = self.engine.event()
            self.engine.record_copy(ev)
        self.bytes_copied += sum(int(src.nbytes) for _, src in pairs)
        self._loaded[slot] = (step, ev)

    def prepare(self, step: int) -> None:
        """Step `step` is about to be enqueued: make the compute stream wait for its rows."""
        self._load(step)
        self.engine.compute_waits(self._loaded[self.slot(step)][1])

    def done(self, step: int) -> None:
        """Step `step` is enqueued: its slot may be refilled once the compute stream passes
        here; the next step's rows start copying."""
        ev = self.engine.event()
        self.engine.record_compute(ev)
        self._freed[self.slot(step)] = ev
        if step + 1 < self.num_steps:
            self._load(step + 1)

    def block(self, step: int, block_id: int) -> torch.Tensor:
        """Step `step`'s rows of a block on the device (after prepare(step))."""
        held = self._loaded[self.slot(step)]
        if held is None or held[0] != step:
            raise RuntimeError(f"step {step} is not in the window (prepare it first)")
        return self.stacks[block_id][self.slot(step)]

    def close(self) -> None:
        for held in self._loaded:
            if held is not None:
                self.engine.compute_waits(held[1])
        self._loaded = [None] * SLOTS
        self.stacks = {}


class WindowedHandle:
    """A host-tier handle (a DRAM entry, a disk stream) over `source` (an object with `layout`,
    `block`, `scales` and `latents` by step: host_template.HostTemplate,
    disk_stream.StreamedTemplate) that can take a StepWindow; edits then read the window."""

    #: a device step window (attach_window): edits read its slots, DMA'd a step ahead
    window: StepWindow | None = None

    def __init__(self, source: Any) -> None:
        self.source, self.layout = source, source.layout

    def host_block(self, step: int, block_id: int) -> torch.Tensor | QuantizedRows:
        """The block's rows of `step` in host memory (fp8 rows with their scales)."""
        y = self.source.block(step, block_id)
        if self.layout.fp8_scales:
            return QuantizedRows(y, self.source.scales(step, block_id))
        return y

    def latents(self, step: int) -> torch.Tensor:
        return self.source.latents(step)

    def block(self, step: int, block_id: int) -> torch.Tensor | QuantizedRows:
        if self.window is not None:
            return self.window.block(step, block_id)
        return self.host_block(step, block_id)

    def window_spec(self) -> tuple[dict[int, tuple[int, int, int]], int, torch.dtype] | None:
        """(block -> (rows, L, C), steps, dtype) for a StepWindow; None for fp8 rows (they are
        dequantised on the way in: the pipelined loader keeps them)."""
        layout = self.layout
        if layout.fp8_scales:
            return None
        shapes = {b: layout.block_shape(b) for b in range(layout.num_blocks)}
        return shapes, layout.num_steps, layout.torch_dtype

    #: whether the executor decided on a window (once, before the handle's first step: a
    #: window attached mid-edit would change what an already captured graph reads)
    window_decided: bool = False

    def attach_window(self, window: StepWindow | None) -> None:
        """The executor's one decision: read through `window`, or (None) never through one."""
        if self.window_decided:
            raise RuntimeError("a handle's window is decided once")
        self.window, self.window_decided = window, True

    def slot(self, step: int) -> int:
        """The index a device-indexed read of block_steps uses for `step`."""
        return step if self.window is None else self.window.slot(step)

    def window_steps(self, block_id: int, device: torch.device) -> torch.Tensor | None:
        """The window's (SLOTS, rows, L, C) stack of a block on `device`, if attached there."""
        if self.window is None:
            return None
        stack = self.window.stacks.get(block_id)
        return stack if stack is not None and on_device(stack, device) else None

    def close_window(self) -> None:
        if self.window is not None:
            self.window.close()  # before the rows it copies from go
            self.window = None
