"""Applying each request's LoRAs to its own rows of a mixed batch; base weights never change.

A forward hook on every adapted nn.Linear adds, to the rows of each request that names adapters,
    y[rows] += sum_j  user_scale_j * (alpha_j / r_j) * (x[rows] @ down_j^T) @ up_j^T
through the segmented kernel (triton_kernels/segmented_lora.py) on CUDA, or torch ops. The hook
reads the step's `LoraBatch` from a context variable (like masked execution's StepContext):
without one, adapted layers compute exactly their stock forward.

Rows: a step's batch has R rows (each request's CFG rows adjacent, in batch order); every layout
of a linear layer's input keeps rows in that order, so each request's tokens are one contiguous
range, found from the layout's per-row offsets `cu` (R + 1,):
- an input of 3+ dims (R, ..., C): row r owns its whole slice (cu = r * tokens per row);
- a 2-D input (R, C): one token per row (embeddings of the timestep, pooled text);
- a 2-D packed input (T, C) of masked execution: the masked forward declares its layout with
  `packed_rows(cu, T)` (TokenSet.cu_q, JointSet.cu_q). A packed input with T == R has one token
  per row (a masked row has >= 1 token), the same layout as (R, C).
Text encoders run one request at a time: `LoraBatch.uniform` applies its adapters to every row.
Every device tensor a step reads is built when its LoraBatch is (before a CUDA-graph capture);
during the step the hooks only index and launch, so steps with LoRAs replay from graphs too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from instgenie.engine.kernels import kernel_enabled, optional_kernel

#: the segmented LoRA kernel: "auto" = on CUDA where Triton imports; "on" = also elsewhere (CPU
#: tests under TRITON_INTERPRET=1); "off" = the torch ops
SEGMENTED_KERNEL = "auto"
HOOK_ATTR = "_instgenie_lora_key"

_BATCH: contextvars.ContextVar[LoraBatch | None] = contextvars.ContextVar(
    "instgenie_lora_batch", default=None
)
_PACKED: contextvars.ContextVar[tuple[torch.Tensor, int] | None] = contextvars.ContextVar(
    "instgenie_lora_packed", default=None
)


@dataclass(eq=False)  # identity: a loaded adapter's tensors, shared by every batch that uses it
class DeviceAdapter:
    lora_id: str
    #: {(component, module): (down (r, in), up (out, r), alpha / r)} on the model's device/dtype;
    #: up is the transposed view of an (r, out)-contiguous tensor (triton_kernels/segmented_lora)
    pairs: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, float]]
    nbytes: int = 0


@dataclass(frozen=True)
class Group:
    """One request's rows [row_lo, row_hi) and its adapters with their user scales."""

    row_lo: int
    row_hi: int
    adapters: tuple[tuple[DeviceAdapter, float], ...]


@dataclass
class _Module:
    """One adapted layer in one batch: the batch's adapters of it concatenated on the rank dim,
    and per segment its rank columns and scale (rank 0: that adapter lacks this layer)."""

    a_cat: torch.Tensor  # (sum of ranks, in)
    b_cat: torch.Tensor  # (out, sum of ranks)
    rank_off: torch.Tensor  # (S,) int32
    rank: torch.Tensor  # (S,) int32
    scale: torch.Tensor  # (S,) float32
    max_rank: int
    host: list[tuple[int, int, float]]  # (rank_off, rank, scale) per segment


