"""One host-DRAM template as a POSIX shared-memory segment, mapped into this process.

Segment `igc_<namespace>_<digest[:40]>` (in /dev/shm on Linux), `PAGE + ... + layout.nbytes` bytes:
    [0, 32)   magic b"IGCSHM01", u64 ready flag, u64 header_nbytes, u64 json length
    [32, ..)  JSON {"key": full digest, "layout": TemplateLayout.to_dict()}
    [header_nbytes, +layout.nbytes)  the template (see layout.py); header_nbytes is page-aligned
The ready flag is written last, after every byte of data; readers refuse a segment without it.

Resource tracker: Python < 3.13 registers every SharedMemory (created or merely attached) with the
multiprocessing resource_tracker, which unlinks it when the registering process tree exits (and
warns about "leaked" segments). Here a segment must outlive its creator as long as the host index
lists it (dram.py), so we unregister right after opening (3.13+: track=False) and unlink only
through the index (`unlink_shm`, which calls shm_unlink directly: SharedMemory.unlink() would
unregister again). Registrations happen under the host lock, so register/unregister pairs of
processes sharing one tracker never interleave.
"""

from __future__ import annotations

import _posixshmem
import json
import os
import re
import struct
import threading
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import torch

from instgenie.cache.hostmem import populate
from instgenie.cache.layout import TemplateLayout, align_up, as_uint8
from instgenie.cache.misses import CacheMiss, check_key

SEG_MAGIC = b"IGCSHM01"
SEG_HEADER = struct.Struct("<8sQQQ")
PAGE = 4096
SHM_DIR = Path("/dev/shm")
_NS = re.compile(r"[a-z0-9]{1,16}")
#: SharedMemory objects whose close() hit live views (BufferError); retried on later closes
_LINGERING: list[shared_memory.SharedMemory] = []
_LINGERING_LOCK = threading.Lock()


def check_namespace(ns: str) -> str:
    if not isinstance(ns, str) or not _NS.fullmatch(ns):
        raise ValueError(f"namespace must match [a-z0-9]{{1,16}}, got {ns!r:.40}")
    return ns


def segment_name(namespace: str, key: str) -> str:
    return f"igc_{check_namespace(namespace)}_{check_key(key)[:40]}"


# ---- shared memory without the resource tracker ------------------------------------------------
def open_shm(name: str, size: int = 0) -> shared_memory.SharedMemory:
    """Create (size > 0) or attach (size == 0), untracked (see the module docstring)."""
    try:
        return shared_memory.SharedMemory(name, create=size > 0, size=size, track=False)
    except TypeError:  # Python < 3.13: no track argument
        shm = shared_memory.SharedMemory(name, create=size > 0, size=size)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return shm


def unlink_shm(name: str) -> bool:
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False


def close_shm(shm: shared_memory.SharedMemory) -> None:
    """Unmap; while a caller still holds views, keep the mapping alive (never a dangling view)."""
    with _LINGERING_LOCK:
        for s in [*_LINGERING, shm]:
            try:
                s.close()
                if s in _LINGERING:
                    _LINGERING.remove(s)
            except BufferError:
                if s not in _LINGERING:
                    _LINGERING.append(s)


