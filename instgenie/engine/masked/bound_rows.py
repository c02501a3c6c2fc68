"""Where a bucketed graph's cached rows come from (engine/bucket_graphs.py, decision 0051).

A graph captured at start serves every composition of its bucket, so it cannot hold the
addresses of one composition's cache stacks. It reads them from device tables instead: for each
hooked block b and batch row r, `base[b, r]` is the address of the row's slice at step 0 of the
store's (steps, rows, L, C) stack of b (0: the row computes every token), `stride[b, r]` the
elements between steps, and `steps[r]` the step (or window slot) the row reads. A composition
change rebinds the tables (host-built, one copy each); a step writes `steps` (one fill per
request); the graph's copy kernel (triton_kernels/step_copy.copy_rows_indirect) does the rest.

Invariant: every address in the tables names memory this object keeps alive (`_sources`), so a
replay never reads freed memory; `release` zeroes the tables before it lets the sources go.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from instgenie.cache.store import on_device
from instgenie.engine.kernels import optional_kernel

if TYPE_CHECKING:
    from instgenie.engine.masked.context import StepContext


class BoundRows:
    def __init__(self, num_blocks: int, rows: int, device: torch.device, kernel: bool) -> None:
        """`num_blocks`: table rows (block ids are < num_blocks); `kernel`: copy by the Triton
        kernel (required under CUDA-graph capture: the torch reference reads the tensors it
        was given, so a graph would bake them in), else by the reference (CPU graph form)."""
        self.device = device
        self.rows = rows
        self.base = torch.zeros((num_blocks, rows), dtype=torch.int64, device=device)
        self.stride = torch.zeros_like(self.base)
        self.steps = torch.zeros(rows, dtype=torch.int64, device=device)
        self._kernel = optional_kernel("step_copy", "copy_rows_indirect") if kernel else None
        if kernel and self._kernel is None:
            raise RuntimeError("the indirect row-copy kernel is unavailable (Triton)")
        #: block id -> each row's (steps, L, C) source or None; kept alive while bound
        self._sources: dict[int, list[torch.Tensor | None]] = {}
        #: what is bound (the composition's key), None when released
        self.key: Any = None

    def bind(self, ctx: StepContext, blocks: list[int], key: Any) -> bool:
        """Name the sources of `ctx`'s cache-reading rows for every block in `blocks`; False
        (nothing bound) when one is not readable in place, or its step slice is not one
        contiguous run of the block's (L, C) rows (what the kernel copies)."""
        if ctx.num_rows != self.rows:
            raise ValueError(f"{ctx.num_rows} rows bound to tables of {self.rows}")
        base = torch.zeros(self.base.shape, dtype=torch.int64)
        stride = torch.zeros_like(base)
        sources: dict[int, list[torch.Tensor | None]] = {}
        for b in blocks:
            row_src: list[torch.Tensor | None] = [None] * self.rows
            for req in ctx.requests:
                if req.handle is None:
                    continue
                stack = req.handle.block_steps(b, self.device)  # (S, rows, L, C)
                if (stack is None or not on_device(stack, self.device)  # "cuda" names cuda:0
                        or not stack[0].is_contiguous()):  # fmt: skip
                    return False
                first = stack.shape[1] - req.num_rows  # a CFG template serves its cond row
                for j in range(req.num_rows):
                    src = stack[:, first + j]
                    row = req.start + j
                    row_src[row] = src
                    base[b, row] = src.data_ptr()
                    stride[b, row] = src.stride(0)
            sources[b] = row_src
        # stream-ordered after every replay already queued; from pinned memory on CUDA, so the
        # host does not wait for those replays to stage a pageable copy
        self.base.copy_(_host(base, self.device), non_blocking=True)
        self.stride.copy_(_host(stride, self.device), non_blocking=True)
        self._sources, self.key = sources, key
        return True

    def write_steps(self, ctx: StepContext) -> None:
        """Each cache-reading row's step (a host window's slot) into `steps`."""
        for req in ctx.requests:
            if req.handle is not None:
                slot = getattr(req.handle, "slot", None)  # host windows: step % slots
                step = req.step if slot is None else slot(req.step)
                self.steps[req.start : req.start + req.num_rows].fill_(step)

    def release(self) -> None:
        """Zero the tables (a stale replay then copies nothing), then drop the sources."""
        if self.key is None:
            return
        with torch.inference_mode():  # made by a step (inference tensors); released anywhere
            self.base.zero_()
            self.stride.zero_()
        self._sources, self.key = {}, None

    def copy(self, block_id: int, out: torch.Tensor) -> None:
        """out[r] = row r's source of `block_id` at its step, rows with a source; out (R, L, C),
        each row contiguous."""
        if self._kernel is not None:
            self._kernel(self.base[block_id], self.stride[block_id], self.steps, out)
            return
        from triton_kernels.step_copy import copy_rows_indirect_reference

        copy_rows_indirect_reference(self._sources.get(block_id, []), self.steps, out)


def _host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor to copy to `device` without blocking: pinned for CUDA (the caching host
    allocator keeps it until the copy is done)."""
    return t.pin_memory() if device.type == "cuda" else t
