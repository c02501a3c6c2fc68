"""Activation store interface and the in-memory store.

A template's cache holds, for every denoising step s and every hooked transformer block b, the
block's output Y for all image tokens and every CFG row: a tensor (num_rows, L_b, C_b) in the
cache dtype; plus the template's latents after each step (used to keep unmasked latents on the
template's trajectory). Entries are written once by a capture run and read many times.

State machine per key: absent -> building (a writer exists) -> ready (commit) ; building -> absent
(abort). Readers only ever see ready entries.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from instgenie.cache.quant import FP8, QuantizedRows, quantize_rows


@dataclass
class TemplateMeta:
    """What an edit must match to read a template's cache (set when the writer is created), and
    shape information filled in by the capture."""

    num_steps: int
    num_rows: int
    #: the capture's timestep table; an edit reads the cache only with an identical schedule
    timesteps: tuple[float, ...] = ()
    #: the capture's latent shape (resolution)
    latent_shape: tuple[int, ...] = ()
    #: storage dtype of block outputs ("bfloat16", "float16", "float32", "float8_e4m3fn", ...);
    #: set by the store's writer
    cache_dtype: str = ""
    #: block id -> (L tokens, C channels)
    block_shapes: dict[int, tuple[int, int]] = field(default_factory=dict)
    nbytes: int = 0


class CacheWriter(Protocol):
    def put_block(self, step: int, block_id: int, y: torch.Tensor) -> None: ...
    def put_latents(self, step: int, latents: torch.Tensor) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class TemplateHandle(Protocol):
    """An open, ready template cache. Holding it keeps the entry from being evicted."""

    #: where the tensors live: the compute device (read directly) or "cpu" (host tier: loaded)
    device: torch.device

    def block(self, step: int, block_id: int) -> torch.Tensor:
        """(rows, L, C) block output of `step`."""
        ...

    def latents(self, step: int) -> torch.Tensor: ...
    def close(self) -> None: ...


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether `a` and `b` name one device, where an index-less CUDA device ("cuda") means the
    current index (torch.device("cuda") != torch.device("cuda:0"), though they name one card)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        if a.type != "cuda":
            return True
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (
            b.index if b.index is not None else current
        )
    return a.index == b.index


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` lives on `device` (same_device)."""
    return same_device(t.device, device)


def tier_of(store: object, key: str) -> str:
    """Where `store` holds entry `key` now: "dram" | "disk" (host store) or its device's
    "gpu" | "cpu" (InMemoryStore)."""
    if hasattr(store, "tier"):
        return store.tier(key)
    device = store.device.type  # type: ignore[attr-defined]
    return "gpu" if device == "cuda" else device


class ActivationStore(Protocol):
    def status(self, key: str) -> str:
        """ "ready", "building" or "absent"."""
        ...

    def writer(self, key: str, meta: TemplateMeta) -> CacheWriter: ...
    def meta(self, key: str) -> TemplateMeta: ...
    def open(self, key: str) -> TemplateHandle: ...
    def delete(self, key: str) -> None: ...


class _Entry:
    def __init__(self, meta: TemplateMeta) -> None:
        self.meta = meta
        self.blocks: dict[tuple[int, int], torch.Tensor] = {}
        #: block id -> (num_steps, rows, L, C): every step's output of the block in one tensor;
        #: `blocks[(s, b)]` is `stacked[b][s]` (unquantised entries only)
        self.stacked: dict[int, torch.Tensor] = {}
        self.latents: dict[int, torch.Tensor] = {}


