"""The device tier: an LRU hot set of template caches in the compute device's memory, above the
host store (shared DRAM, then disk). Decision: docs/decisions/0028-device-tier.md.

Inclusive: captures go to the host store exactly as without this tier (it stays the source of
truth, shared by every process of the host); this tier holds this process's private copies of
the templates it uses most. A copy is laid out like InMemoryStore's stacked entries: one
(num_steps, rows, L, C) tensor per block in the activation dtype, plus the latents, so a device
handle's `block_steps(b)` is read in place by the CUDA-graph path (engine/graphs.py) and
`block(step, b)` by the eager one; nothing is loaded per step.

- Promotion follows use: `open` of a template in the hot set returns a device handle (tier "gpu"
  on CUDA, else the device's type); otherwise the host handle, and once the template has been
  opened `promote_after` times (this open included) and its copy fits the budget, the copy is
  made: on CUDA enqueued on a side stream (the edit that triggered it runs from the host handle
  meanwhile) and resident only once an event says the copy finished; elsewhere synchronously.
- fp8 host entries are dequantised on promotion (quant.copy_rows, the eager path's own formula):
  the graph path reads only stacks in the activation dtype (graphs.eligible), and the device
  tier is there for speed, not capacity; its bytes are the dequantised bytes.
- Demotion: to make room, least recently used copies that no open handle uses are dropped (a
  handle in use pins its copy); a copy larger than the budget is never made. `delete` drops the
  copy too. Budget 0 = the tier is off: every call is the host store's.
- A resident copy answers status/meta/open without the host index (its key is a content hash:
  the copy stays valid while the host evicts or moves its own).

Threads: one (the loop's). The copy is enqueued, and its event polled, from the calling thread:
a CUDA graph captured in the loop (capture mode "global") forbids other threads the calls a copy
thread would make (allocations, event queries).

Units: bytes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from instgenie.cache.quant import copy_rows
from instgenie.cache.store import (
    ActivationStore,
    CacheWriter,
    TemplateHandle,
    TemplateMeta,
    on_device,
)
from instgenie.cache.store import tier_of as _tier_of

log = logging.getLogger(__name__)

#: auto budget: this share of the device's free memory after the model is loaded and warmed ...
AUTO_SHARE = 0.8
#: ... less a reserve for CUDA-graph pools and activations: this many bytes plus ...
AUTO_RESERVE_BYTES = 4 << 30
#: ... this share of the device's total memory
AUTO_RESERVE_SHARE = 0.1


def tier_name(device: torch.device) -> str:
    """The tier a cache on `device` is reported as: "gpu" on CUDA, else the device's type."""
    return "gpu" if device.type == "cuda" else device.type


