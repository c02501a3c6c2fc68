"""A model process's adapters: registered files on disk, parsed pairs in host memory, loaded pairs
on the device, and loads running beside the denoise loop.

    disk (<lora_dir>/<id>.safetensors, written by the API)  --parse, check, cast, pin-->
    host LRU (lora_host_bytes)  --copy on a side stream (a loader thread)-->  device LRU
    (lora_gpu_bytes; adapters of running requests are pinned)

A part is "text" (text encoders: loaded synchronously at the request's prompt encode) or
"backbone" (UNet / transformer: loaded asynchronously, polled each step; bounded by gate.py).
Invariants: a device adapter becomes visible only when its copy finished (its CUDA event
completed) and its layers are hooked; a file that fails to load fails every request naming it
with its typed error and leaves nothing behind in either cache.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path

import torch

from instgenie.config import LoraConfig
from instgenie.errors import LoraError, LoraNotFound, ValidationError
from instgenie.lora import apply
from instgenie.lora.files import COMPONENTS, LoraWeights, read_part
from instgenie.lora.gate import LoraUse
from instgenie.lora.lru import ByteLru
from instgenie.lora.targets import Table, conform

log = logging.getLogger(__name__)
PARTS = ("text", "backbone")


def lora_path(directory: Path, lora_id: str) -> Path:
    if len(lora_id) != 64 or any(c not in "0123456789abcdef" for c in lora_id):
        raise LoraNotFound("loras", f"{lora_id!r} is not a LoRA id (64 lowercase hex)")
    return directory / f"{lora_id}.safetensors"


def check_refs(refs, max_per_request: int) -> tuple[tuple[str, float], ...]:
    """A request's `loras` as ((id, scale), ...): ids well-formed, no repeats, finite scales."""
    refs = tuple((str(i), float(s)) for i, s in refs)
    if len(refs) > max_per_request:
        raise ValidationError("loras", f"at most {max_per_request} LoRAs per edit, got {len(refs)}")
    ids = [i for i, _ in refs]
    if len(set(ids)) != len(ids):
        raise ValidationError("loras", "a LoRA is named twice")
    for i, s in refs:
        lora_path(Path("."), i)
        if not -8.0 <= s <= 8.0:  # also refuses NaN
            raise ValidationError("loras", f"scale {s} of {i[:12]} is not in [-8, 8]")
    return refs


