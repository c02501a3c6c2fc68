"""Byte layout of one template cache inside ONE contiguous buffer (DRAM segment, disk file body).

Order is step-major: for every step s, every block b in block-id order, the slab Y[s][b] of shape
(rows, L_b, C_b) in the cache dtype (then, for fp8 caches, its float32 scale slab of shape
(rows, L_b, 1): one scale per token row, as in quant.QuantizedRows), then the step's latents.
Every slab starts on a 256-byte boundary, so a slab can be viewed as a typed tensor in place and
copied with aligned DMA. All steps have identical shapes, so
offset(s, b) = s * step_nbytes + block_offset[b].

Units: every offset and size here is in bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

#: every slab's offset is a multiple of this (bytes)
ALIGN = 256
#: sanity caps (reject hostile or corrupt headers before allocating anything)
MAX_TOTAL_BYTES = 1 << 48  # 256 TiB
MAX_DIM = 1 << 31
MAX_STEPS = 10_000
MAX_BLOCKS = 10_000
LAYOUT_VERSION = 1

#: cache dtype name -> torch dtype; names are the only thing serialized
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,  # exactness tests on CPU
    "float8_e4m3fn": torch.float8_e4m3fn,
}
LATENT_DTYPES = ("bfloat16", "float16", "float32", "float64")
FP8 = "float8_e4m3fn"
_FIELDS = {
    "version",
    "num_steps",
    "rows",
    "dtype",
    "block_shapes",
    "latent_shape",
    "latent_dtype",
    "fp8_scales",
}


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def _check_int(name: str, v: Any, lo: int, hi: int) -> int:
    # bool is an int subclass; a JSON true must not pass as 1
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"layout: {name} must be an int in [{lo}, {hi}], got {v!r}")
    return v


@dataclass(frozen=True)
class TemplateLayout:
    num_steps: int
    #: CFG rows per slab (1 or 2)
    rows: int
    #: cache dtype name (a key of DTYPES)
    dtype: str
    #: (L_b tokens, C_b channels) for block ids 0..num_blocks-1, in block-id order
    block_shapes: tuple[tuple[int, int], ...]
    latent_shape: tuple[int, ...]
    latent_dtype: str = "float32"
    #: fp8 only: a float32 scale per (row, token) follows every slab, shape (rows, L_b, 1)
    fp8_scales: bool = False
    # derived in __post_init__ (bytes): per-step offsets of slabs, scales and latents
    step_nbytes: int = field(init=False, repr=False, compare=False)
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _scale_offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _latent_offset: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("num_steps", self.num_steps, 1, MAX_STEPS)
        _check_int("rows", self.rows, 1, 2)
        if self.dtype not in DTYPES:
            raise ValueError(f"layout: unknown cache dtype {self.dtype!r}")
        if self.latent_dtype not in LATENT_DTYPES:
            raise ValueError(f"layout: unknown latent dtype {self.latent_dtype!r}")
        if type(self.fp8_scales) is not bool or (self.fp8_scales and self.dtype != FP8):
            raise ValueError("layout: fp8_scales must be a bool and needs dtype float8_e4m3fn")
        shapes = tuple(tuple(s) for s in self.block_shapes)
        if not 1 <= len(shapes) <= MAX_BLOCKS or any(len(s) != 2 for s in shapes):
            raise ValueError("layout: block_shapes must be 1..MAX_BLOCKS pairs (L, C)")
        for s in shapes:
            _check_int("block L", s[0], 1, MAX_DIM)
            _check_int("block C", s[1], 1, MAX_DIM)
        lat = tuple(self.latent_shape)
        if not 1 <= len(lat) <= 8:
            raise ValueError("layout: latent_shape must have 1..8 dims")
        for d in lat:
            _check_int("latent dim", d, 1, MAX_DIM)
        object.__setattr__(self, "block_shapes", shapes)
        object.__setattr__(self, "latent_shape", lat)
        offsets, scale_offsets, lat_off, step = self._step_plan()
        if step * self.num_steps > MAX_TOTAL_BYTES:
            raise ValueError(f"layout: {step * self.num_steps} bytes exceeds {MAX_TOTAL_BYTES}")
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_scale_offsets", scale_offsets)
        object.__setattr__(self, "_latent_offset", lat_off)
        object.__setattr__(self, "step_nbytes", step)

    def _step_plan(self) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
        esize = DTYPES[self.dtype].itemsize
        off, offsets, scales = 0, [], []
        for L, C in self.block_shapes:
            offsets.append(off)
            off = align_up(off + self.rows * L * C * esize)
            if self.fp8_scales:
                scales.append(off)
                off = align_up(off + self.rows * L * 4)
        lat_off = off
        off = align_up(off + math.prod(self.latent_shape) * DTYPES[self.latent_dtype].itemsize)
        return tuple(offsets), tuple(scales), lat_off, off

    # ---- geometry -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.block_shapes)

    @property
    def nbytes(self) -> int:
        """Total buffer size in bytes (a multiple of ALIGN)."""
        return self.step_nbytes * self.num_steps

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def block_shape(self, block: int) -> tuple[int, int, int]:
        L, C = self.block_shapes[block]
        return (self.rows, L, C)

    def _check(self, step: int, block: int | None = None) -> None:
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} out of range [0, {self.num_steps})")
        if block is not None and not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range [0, {self.num_blocks})")

    def slab(self, step: int, block: int) -> tuple[int, tuple[int, ...]]:
        """(byte offset, shape) of Y[step][block]."""
        self._check(step, block)
        off = step * self.step_nbytes + self._offsets[block]
        return off, self.block_shape(block)

    def scale_slab(self, step: int, block: int) -> tuple[int, tuple[int, ...]]:
        """(byte offset, shape) of the float32 scales of Y[step][block] (fp8 layouts only)."""
        if not self.fp8_scales:
            raise ValueError("layout has no fp8 scales")
        self._check(step, block)
        off = step * self.step_nbytes + self._scale_offsets[block]
        return off, (self.rows, self.block_shapes[block][0], 1)

    def latents_slab(self, step: int) -> tuple[int, tuple[int, ...]]:
        self._check(step)
        return step * self.step_nbytes + self._latent_offset, self.latent_shape

    # ---- zero-copy views ------------------------------------------------------------------------
    def block_view(self, buf: Buffer, step: int, block: int) -> torch.Tensor:
        off, shape = self.slab(step, block)
        return view_slab(buf, off, shape, self.dtype)

    def block_steps_view(self, flat: torch.Tensor, block: int) -> torch.Tensor:
        """(num_steps, rows, L, C) view of Y[*][block] over a flat uint8 tensor holding the whole
        layout (any device: e.g. a device view of pinned host memory). Steps are step_nbytes
        apart, so the view is strided across steps and contiguous within one."""
        self._check(0, block)
        esize = self.torch_dtype.itemsize
        if flat.dim() != 1 or flat.dtype != torch.uint8 or flat.numel() < self.nbytes:
            raise ValueError("block_steps_view needs the whole layout as a flat uint8 tensor")
        if self.step_nbytes % esize or self._offsets[block] % esize:
            raise ValueError("misaligned slab")  # ALIGN is a multiple of every itemsize
        rows, L, C = self.block_shape(block)
        typed = flat.view(self.torch_dtype)
        return typed.as_strided(
            (self.num_steps, rows, L, C),
            (self.step_nbytes // esize, L * C, C, 1),
            typed.storage_offset() + self._offsets[block] // esize,  # absolute, in elements
        )

    def scale_view(self, buf: Buffer, step: int, block: int) -> torch.Tensor:
        off, shape = self.scale_slab(step, block)
        return view_slab(buf, off, shape, "float32")

    def latents_view(self, buf: Buffer, step: int) -> torch.Tensor:
        off, shape = self.latents_slab(step)
        return view_slab(buf, off, shape, self.latent_dtype)

    # ---- serialization --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": LAYOUT_VERSION,
            "num_steps": self.num_steps,
            "rows": self.rows,
            "dtype": self.dtype,
            "block_shapes": [list(s) for s in self.block_shapes],
            "latent_shape": list(self.latent_shape),
            "latent_dtype": self.latent_dtype,
            "fp8_scales": self.fp8_scales,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Any) -> TemplateLayout:
        if not isinstance(d, dict) or set(d) != _FIELDS:
            raise ValueError(f"layout: expected exactly the fields {sorted(_FIELDS)}")
        if d["version"] != LAYOUT_VERSION or type(d["version"]) is not int:
            raise ValueError(f"layout: unsupported version {d['version']!r}")
        shapes, lat = d["block_shapes"], d["latent_shape"]
        if not isinstance(shapes, list) or not all(isinstance(s, list) for s in shapes):
            raise ValueError("layout: block_shapes must be a list of [L, C] lists")
        if not isinstance(lat, list):
            raise ValueError("layout: latent_shape must be a list")
        return cls(
            num_steps=d["num_steps"],
            rows=d["rows"],
            dtype=d["dtype"],
            block_shapes=tuple(tuple(s) for s in shapes),
            latent_shape=tuple(lat),
            latent_dtype=d["latent_dtype"],
            fp8_scales=d["fp8_scales"],
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> TemplateLayout:
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"layout: invalid JSON ({e})") from None
        return cls.from_dict(d)

    @classmethod
    def from_meta(cls, meta: Any, dtype: str, latent_dtype: str = "float32") -> TemplateLayout:
        """From a store.TemplateMeta whose block ids are exactly 0..n-1."""
        ids = sorted(meta.block_shapes)
        if ids != list(range(len(ids))):
            raise ValueError(f"layout: block ids must be 0..n-1, got {ids}")
        return cls(
            num_steps=meta.num_steps,
            rows=meta.num_rows,
            dtype=dtype,
            block_shapes=tuple(tuple(meta.block_shapes[i]) for i in ids),
            latent_shape=tuple(meta.latent_shape),
            latent_dtype=latent_dtype,
            fp8_scales=dtype == FP8,
        )


Buffer = torch.Tensor | memoryview | bytearray | np.ndarray


def as_uint8(buf: Buffer) -> torch.Tensor:
    """A flat uint8 CPU tensor sharing memory with buf (never a copy)."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError("buffer tensor must be a contiguous 1-D uint8 tensor")
        return buf
    # numpy keeps a buffer export on buf while the array (and so the tensor) lives: the owner
    # (e.g. an mmap) then refuses to close under a live view instead of leaving it dangling
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise ValueError("buffer array must be 1-D uint8")
    return torch.from_numpy(arr)


def view_slab(buf: Buffer, offset: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """View nbytes(shape, dtype) bytes of buf at offset as a typed tensor, without copying."""
    tdtype = DTYPES[dtype]
    flat = as_uint8(buf)
    n = math.prod(shape) * tdtype.itemsize
    if offset < 0 or offset % tdtype.itemsize or offset + n > flat.numel():
        raise ValueError(f"slab [{offset}, {offset + n}) out of buffer of {flat.numel()} bytes")
    return flat[offset : offset + n].view(tdtype).view(shape)
