"""Tensors between the processes of a worker through POSIX shared memory, one segment per bundle.

`pack` copies a dict of tensors into a new segment `<prefix>_<16 hex>` (in /dev/shm on Linux) and
returns a TensorBundle (messages.py) describing it; the bundle travels inside a message; `unpack`
maps the segment and returns the tensors. Layout: tensors in dict order, each at a 64-byte aligned
offset, as the raw bytes of the C-contiguous tensor. dtypes travel by name and are reinterpreted
from bytes with Tensor.view(dtype), so bfloat16 and float8 need no numpy dtype.

Ownership rule (a segment has exactly one owner; only the owner unlinks it):
- `pack` makes the calling process the owner. It hands ownership over by sending the bundle in a
  message to exactly one receiver and never touches the segment again. If the send fails, it
  still owns the segment and must `release` it.
- The receiver owns the segment from the moment it decodes the message: it must `release` it once
  it has what it needs (or pass `unlink=True` to `unpack`), also when the request fails or is
  aborted. Unlinking early is safe: mappings (and views from unpack(copy=False)) stay valid.
- Crash recovery: segments of a process that died are leaked until `cleanup(prefix)`. Each process
  therefore packs under its own `process_prefix(base)`; the supervisor calls
  `cleanup(process_prefix(base, pid))` when child `pid` dies, and `cleanup(base)` (every process
  of the worker) at start and exit. A receiver whose segment was cleaned up gets BundleError.
Resource tracker: segments are opened with shm_open + mmap directly, never through
multiprocessing.shared_memory, so the resource_tracker never sees them (it would unlink them when
the creating process exits, and warn about "leaks").
Views: numpy holds a buffer export on the mmap for as long as any view lives, so the mapping can
never be closed under a live view (close() then raises BufferError, which ShmHandle tolerates:
the mapping is freed with the last view). torch.frombuffer does not hold one: never use it here.
"""

from __future__ import annotations

import _posixshmem
import errno
import math
import mmap
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, overload

import numpy as np
import torch

from instgenie.errors import InstGenIEError
from instgenie.messages import TensorBundle, TensorRef

ALIGN = 64  # byte alignment of every tensor in a segment (cache line; >= every itemsize)
SHM_DIR = Path("/dev/shm")  # where Linux lists POSIX shm segments (for cleanup)
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}_[0-9a-f]{16}")
_DTYPE_NAMES = (
    "float64 float32 float16 bfloat16 complex64 complex128 int64 int32 int16 int8 uint8 uint16 "
    "uint32 uint64 bool float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz"
)
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _DTYPE_NAMES.split() if hasattr(torch, n)
}  # the dtypes a bundle may carry, by TensorRef.dtype name


class BundleError(InstGenIEError, ValueError):
    """A bundle that cannot be unpacked: malformed, or its segment is gone or too small."""

    code = "internal_error"


def process_prefix(base: str, pid: int | None = None) -> str:
    """The prefix process `pid` (default: this one) packs under: `<base>-<pid>`."""
    return _check_prefix(f"{_check_prefix(base)}-{os.getpid() if pid is None else int(pid)}")