class AdapterStore:
    def __init__(
        self,
        directory: Path,
        components: Mapping[str, torch.nn.Module],
        pipeline_cls: type,
        table: Table,
        device: torch.device,
        dtype: torch.dtype,
        cfg: LoraConfig,
        unet_config: Mapping | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.components = dict(components)
        self.pipeline_cls, self.table, self.unet_config = pipeline_cls, table, unet_config
        self.device, self.dtype, self.cfg = device, dtype, cfg
        self.host = ByteLru(cfg.lora_host_bytes)
        self.gpu = ByteLru(cfg.lora_gpu_bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._loads: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._failed: dict[str, LoraError] = {}
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        #: adapters loaded, from which tier, and load times (stats, benchmarks)
        self.loaded: list[tuple[str, str, float]] = []

    # ---- host tier -------------------------------------------------------------------------
    def exists(self, lora_id: str) -> bool:
        return lora_path(self.directory, lora_id).is_file()

    def weights(self, lora_id: str, part: str) -> LoraWeights:
        """The parsed, checked pairs of `part` in the model's dtype (pinned on a CUDA host);
        only that part's tensors are read from the file."""
        w = self.host.get((lora_id, part))
        if w is not None:
            return w
        path = lora_path(self.directory, lora_id)
        if not path.is_file():
            raise LoraNotFound("loras", f"no LoRA {lora_id[:12]} is registered")
        w = read_part(path, part, self.pipeline_cls, self.unet_config)
        if w is None:
            w = LoraWeights(())
        else:
            w = conform(w, self.table, self.cfg.lora_max_rank)
        # one (pinned) buffer per part: one host allocation and one DMA per load, instead of a
        # cudaHostAlloc and a copy per tensor (thousands for an SDXL LoRA)
        total = sum(x.down.numel() + x.up.numel() for x in w.layers)
        flat = torch.empty(total, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        layers, at = [], 0
        for x in w.layers:
            down = flat[at : at + x.down.numel()].view(x.down.shape)
            at += x.down.numel()
            up_t = flat[at : at + x.up.numel()].view(x.up.shape[1], x.up.shape[0])
            at += x.up.numel()
            down.copy_(x.down)
            up_t.copy_(x.up.T)
            # up kept rank-major: (out, r) as a transposed view (the kernel's layout)
            layers.append(type(x)(x.component, x.module, down, up_t.T, x.scale))
        w = LoraWeights(tuple(layers), flat)
        self.host.put((lora_id, part), w, w.nbytes(self.dtype.itemsize))
        return w

    # ---- device tier -----------------------------------------------------------------------
    def _copy(self, lora_id: str, part: str) -> tuple[apply.DeviceAdapter, object]:
        """Loader thread: host pairs -> device on the side stream; returns the adapter and the
        event its copies complete at (None on a CPU device)."""
        t0 = time.perf_counter()
        w = self.weights(lora_id, part)
        pairs = {}
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with ctx:
            flat = w.flat.to(self.device, non_blocking=True)  # one DMA
            for x in w.layers:
                # the same views of the device copy as of the host buffer
                down = flat.as_strided(x.down.shape, x.down.stride(), x.down.storage_offset())
                up = flat.as_strided(x.up.shape, x.up.stride(), x.up.storage_offset())
                pairs[x.key] = (down, up, x.scale)
            nbytes = flat.numel() * flat.element_size()
            event = None
            if self._stream is not None:
                event = torch.cuda.Event()
                event.record(self._stream)
        ms = 1e3 * (time.perf_counter() - t0)
        return apply.DeviceAdapter(lora_id, pairs, nbytes), (event, ms)

    def start(self, lora_id: str, part: str) -> None:
        """Begin loading `part` of `lora_id` unless it is on the device or on its way."""
        key = (lora_id, part)
        if key in self.gpu or key in self._loads or lora_id in self._failed:
            return
        self._loads[key] = self._pool.submit(self._copy, lora_id, part)

    def poll(self, lora_id: str, part: str, wait: bool = False) -> apply.DeviceAdapter | None:
        """The loaded adapter (now hooked and cached), or None while it is loading. A load that
        failed raises its LoraError (for every request naming it)."""
        key = (lora_id, part)
        ad = self.gpu.get(key)
        if ad is not None:
            return ad
        if lora_id in self._failed:
            raise self._failed[lora_id]
        self.start(lora_id, part)
        fut = self._loads[key]
        if not wait and not fut.done():
            return None
        try:
            ad, (event, ms) = fut.result()
        except LoraError as exc:
            self._loads.pop(key, None)
            self._failed[lora_id] = exc
            for p in PARTS:
                self.host.remove((lora_id, p))
            raise
        if event is not None:
            if wait:
                event.synchronize()
            elif not event.query():
                return None
            cur = torch.cuda.current_stream(self.device)
            for down, _, _ in ad.pairs.values():  # freed memory must wait for the compute stream
                down.record_stream(cur)  # (every pair is a view of one allocation)
                break
        del self._loads[key]
        apply.install(self.components, ad.pairs.keys())
        for evicted in self.gpu.put(key, ad, ad.nbytes):
            log.debug("LoRA %s evicted from the device", evicted)
        self.loaded.append((lora_id, part, ms))
        return ad

    def adapters(self, refs, part: str, wait: bool) -> tuple | None:
        """((DeviceAdapter, scale), ...) of the refs that have layers in `part`, or None if one
        is still loading (wait=False)."""
        out = []
        for lora_id in {i for i, _ in refs}:
            self.start(lora_id, part)
        for lora_id, scale in refs:
            ad = self.poll(lora_id, part, wait=wait)
            if ad is None:
                return None
            if ad.pairs:
                out.append((ad, scale))
        return tuple(out)

    def use_for(self, refs) -> LoraUse:
        """A request's LoRAs as its prompt encode needs them: the text parts loaded now
        (synchronously: they are small), the backbone parts' loads started."""
        use = LoraUse(tuple((i, float(s)) for i, s in refs))
        use.text = self.adapters(use.refs, "text", wait=True)
        for lora_id, _ in use.refs:  # the backbone parts load while the request waits or runs
            self.start(lora_id, "backbone")
        return use

    def resolve(self, use: LoraUse, wait: bool) -> bool:
        """Give `use` its backbone adapters once loaded (wait: block until they are), pinned on
        the device while it runs. True once it has them. A failed load raises its LoraError."""
        if use.adapters is not None:
            return True
        adapters = self.adapters(use.refs, "backbone", wait=wait)
        if adapters is None:
            return False
        self.pin(use.refs, "backbone")
        use.adapters = adapters
        return True

    def pin(self, refs, part: str) -> None:
        for lora_id, _ in refs:
            if (lora_id, part) in self.gpu:
                self.gpu.pin((lora_id, part))

    def unpin(self, refs, part: str) -> None:
        for lora_id, _ in refs:
            if self.gpu.pins((lora_id, part)):
                self.gpu.unpin((lora_id, part))

    def wait_any(self, timeout_s: float = 5.0) -> None:
        """Block until some load finishes (every request of the batch is held)."""
        pending = list(self._loads.values())
        if pending:
            concurrent.futures.wait(pending, timeout=timeout_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)  # fmt: skip
            if self._stream is not None:
                self._stream.synchronize()

    def forget(self, lora_id: str, host: bool = True) -> None:
        """A deleted LoRA: drop it from both tiers (requests using it keep their tensors);
        host=False: from the device only (benchmarks of a load from host memory)."""
        self._failed.pop(lora_id, None)
        for part in PARTS:
            if host:
                self.host.remove((lora_id, part))
            self.gpu.remove((lora_id, part))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def check_request(refs, store: AdapterStore | None) -> None:
    """An edit's `loras`: the list's form, and with a store (a model process) that each id is
    registered; a process without one (image pre-processing) checks the form only."""
    if refs:
        limit = (store.cfg if store is not None else LoraConfig()).lora_max_per_request
        for lora_id, _ in check_refs(refs, limit):
            if store is not None and not store.exists(lora_id):
                raise LoraNotFound("loras", f"no LoRA {lora_id[:12]} is registered")


def open_store(family, directory: Path, cfg: LoraConfig) -> AdapterStore:
    """The store of a loaded model family (its backbone and text encoders as they are)."""
    from instgenie.lora.targets import linear_table

    pipe = family.pipe
    components = {
        name: getattr(pipe, name)
        for name in COMPONENTS
        if isinstance(getattr(pipe, name, None), torch.nn.Module)
    }
    unet = components.get("unet")
    return AdapterStore(
        directory,
        components,
        type(family).pipeline_cls,
        linear_table(components),
        family.device,
        family.dtype,
        cfg,
        unet_config=None if unet is None else dict(unet.config),
    )