def cleanup(namespace: str) -> int:
    """Unlink every segment of a namespace (tests, operators); returns how many."""
    prefix = f"igc_{check_namespace(namespace)}_"
    if not SHM_DIR.is_dir():
        return 0
    return sum(unlink_shm(p.name) for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


# ---- one segment -------------------------------------------------------------------------------
class Segment:
    """A template's segment mapped into this process; `data` is a zero-copy uint8 view."""

    def __init__(
        self,
        shm: shared_memory.SharedMemory,
        key: str,
        layout: TemplateLayout,
        hdr: int | None = None,
    ) -> None:
        """hdr: the header's size in bytes (None: read it from the segment)."""
        self.shm, self.key, self.layout = shm, key, layout
        if hdr is None:
            _, _, hdr, _ = SEG_HEADER.unpack_from(shm.buf)
        self.data: torch.Tensor | None = as_uint8(shm.buf)[hdr : hdr + layout.nbytes]
        #: the mapping's first byte (host address)
        self._base = self.data.data_ptr() - hdr
        #: identity of the shared-memory object this mapping shows (a name can be reused)
        self.inode = os.fstat(shm._fd).st_ino  # type: ignore[attr-defined]
        #: open handles of this process on this mapping (DramTier.attach / release)
        self.users = 0
        #: set by whoever registered the mapping as pinned memory (host_store); the DramTier's
        #: on_unmap hook undoes it before the mapping is closed
        self.pinned: object = None

    def shows(self, namespace: str) -> bool:
        """Whether the segment's name still names the object this mapping shows."""
        try:
            return (SHM_DIR / segment_name(namespace, self.key)).stat().st_ino == self.inode
        except OSError:
            return False

    @staticmethod
    def _meta(key: str, layout: TemplateLayout) -> tuple[bytes, int]:
        """(header JSON, header bytes rounded up to a page)."""
        meta = json.dumps({"key": key, "layout": layout.to_dict()}).encode()
        return meta, align_up(SEG_HEADER.size + len(meta), PAGE)

    @classmethod
    def create(cls, namespace: str, key: str, layout: TemplateLayout) -> Segment:
        """Create the named segment at its full size without touching a page: `allocate` backs
        the pages and writes the header (a write into an unbacked page of a full /dev/shm is a
        SIGBUS, not an error)."""
        name = segment_name(namespace, key)
        hdr = cls._meta(key, layout)[1]
        try:
            shm = open_shm(name, hdr + layout.nbytes)
        except FileExistsError:  # debris not listed by the index (we hold the reservation)
            unlink_shm(name)
            shm = open_shm(name, hdr + layout.nbytes)
        return cls(shm, key, layout, hdr)

    @classmethod
    def attach(cls, namespace: str, key: str) -> Segment:
        """Map a ready segment (CacheMiss if missing, foreign, damaged or not ready)."""
        try:
            shm = open_shm(segment_name(namespace, key))
        except FileNotFoundError:
            raise CacheMiss(f"{key[:12]}: no shared-memory segment") from None
        try:
            magic, ready, hdr, n = SEG_HEADER.unpack_from(shm.buf)
            meta = json.loads(bytes(shm.buf[SEG_HEADER.size : SEG_HEADER.size + n]))
            layout = TemplateLayout.from_dict(meta["layout"])
            if magic != SEG_MAGIC or meta["key"] != key or hdr + layout.nbytes > shm.size:
                raise ValueError("foreign or damaged segment")
            if ready != 1:
                raise ValueError("segment not ready")
        except (ValueError, KeyError, TypeError, struct.error) as e:
            close_shm(shm)
            raise CacheMiss(f"{key[:12]}: {e}") from None
        return cls(shm, key, layout)

    def allocate(self, back_data: bool = True) -> None:
        """Back every page, then write the header (not ready yet): on a full /dev/shm this
        raises OSError(ENOSPC) before any page is written, instead of a SIGBUS. back_data=False
        backs the header's pages only: whoever writes the data backs each range first (`back`;
        a capture's staging threads, off the loop: capture_stage.py)."""
        meta, hdr = self._meta(self.key, self.layout)
        size = self.shm.size if back_data else hdr
        os.posix_fallocate(self.shm._fd, 0, size)  # type: ignore[attr-defined]
        SEG_HEADER.pack_into(self.shm.buf, 0, SEG_MAGIC, 0, hdr, len(meta))
        self.shm.buf[SEG_HEADER.size : SEG_HEADER.size + len(meta)] = meta

    def back(self, ptr: int, nbytes: int) -> None:
        """Back the pages under this mapping's bytes [ptr, ptr + nbytes) (host addresses), so
        that writing them cannot SIGBUS: OSError instead (a full /dev/shm). Pages are allocated
        and faulted in by madvise (threads run it in parallel; fallocate holds the file's lock),
        or by fallocate on kernels without MADV_POPULATE_WRITE. Backed pages stay as they are."""
        lo = (ptr - self._base) // PAGE * PAGE
        hi = min(align_up(ptr - self._base + nbytes, PAGE), self.shm.size)
        if lo < 0 or hi <= lo:
            raise ValueError(f"bytes [{ptr:#x}, +{nbytes}) are not in this mapping")
        if not populate(self._base + lo, hi - lo):
            os.posix_fallocate(self.shm._fd, lo, hi - lo)  # type: ignore[attr-defined]

    def set_ready(self) -> None:
        struct.pack_into("<Q", self.shm.buf, 8, 1)

    @property
    def is_ready(self) -> bool:
        return struct.unpack_from("<Q", self.shm.buf, 8)[0] == 1

    def close(self) -> None:
        if getattr(self, "data", None) is not None:
            self.data = None
            close_shm(self.shm)

    def __del__(self) -> None:
        # drop our own view before SharedMemory.__del__ tries to unmap under it
        try:
            self.close()
        except Exception:  # interpreter shutdown: module globals may be gone
            pass