def auto_budget(device: str | torch.device) -> int:
    """The device tier's budget for `cache_gpu_bytes = -1`, bytes: on CUDA AUTO_SHARE of the free
    memory less AUTO_RESERVE_BYTES + AUTO_RESERVE_SHARE of the total (measure it after the model
    is loaded and warmed); elsewhere 0 (off: on a CPU device the host DRAM tier is the same
    memory and its handles are already zero-copy views)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(AUTO_SHARE * free - AUTO_RESERVE_BYTES - AUTO_RESERVE_SHARE * total))


@dataclass
class DeviceTierCounters:
    hits: int = 0  # opens served from a resident copy
    promotions: int = 0  # copies finished (made resident)
    demotions: int = 0  # resident copies dropped to make room (or for a smaller budget)
    promotion_failures: int = 0  # copies that could not be made (device out of memory, miss)


class _Copy:
    """One template's device copy. `blocks[b]` is (num_steps, rows, L, C); `latents` is
    (num_steps, *latent_shape)."""

    def __init__(self, key: str, meta: TemplateMeta, blocks: dict[int, torch.Tensor],
                 latents: torch.Tensor, nbytes: int) -> None:  # fmt: skip
        self.key, self.meta, self.blocks, self.latents = key, meta, blocks, latents
        self.nbytes = nbytes
        self.pins = 0  # open device handles
        self.ready = False  # the copy finished: it may be served
        self.dropped = False  # out of the hot set while pinned: its bytes count until unpinned
        #: while the copy runs on a side stream: the host handle it reads (kept open, so the
        #: host entry stays pinned and resident) and the event recorded after the last copy
        self.source: TemplateHandle | None = None
        self.done: Any = None


class DeviceTierStore:
    """An ActivationStore over `host` with an LRU hot set of copies on `device`."""

    def __init__(
        self,
        host: ActivationStore,
        device: str | torch.device,
        compute_dtype: torch.dtype,
        budget_bytes: int,
        promote_after: int = 1,
    ) -> None:
        """compute_dtype: the activations' dtype (block stacks are kept in it); budget_bytes:
        device bytes the copies may hold (0 = off; see auto_budget); promote_after: opens of a
        template (the promoting one included) before its copy is made (1: its second use is
        served from the device)."""
        if promote_after < 1:
            raise ValueError(f"promote_after must be >= 1, got {promote_after}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.host = host
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        #: the host store's storage dtype (part of template keys: EditPipeline.store_dtype)
        self.dtype = getattr(host, "dtype", None)
        self.tier_name = tier_name(self.device)
        self.budget_bytes = budget_bytes
        self.promote_after = promote_after
        self.counters = DeviceTierCounters()
        #: key -> copy, least recently used first (resident and in-flight copies)
        self._hot: OrderedDict[str, _Copy] = OrderedDict()
        self._uses: dict[str, int] = {}  # key -> opens while not resident
        self._used = 0  # bytes of every copy not freed yet (hot, in flight, dropped but pinned)
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- the host's ------------------------------------------------------------------------
    @property
    def tiered(self):
        """The host store's TieredStore (its counters, close), when it has one."""
        return getattr(self.host, "tiered", None)

    def writer(self, key: str, meta: TemplateMeta) -> CacheWriter:
        return self.host.writer(key, meta)

    def prefetch(self, key: str):
        fn = getattr(self.host, "prefetch", None)
        return None if fn is None else fn(key)

    # ---- queries ---------------------------------------------------------------------------
    def _resident(self, key: str) -> _Copy | None:
        self._poll()
        with self._lock:
            c = self._hot.get(key)
            return c if c is not None and c.ready else None

    def status(self, key: str) -> str:
        return "ready" if self._resident(key) is not None else self.host.status(key)

    def meta(self, key: str) -> TemplateMeta:
        c = self._resident(key)
        return c.meta if c is not None else self.host.meta(key)

    def tier(self, key: str) -> str:
        """Where `open(key)` would read it now: this tier, else the host's "dram" | "disk"."""
        return self.tier_name if self._resident(key) is not None else _tier_of(self.host, key)

    def bytes_by_tier(self, key: str) -> dict[str, int]:
        """Bytes of `key` per tier holding it (inclusive: a resident copy and the host's)."""
        out = {}
        c = self._resident(key)
        if c is not None:
            out[self.tier_name] = c.nbytes
        host = _tier_of(self.host, key)
        if host not in ("absent", "building"):
            out[host] = self.host.meta(key).nbytes
        return out

    def residency(self, keys: Iterable[str]) -> dict[str, dict[str, int]]:
        """key -> {tier: bytes} for each of `keys` held now: this tier's resident copies and the
        host's tiers (inclusive, as bytes_by_tier), in one host query."""
        keys = list(keys)
        fn = getattr(self.host, "residency", None)
        out = {k: dict(v) for k, v in (fn(keys) if fn is not None else {}).items()}
        self._poll()
        with self._lock:
            for k in keys:
                c = self._hot.get(k)
                if c is not None and c.ready:
                    out.setdefault(k, {})[self.tier_name] = c.nbytes
        return out

    @property
    def nbytes(self) -> int:
        """Device bytes this tier holds (resident and in-flight copies, and dropped ones still
        in use)."""
        with self._lock:
            return self._used

    def stats(self) -> dict[str, Any]:
        """The host's counters (TieredStore.stats) and this tier's (tier_stats)."""
        tiered = self.tiered
        out: dict[str, Any] = dict(tiered.stats()) if tiered is not None else {}
        out.update(self.tier_stats())
        return out

    def tier_stats(self) -> dict[str, int]:
        """This tier's counters (cheap: no host lock), keys suffixed with its tier name:
        bytes_<t>, entries_<t> (resident), budget_<t>_bytes, promotions_<t>, demotions_<t>
        (= evictions_<t>), hits_<t>, promotion_failures_<t>, in_flight_<t>."""
        self._poll()
        out: dict[str, int] = {}
        t = self.tier_name
        with self._lock:
            resident = [c for c in self._hot.values() if c.ready]
            out[f"bytes_{t}"] = sum(c.nbytes for c in resident)
            out[f"entries_{t}"] = len(resident)
            out[f"in_flight_{t}"] = len(self._hot) - len(resident)
            out[f"budget_{t}_bytes"] = self.budget_bytes
            for k, v in asdict(self.counters).items():
                out[f"{k}_{t}"] = v
            out[f"evictions_{t}"] = self.counters.demotions
        return out

    # ---- read ------------------------------------------------------------------------------
    def open(self, key: str) -> TemplateHandle:
        """The resident copy's handle, else the host's (CacheMiss as the host raises it); the
        open that reaches `promote_after` starts the copy."""
        self._poll()
        with self._lock:
            c = self._hot.get(key)
            if c is not None and c.ready:
                c.pins += 1
                self._hot.move_to_end(key)
                self.counters.hits += 1
                return _DeviceHandle(self, c)
            uses = self._uses[key] = self._uses.get(key, 0) + 1
            promote = c is None and self.budget_bytes > 0 and uses >= self.promote_after
        handle = self.host.open(key)
        if promote:
            try:
                self._promote(key, handle)
            except Exception as e:  # the edit runs from the host handle all the same
                with self._lock:
                    self.counters.promotion_failures += 1
                log.warning("template cache %s: not copied to the %s tier: %s: %s",
                            key[:12], self.tier_name, type(e).__name__, e)  # fmt: skip
        return handle

    def _promote(self, key: str, handle: TemplateHandle) -> None:
        """Reserve room, allocate the copy and fill it from the host entry."""
        meta = self.host.meta(key)
        first = {b: handle.block(0, b) for b in sorted(meta.block_shapes)}
        lat = handle.latents(0)
        n = meta.num_steps
        esize = self.compute_dtype.itemsize
        need = sum(n * y.shape.numel() * esize for y in first.values())
        need += n * lat.numel() * lat.element_size()
        with self._lock:
            if key in self._hot or not self._make_room(need):
                return  # larger than the budget, or the room is held by copies in use
            self._used += need
        try:
            with torch.inference_mode():  # allocated on the compute (current) stream
                blocks = {b: torch.empty((n, *y.shape), dtype=self.compute_dtype,
                                         device=self.device) for b, y in first.items()}  # fmt: skip
                latents = torch.empty((n, *lat.shape), dtype=lat.dtype, device=self.device)
            c = _Copy(key, meta, blocks, latents, need)
            if self._stream is None:
                self._fill(c, handle, non_blocking=False)
                c.ready = True
            else:
                c.source = self.host.open(key)  # read until the event: stays open, pinned
                try:
                    self._fill_async(c)
                except BaseException:
                    c.source.close()
                    raise
        except BaseException:
            with self._lock:
                self._used -= need
            raise
        with self._lock:
            self._hot[key] = c
            if c.ready:
                self.counters.promotions += 1

    def _fill(self, c: _Copy, src: TemplateHandle, non_blocking: bool) -> None:
        with torch.inference_mode():
            for b, stack in c.blocks.items():
                for s in range(c.meta.num_steps):
                    copy_rows(stack[s], src.block(s, b), non_blocking=non_blocking)
            for s in range(c.meta.num_steps):
                c.latents[s].copy_(src.latents(s), non_blocking=non_blocking)

    def _fill_async(self, c: _Copy) -> None:
        """CUDA: the copies on the side stream, after the compute stream's work so far (the
        memory may have been freed by a copy the compute stream still reads); the tensors are
        recorded on the side stream, so freeing them before the copy ends is safe."""
        stream = self._stream
        assert stream is not None and c.source is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._fill(c, c.source, non_blocking=True)
            c.done = torch.cuda.Event()
            c.done.record(stream)
        for t in [*c.blocks.values(), c.latents]:
            t.record_stream(stream)

    def _poll(self) -> None:
        """Mark copies whose side-stream event completed resident (never waits)."""
        if self._stream is None:
            return
        finished = []
        with self._lock:
            for c in self._hot.values():
                if not c.ready and c.done is not None and c.done.query():
                    c.ready, c.done = True, None
                    finished.append(c.source)
                    c.source = None
                    self.counters.promotions += 1
        for source in finished:
            source.close()

    def _make_room(self, need: int) -> bool:
        """(lock held) Demote LRU copies that are resident and unpinned until `need` more bytes
        fit the budget; False, demoting nothing, when they cannot."""
        free = self.budget_bytes - self._used
        if free >= need:
            return True
        victims, freed = [], 0
        for c in self._hot.values():
            if free + freed >= need:
                break
            if c.ready and c.pins == 0:
                victims.append(c)
                freed += c.nbytes
        if free + freed < need:
            return False
        for c in victims:
            del self._hot[c.key]
            self._used -= c.nbytes
            self.counters.demotions += 1
        return True

    def _closed(self, c: _Copy) -> None:
        with self._lock:
            c.pins -= 1
            if c.dropped and c.pins == 0:
                self._used -= c.nbytes

    # ---- delete / budget / close -----------------------------------------------------------
    def _drop(self, key: str) -> None:
        """Remove key's copy from the hot set (waiting for an in-flight copy to end)."""
        with self._lock:
            c = self._hot.pop(key, None)
            self._uses.pop(key, None)
        if c is None:
            return
        if c.done is not None:
            c.done.synchronize()
            c.done = None
        if c.source is not None:
            c.source.close()
            c.source = None
        with self._lock:
            if c.pins > 0:
                c.dropped = True  # its handles keep the tensors: counted until the last closes
            else:
                self._used -= c.nbytes

    def delete(self, key: str) -> None:
        """Drop the device copy, then delete the host entry (EntryInUse as the host raises it)."""
        self._drop(key)
        self.host.delete(key)

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget (e.g. auto_budget once the model is loaded); copies beyond it that are
        not in use are demoted, LRU first."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        with self._lock:
            self.budget_bytes = budget_bytes
            over = self._used - budget_bytes
            for c in [c for c in self._hot.values() if c.ready and c.pins == 0]:
                if over <= 0:
                    break
                del self._hot[c.key]
                self._used -= c.nbytes
                over -= c.nbytes
                self.counters.demotions += 1

    def close(self) -> None:
        """Drop every copy, then close the host's TieredStore (when it has one)."""
        for key in list(self._hot):
            self._drop(key)
        tiered = self.tiered
        if tiered is not None:
            tiered.close()


class _DeviceHandle:
    """Views of a resident copy; holding it pins the copy (never demoted while open)."""

    def __init__(self, store: DeviceTierStore, c: _Copy) -> None:
        self._store, self._copy = store, c
        self.device = store.device
        #: the tier that serves this handle (EditPipeline.select_path reports it)
        self.tier = store.tier_name

    def block(self, step: int, block_id: int) -> torch.Tensor:
        return self._copy.blocks[block_id][step]

    def block_steps(self, block_id: int, device: torch.device) -> torch.Tensor | None:
        """(num_steps, rows, L, C): the block's output at every step, in the activation dtype,
        when kernels on `device` read it in place (None on another device)."""
        stack = self._copy.blocks[block_id]
        return stack if on_device(stack, device) else None

    def latents(self, step: int) -> torch.Tensor:
        return self._copy.latents[step]

    def close(self) -> None:
        if self._copy is not None:
            c, self._copy = self._copy, None
            self._store._closed(c)