def pack(tensors: Mapping[str, torch.Tensor], prefix: str) -> TensorBundle:
    """Copy `tensors` (any device, dtype in DTYPES, strided, contiguous or not) into a new segment
    owned by the caller (see the ownership rule). OSError (e.g. ENOSPC) if /dev/shm is full."""
    _check_prefix(prefix)
    refs, end = [], 0
    for name, t in tensors.items():
        if (
            not isinstance(name, str)
            or not isinstance(t, torch.Tensor)
            or t.layout != torch.strided
        ):
            raise TypeError(f"pack: {name!r} must map a str to a strided tensor")
        dtype = str(t.dtype).removeprefix("torch.")
        if DTYPES.get(dtype) is not t.dtype:
            raise TypeError(f"pack: {name!r} has unsupported dtype {t.dtype}")
        offset = -(-end // ALIGN) * ALIGN
        nbytes = t.numel() * t.element_size()
        refs.append(
            TensorRef(name=name, dtype=dtype, shape=list(t.shape), offset=offset, nbytes=nbytes)
        )
        end = offset + nbytes
    bundle = TensorBundle(
        segment=f"{prefix}_{secrets.token_hex(8)}", size=max(end, 1), tensors=refs
    )
    mm = _open(bundle.segment, bundle.size, create=True)
    try:
        flat = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        with torch.no_grad():
            for ref, t in zip(refs, tensors.values(), strict=True):
                _view(flat, ref).copy_(t.detach())  # strided copy; device -> host if needed
        del flat
        mm.close()
    except BaseException:
        release(bundle)
        raise
    return bundle


class ShmHandle:
    """Keeps the mapping behind unpack(copy=False) views; close() when they are no longer used."""

    def __init__(self, mm: mmap.mmap, segment: str) -> None:
        self._mm: mmap.mmap | None = mm
        self.segment = segment  # shm name, for logs

    def close(self) -> None:
        """Unmap now if no view is alive; otherwise the last view to be freed unmaps. Idempotent."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # live views hold a buffer export (and a reference) on mm

    def __enter__(self) -> ShmHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@overload
def unpack(
    bundle: TensorBundle, copy: Literal[True] = True, *, unlink: bool = False
) -> dict[str, torch.Tensor]: ...
@overload
def unpack(
    bundle: TensorBundle, copy: Literal[False], *, unlink: bool = False
) -> tuple[dict[str, torch.Tensor], ShmHandle]: ...
def unpack(
    bundle: TensorBundle, copy: bool = True, *, unlink: bool = False
) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], ShmHandle]:
    """The bundle's tensors, in pack order, bit-identical to what was packed (CPU, contiguous).

    copy=True: private copies; the mapping is closed before returning. copy=False: views of the
    segment plus the handle that keeps it mapped. unlink=True also releases the segment (the
    receiver's duty, see the ownership rule) right after mapping it, or on failure. BundleError if
    the bundle is malformed or its segment is missing or too small.
    """
    _check_bundle(bundle)
    try:
        mm = _open(bundle.segment, bundle.size, create=False)
    finally:
        if unlink:  # ownership ends here, also when the segment turns out to be unusable
            release(bundle)
    flat = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    out = {ref.name: _view(flat, ref) for ref in bundle.tensors}
    del flat
    if not copy:
        return out, ShmHandle(mm, bundle.segment)
    out = {name: t.clone() for name, t in out.items()}  # rebinding frees the views
    ShmHandle(mm, bundle.segment).close()
    return out


def release(bundle: TensorBundle | str) -> bool:
    """Unlink a bundle's segment (by bundle or name). Idempotent: False if it was already gone."""
    name = bundle.segment if isinstance(bundle, TensorBundle) else bundle
    if not isinstance(name, str) or not _SEGMENT.fullmatch(name):
        raise BundleError(f"not a tensorshm segment name: {str(name)[:80]!r}")
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False


def segments(prefix: str) -> list[str]:
    """Names of the live segments packed under `prefix` or under process_prefix(prefix, any pid)."""
    pattern = re.compile(re.escape(_check_prefix(prefix)) + r"(-[0-9]+)?_[0-9a-f]{16}")
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if pattern.fullmatch(p.name))


def cleanup(prefix: str) -> int:
    """Unlink every segment of `segments(prefix)` (crash recovery); how many were unlinked."""
    return sum(release(name) for name in segments(prefix))


# ---- internals ---------------------------------------------------------------------------------
def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(f"prefix must match {_PREFIX.pattern}, got {str(prefix)[:80]!r}")
    return prefix


def _check_bundle(bundle: TensorBundle) -> None:
    """Everything unpack relies on; a bundle comes from another process, trust nothing."""
    if not isinstance(bundle, TensorBundle) or not _SEGMENT.fullmatch(bundle.segment):
        raise BundleError(f"not a tensorshm bundle: {str(bundle)[:120]}")
    names = set()
    for ref in bundle.tensors:
        dtype = DTYPES.get(ref.dtype)
        numel = math.prod(ref.shape) if all(d >= 0 for d in ref.shape) else -1
        if (
            dtype is None
            or numel < 0
            or ref.nbytes != numel * dtype.itemsize
            or ref.offset < 0
            or ref.offset % ALIGN
            or ref.offset + ref.nbytes > bundle.size
            or ref.name in names
        ):
            raise BundleError(f"{bundle.segment}: bad tensor entry {str(ref)[:200]}")
        names.add(ref.name)
    if bundle.size < 1:
        raise BundleError(f"{bundle.segment}: bad size {bundle.size}")


def _open(name: str, size: int, create: bool) -> mmap.mmap:
    """Map a segment read-write; create it (exclusively, mode 0600, `size` bytes reserved)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
    except FileNotFoundError as e:
        raise BundleError(f"segment {name} is gone (released, or cleaned up after a crash)") from e
    try:
        if create:
            try:  # reserve the pages now: a full /dev/shm is ENOSPC here, not SIGBUS on write
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise BundleError(f"segment {name} is smaller than {size} bytes")
        return mmap.mmap(fd, size)
    except BaseException:
        if create:
            release(name)
        raise
    finally:
        os.close(fd)


def _view(flat: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """The typed tensor of `ref` inside the flat uint8 tensor of a segment (no copy)."""
    return flat[ref.offset : ref.offset + ref.nbytes].view(DTYPES[ref.dtype]).view(ref.shape)