@dataclass(eq=False)  # identity: graphs key on it
class LoraBatch:
    groups: list[Group]
    num_rows: int
    device: torch.device
    dtype: torch.dtype
    #: every input row is one group's (text encoders: one request per call)
    uniform: bool = False
    modules: dict[tuple[str, str], _Module] = field(default_factory=dict)
    _bounds: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        segs = [(g.row_lo, g.row_hi, j) for g in self.groups for j in range(len(g.adapters))]
        self.num_segments = len(segs)
        self.num_slots = max((len(g.adapters) for g in self.groups), default=1)
        dev = self.device
        self.seg_row_lo = torch.tensor([s[0] for s in segs], dtype=torch.int64).to(dev)
        self.seg_row_hi = torch.tensor([s[1] for s in segs], dtype=torch.int64).to(dev)
        self.slot = torch.tensor([s[2] for s in segs], dtype=torch.int32).to(dev)
        self._build_modules()

    @classmethod
    def uniform_for(
        cls, adapters: tuple[tuple[DeviceAdapter, float], ...], device: torch.device, dtype
    ) -> LoraBatch:
        return cls([Group(0, 1, adapters)], 1, device, dtype, uniform=True)

    @property
    def key(self) -> tuple:
        """Equal keys = the same adapters on the same rows (identity of the loaded adapters)."""
        return tuple(
            (g.row_lo, g.row_hi, tuple((id(a), s) for a, s in g.adapters)) for g in self.groups
        )

    def _build_modules(self) -> None:
        keys = sorted({k for g in self.groups for a, _ in g.adapters for k in a.pairs})
        segs = [(a, s) for g in self.groups for a, s in g.adapters]
        ints, scales = [], []
        for key in keys:
            distinct: dict[int, tuple[int, DeviceAdapter]] = {}
            offset = 0
            for a, _ in segs:
                if key in a.pairs and id(a) not in distinct:
                    distinct[id(a)] = (offset, a)
                    offset += a.pairs[key][0].shape[0]
            host = []
            for a, s in segs:
                if key in a.pairs:
                    down, _, alpha_scale = a.pairs[key]
                    host.append((distinct[id(a)][0], down.shape[0], s * alpha_scale))
                else:
                    host.append((0, 0, 0.0))
            owners = [a for _, a in distinct.values()]
            if len(owners) == 1:  # one adapter: its own tensors (copied only if laid out wrong)
                a_cat, b_cat = owners[0].pairs[key][0], owners[0].pairs[key][1]
                a_cat = a_cat if a_cat.stride(1) == 1 else a_cat.contiguous()
                b_cat = b_cat if b_cat.stride(0) == 1 else b_cat.T.contiguous().T
            else:
                a_cat = torch.cat([a.pairs[key][0] for a in owners])
                # B as the transpose of a rank-major tensor (the kernel's vector loads)
                b_cat = torch.cat([a.pairs[key][1].T for a in owners]).T
            self.modules[key] = _Module(a_cat, b_cat, None, None, None,
                                        max(r for _, r, _ in host), host)  # fmt: skip
            ints.append([[o for o, _, _ in host], [r for _, r, _ in host]])
            scales.append([s for _, _, s in host])
        if keys:  # two host -> device copies for every layer of the batch
            ints_d = torch.tensor(ints, dtype=torch.int32).to(self.device)
            scales_d = torch.tensor(scales, dtype=torch.float32).to(self.device)
            for i, key in enumerate(keys):
                m = self.modules[key]
                m.rank_off, m.rank, m.scale = ints_d[i, 0], ints_d[i, 1], scales_d[i]

    def prepare_layouts(self, row_counts: list[int]) -> None:
        """Build the segment bounds of the dense layouts with these tokens per row now (before
        a graph capture); packed layouts are derived from their device offsets by device ops."""
        for per_row in row_counts:
            self._dense(per_row)

    def _dense(self, per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("dense", per_row)
        b = self._bounds.get(key)
        if b is None:
            b = self._bounds[key] = (
                (self.seg_row_lo * per_row).to(torch.int32),
                (self.seg_row_hi * per_row).to(torch.int32),
            )
        return b

    def bounds(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi) token ranges (S,) int32 of the segments in input `x` flattened to n rows."""
        if self.uniform:
            return self._dense(n)
        R = self.num_rows
        if x.dim() >= 3:
            if x.shape[0] != R:
                raise RuntimeError(f"LoRA: input of {x.shape[0]} rows in a batch of {R}")
            return self._dense(n // R)
        if n == R:
            return self._dense(1)
        packed = _PACKED.get()
        if packed is None or packed[1] != n:
            raise RuntimeError(f"LoRA: a packed input of {n} tokens without its row layout")
        cu = packed[0]
        key = ("packed", id(cu))
        b = self._bounds.get(key)
        if b is None or b[2] is not cu:
            cu64 = cu.to(torch.int64)
            lo = cu64[self.seg_row_lo].to(torch.int32)
            hi = cu64[self.seg_row_hi].to(torch.int32)
            b = self._bounds[key] = (lo, hi, cu)
        return b[0], b[1]

    def apply(self, key: tuple[str, str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        m = self.modules.get(key)
        if m is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        lo, hi = self.bounds(x, x2.shape[0])
        kernel = _kernel() if kernel_enabled(SEGMENTED_KERNEL, y.device) else None
        if kernel is not None:
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            if x2.dtype != m.a_cat.dtype or y2.dtype != m.a_cat.dtype:
                raise TypeError(f"LoRA: a {x2.dtype} -> {y2.dtype} layer in a {self.dtype} batch")
            # the unchecked launch: the batch's own tensors are laid out and typed as it needs
            kernel(x2, y2, m.a_cat, m.b_cat, lo, hi, m.rank_off, m.rank, self.slot, m.scale,
                   max_rank=m.max_rank, num_slots=self.num_slots)  # fmt: skip
            return y
        if y.device.type == "cuda":  # no host read of the bounds: a CUDA-graph capture may run
            _add_masked(x2, y2, m, lo, hi)
        else:
            _add_sliced(x2, y2, m, lo, hi)
        return y


def _add_sliced(x2: torch.Tensor, y2: torch.Tensor, m: _Module, lo, hi) -> None:
    """torch ops, each segment on its own rows (reads the bounds on the host)."""
    for (l, h), (off, r, s) in zip(zip(lo.tolist(), hi.tolist(), strict=True), m.host, strict=True):
        if r and h > l:
            v = x2[l:h] @ m.a_cat[off : off + r].T
            y2[l:h] += s * (v @ m.b_cat[:, off : off + r].T)


def _add_masked(x2: torch.Tensor, y2: torch.Tensor, m: _Module, lo, hi) -> None:
    """torch ops without a host read (CUDA-graph capturable): each segment's delta on every row,
    weighted by its 0/1 row mask times its scale (rows outside get + 0, exactly)."""
    rows = torch.arange(x2.shape[0], device=x2.device)
    for i, (off, r, s) in enumerate(m.host):
        if r:
            w = ((rows >= lo[i]) & (rows < hi[i])).to(y2.dtype) * s
            v = x2 @ m.a_cat[off : off + r].T
            y2 += w[:, None] * (v @ m.b_cat[:, off : off + r].T)


def _kernel():
    return optional_kernel("segmented_lora", "launch")


def current() -> LoraBatch | None:
    return _BATCH.get()


def text_key() -> tuple | None:
    """The active adapters by id and scale (a prompt-cache key part; ids are content hashes)."""
    batch = _BATCH.get()
    if batch is None:
        return None
    return tuple((a.lora_id, s) for g in batch.groups for a, s in g.adapters)


@contextlib.contextmanager
def use_lora(batch: LoraBatch | None) -> Iterator[None]:
    token = _BATCH.set(batch)
    try:
        yield
    finally:
        _BATCH.reset(token)


@contextlib.contextmanager
def packed_rows(cu: torch.Tensor, total: int) -> Iterator[None]:
    """Declare the packed layout of 2-D inputs of `total` tokens: row r's tokens are
    [cu[r], cu[r + 1]) (device int32, (R + 1,))."""
    token = _PACKED.set((cu, total))
    try:
        yield
    finally:
        _PACKED.reset(token)


def _hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    batch = _BATCH.get()
    if batch is None:
        return None
    return batch.apply(getattr(module, HOOK_ATTR), args[0], output)


def install(components: dict[str, torch.nn.Module], keys) -> int:
    """Hook the named linear layers (idempotent); returns how many were newly hooked."""
    new = 0
    for component, path in keys:
        module = components[component].get_submodule(path)
        if not isinstance(module, torch.nn.Linear):
            raise TypeError(f"{component}.{path} is a {type(module).__name__}, not a Linear")
        if getattr(module, HOOK_ATTR, None) is None:
            setattr(module, HOOK_ATTR, (component, path))
            module.register_forward_hook(_hook)
            new += 1
    return new
