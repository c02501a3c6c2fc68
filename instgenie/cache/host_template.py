"""Handles on one template in the host DRAM tier: `TemplateWriter` fills a new segment (a capture;
nothing is readable before commit), `HostTemplate` holds a reference on a ready one and hands out
zero-copy views of its blocks, fp8 scales and latents. `TieredStore.writer` and
`TieredStore.acquire` create them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from instgenie.cache.capture_stage import CaptureStager, StageTicket
from instgenie.cache.dram import DramTier
from instgenie.cache.hostmem import pin, unpin
from instgenie.cache.shm_segment import Segment

if TYPE_CHECKING:
    from instgenie.cache.tiered import TieredStore

log = logging.getLogger(__name__)


class TemplateWriter:
    """Fills one DRAM segment; nothing is visible to readers before commit().

    A capture from a GPU copies each block asynchronously, never through the driver's pageable
    bounce buffer with a host sync per block (≈ 1 GB/s measured for an SDXL step's 419 MB into
    /dev/shm, docs/benchmarks/cluster-h200.md). Staged (a `stager`, decision 0046, the serving
    default): DMA into a pinned staging slot, and the stager's threads back the segment's pages
    and copy them in, off the loop; at commit, once every copy landed, the segment's pages
    (faulted in by those copies) are registered as pinned. Pinned (`pin`, decision 0036): the
    whole fresh segment is registered first and each block is DMA'd straight into it; the
    registration faults every page in under the CUDA driver's lock, a stall of seconds for
    the loop. Commit and abort wait for the copies; a committed, pinned mapping becomes this
    process's mapping of the ready entry, so its readers do not pin it again."""

    def __init__(
        self, store: TieredStore, seg: Segment, stager: CaptureStager | None = None
    ) -> None:
        self.store, self.seg, self.layout = store, seg, seg.layout
        self.key = seg.key
        self._blocks: set[tuple[int, int]] = set()
        self._latents: set[int] = set()
        self._done = False
        #: the segment is registered as pinned memory (pin()); copies from CUDA are async
        self.pinned = False
        #: devices with async copies into the segment not yet waited for
        self._pending: set[torch.device] = set()
        #: copies go through this stager (whose threads also back the segment's data pages)
        self.stager = stager
        self._ticket = StageTicket()

    def pin(self) -> bool:
        """Register the segment's pages as pinned (CUDA machines; False elsewhere). Once per
        capture: unstaged, before its first block (a fresh segment: ≈ 0.34 s per GiB on the H200
        host, every page faulted in under the driver's lock), against the ≈ 0.4 s per SDXL step
        a pageable copy costs; staged, at commit (pages faulted in: ≈ 0.04 s per GiB)."""
        if not self.pinned and not self._done and self.seg.data is not None:
            try:
                self.pinned = pin(self.seg.data)
            except RuntimeError as exc:  # e.g. the locked-memory limit: copy pageable instead
                log.warning("capture %s: pinning its DRAM segment failed (%s); copying it "
                            "without pinning", self.key[:12], exc)  # fmt: skip
        return self.pinned

    def _copy(self, view: torch.Tensor, t: torch.Tensor, what: str) -> None:
        if self._done:
            raise RuntimeError("writer already committed or aborted")
        if tuple(t.shape) != tuple(view.shape):
            raise ValueError(f"{what}: shape {tuple(t.shape)} != layout's {tuple(view.shape)}")
        if self.stager is not None:
            self.stager.copy(self._ticket, view, t, self.seg.back)
            return
        # casts to the cache dtype; reads from any device; async only into pinned pages (a
        # stream-ordered DMA: the source's memory is reused only by later work on its stream)
        asynchronous = self.pinned and t.is_cuda
        view.copy_(t.detach(), non_blocking=asynchronous)
        if asynchronous:
            self._pending.add(t.device)

    def _wait(self) -> None:
        """Wait for every async copy into the segment (before it is published or unmapped);
        raises a staged copy's error."""
        if self.stager is not None:
            self.stager.drain(self._ticket)
        for device in self._pending:
            torch.cuda.synchronize(device)
        self._pending.clear()

    def put_block(
        self, step: int, block_id: int, y: torch.Tensor, scale: torch.Tensor | None = None
    ) -> None:
        """y: (rows, L_b, C_b); scale: (rows, L_b, 1) float32, required by fp8-scaled layouts.
        y may also be a quant.QuantizedRows (its .q and .scale are stored)."""
        if scale is None and hasattr(y, "q") and hasattr(y, "scale"):
            y, scale = y.q, y.scale
        assert self.seg.data is not None
        self._copy(self.layout.block_view(self.seg.data, step, block_id), y, "block")
        if self.layout.fp8_scales:
            if scale is None:
                raise ValueError("this layout stores fp8 scales: pass scale=")
            self._copy(self.layout.scale_view(self.seg.data, step, block_id), scale, "scale")
        self._blocks.add((step, block_id))

    def put_latents(self, step: int, latents: torch.Tensor) -> None:
        assert self.seg.data is not None
        self._copy(self.layout.latents_view(self.seg.data, step), latents, "latents")
        self._latents.add(step)

    def commit(self) -> None:
        n_blocks = self.layout.num_steps * self.layout.num_blocks
        if len(self._blocks) != n_blocks or len(self._latents) != self.layout.num_steps:
            self.abort()
            raise RuntimeError(
                f"incomplete capture: {len(self._blocks)}/{n_blocks} block outputs, "
                f"{len(self._latents)}/{self.layout.num_steps} latents"
            )
        try:
            self._wait()
            if self.stager is not None:
                self._finish_staged()
        except BaseException:
            self.abort()
            raise
        self._done = True
        if not self.pinned:
            self.store.dram.commit(self.seg)
            self.seg.close()
            return
        # keep the pinned mapping as this process's mapping of the entry (DramTier.attach
        # shares it; its on_unmap hook unpins it before it is closed)
        self.seg.pinned = {}
        try:
            self.store.dram.commit(self.seg, acquire=True)
        except BaseException:  # not adopted (the entry vanished): unpin before it is unmapped
            self.seg.pinned = None
            if self.seg.data is not None:
                unpin(self.seg.data)
            self.seg.close()
            raise
        self.store.dram.release(self.seg)

    def _finish_staged(self) -> None:
        """After every staged copy landed, register the segment's pages for readers (DMA and
        graph reads in place) on CUDA machines: the copies backed and faulted in every page
        (the layout's gaps are under ALIGN = 256 bytes, so no page lies wholly in one), so the
        registration only locks them (≈ 0.04 s per GiB on the H200 host against ≈ 0.34 s for a
        fresh segment: docs/benchmarks/pin-stall-h200.md)."""
        if torch.cuda.is_available():
            self.pin()

    def abort(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._wait()
            except BaseException as exc:  # a failed staged copy: nothing of it is kept anyway
                log.info("capture %s aborted after a failed copy: %s", self.key[:12], exc)
            finally:
                if self.pinned and self.seg.data is not None:
                    unpin(self.seg.data)
                self.store.dram.abort(self.seg)

    def __enter__(self) -> TemplateWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()  # a no-op after commit


class HostTemplate:
    """A reference on a ready DRAM entry; views are valid while the handle is open (after close
    they stay mapped, never dangling, but the entry may be evicted and its name reused)."""

    def __init__(self, dram: DramTier, seg: Segment) -> None:
        self._dram, self._seg = dram, seg
        self.key, self.layout = seg.key, seg.layout
        self._open = True  # the mapping is shared by this process's handles: closed per handle

    @property
    def segment(self) -> Segment:
        """This process's mapping of the entry (shared by its handles; see DramTier.attach)."""
        return self._seg

    @property
    def data(self) -> torch.Tensor:
        """The whole template as one uint8 tensor."""
        if not self._open or self._seg.data is None:
            raise RuntimeError("handle is closed")
        return self._seg.data

    def block(self, step: int, block_id: int) -> torch.Tensor:
        return self.layout.block_view(self.data, step, block_id)

    def scales(self, step: int, block_id: int) -> torch.Tensor:
        return self.layout.scale_view(self.data, step, block_id)

    def latents(self, step: int) -> torch.Tensor:
        return self.layout.latents_view(self.data, step)

    @property
    def closed(self) -> bool:
        return not self._open

    def close(self) -> None:
        if self._open:
            self._open = False
            self._dram.release(self._seg)

    def __del__(self) -> None:
        # a handle dropped without close() would pin its entry until this process exits
        seg = getattr(self, "_seg", None)
        if seg is not None and getattr(self, "_open", False) and not self._dram.in_txn:
            log.warning("HostTemplate %s garbage-collected while open: released", self.key[:12])
            try:
                self.close()
            except Exception:  # interpreter shutdown
                pass

    def __enter__(self) -> HostTemplate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