class InMemoryStore:
    """Every entry lives on one device (GPU memory: the ideal case of paper §6.3; or CPU).
    With dtype float8_e4m3fn, block outputs are kept as fp8 with per-token scales."""

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        pin_memory: bool = False,
    ):
        self.device = torch.device(device)
        #: storage dtype; None = the activations' own dtype
        self.dtype = dtype
        #: host entries in page-locked memory, so host -> GPU copies are asynchronous and run at
        #: full PCIe bandwidth (needs CUDA); a stand-in for the shared DRAM tier in benchmarks
        self.pin_memory = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        self._ready: dict[str, _Entry] = {}
        self._building: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def status(self, key: str) -> str:
        with self._lock:
            if key in self._ready:
                return "ready"
            return "building" if key in self._building else "absent"

    def writer(self, key: str, meta: TemplateMeta) -> _MemoryWriter:
        with self._lock:
            if key in self._ready or key in self._building:
                state = "ready" if key in self._ready else "building"
                raise KeyError(f"template cache {key[:12]} is already {state}")
            meta.cache_dtype = str(self.dtype).removeprefix("torch.") if self.dtype else ""
            entry = _Entry(meta)
            self._building[key] = entry
        return _MemoryWriter(self, key, entry)

    def meta(self, key: str) -> TemplateMeta:
        return self._ready[key].meta

    def open(self, key: str) -> _MemoryHandle:
        return _MemoryHandle(self._ready[key], self.device)

    def delete(self, key: str) -> None:
        with self._lock:
            self._ready.pop(key, None)
            self._building.pop(key, None)

    @property
    def nbytes(self) -> int:
        return sum(e.meta.nbytes for e in self._ready.values())

    def residency(self, keys: Iterable[str]) -> dict[str, dict[str, int]]:
        """key -> {its device's tier ("gpu" | "cpu"): bytes} for each of `keys` ready here."""
        tier = tier_of(self, "")
        with self._lock:
            return {k: {tier: e.meta.nbytes} for k in keys if (e := self._ready.get(k))}

    def _store(self, t: torch.Tensor, quantize: bool = False) -> torch.Tensor | QuantizedRows:
        t = t.detach()
        if quantize and self.dtype == FP8:
            qr = quantize_rows(t)
            return QuantizedRows(self._place(qr.q), self._place(qr.scale))
        dtype = self.dtype if self.dtype not in (None, FP8) else t.dtype
        return self._place(t.to(dtype))

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of t on the store's device (page-locked when pin_memory)."""
        if self.pin_memory:
            out = self._empty(t.shape, t.dtype)
            out.copy_(t)
            return out
        return t.to(device=self.device, copy=True)

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.pin_memory:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _store_step(self, entry: _Entry, step: int, block_id: int, y: torch.Tensor) -> torch.Tensor:
        """Unquantised block output: written into the block's (num_steps, rows, L, C) stack, so
        that one tensor holds every step (a CUDA graph reads any step from it by index)."""
        stack = entry.stacked.get(block_id)
        dtype = self.dtype or y.dtype
        if stack is None or stack.shape[1:] != y.shape or stack.dtype != dtype:
            if stack is not None:  # a capture never changes shapes; keep the old entries valid
                return self._place(y.detach().to(dtype))
            stack = self._empty((entry.meta.num_steps, *y.shape), dtype)
            entry.stacked[block_id] = stack
        stack[step].copy_(y.detach())
        return stack[step]

    def _finish(self, key: str, entry: _Entry, ok: bool) -> None:
        with self._lock:
            if self._building.get(key) is not entry:
                return
            del self._building[key]
            if ok:
                self._ready[key] = entry


class _MemoryHandle:
    """Direct views of an in-memory entry (which stays alive while referenced here)."""

    def __init__(self, entry: _Entry, device: torch.device) -> None:
        self._entry, self.device = entry, device

    def block(self, step: int, block_id: int) -> torch.Tensor:
        return self._entry.blocks[(step, block_id)]

    def block_steps(self, block_id: int, device: torch.device) -> torch.Tensor | None:
        """(num_steps, rows, L, C): the block's output at every step, when kernels on `device`
        can read it in place; else None (fp8 entries, another device)."""
        stack = self._entry.stacked.get(block_id)
        return stack if stack is not None and on_device(stack, device) else None

    def latents(self, step: int) -> torch.Tensor:
        return self._entry.latents[step]

    def close(self) -> None:
        self._entry = None


class _MemoryWriter:
    def __init__(self, store: InMemoryStore, key: str, entry: _Entry) -> None:
        self.store, self.key, self.entry = store, key, entry

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.entry.meta.num_steps:
            raise ValueError(f"step {step} outside [0, {self.entry.meta.num_steps})")

    def put_block(self, step: int, block_id: int, y: torch.Tensor) -> None:
        """Store block_id's output at step (a repeated put replaces the earlier one)."""
        self._check_step(step)
        if not self.entry.meta.cache_dtype:
            self.entry.meta.cache_dtype = str(y.dtype).removeprefix("torch.")
        if self.store.dtype == FP8:
            t = self.store._store(y, quantize=True)
        else:
            t = self.store._store_step(self.entry, step, block_id, y)
        self.entry.blocks[(step, block_id)] = t
        self.entry.meta.block_shapes[block_id] = (int(t.shape[1]), int(t.shape[2]))

    def put_latents(self, step: int, latents: torch.Tensor) -> None:
        self._check_step(step)
        self.entry.latents[step] = self.store._store(latents)

    def commit(self) -> None:
        """Ready only with every (step, block) output and every step's latents."""
        entry, meta = self.entry, self.entry.meta
        steps = range(meta.num_steps)
        blocks = {(s, b) for s in steps for b in meta.block_shapes}
        missing = sorted(blocks - set(entry.blocks))
        missing_latents = sorted(set(steps) - set(entry.latents))
        if missing or missing_latents or not blocks:
            self.abort()
            raise RuntimeError(
                f"incomplete capture: {len(blocks) - len(missing)}/{len(blocks)} block outputs "
                f"(first missing (step, block): {missing[:3]}), "
                f"{meta.num_steps - len(missing_latents)}/{meta.num_steps} latents"
            )
        # bytes held: each stored tensor once (a repeated put replaced its predecessor)
        meta.nbytes = sum(_nbytes(t) for t in [*entry.blocks.values(), *entry.latents.values()])
        self.store._finish(self.key, entry, ok=True)

    def abort(self) -> None:
        self.store._finish(self.key, self.entry, ok=False)


def _nbytes(t: torch.Tensor | QuantizedRows) -> int:
    return t.nbytes if isinstance(t, QuantizedRows) else t.numel() * t.element_size()
