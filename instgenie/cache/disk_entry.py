"""One disk entry opened for writing (`EntryWriter`: into a temp file, renamed into place) or for
reading (`EntryReader`: a step at a time, every chunk verified), and the open that tells a miss
from a corrupt file from a busy system (`_open_fd`). The DiskTier (disk.py) owns the directory,
the counters and quarantine; these act on one file for it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, BinaryIO

from instgenie.cache.disk_format import (
    checksum,
    data_offset,
    encode_header,
    encode_preamble,
    num_chunks,
    step_chunks,
)
from instgenie.cache.layout import TemplateLayout
from instgenie.cache.misses import _TRANSIENT, CacheMiss, DiskBusy, check_key

if TYPE_CHECKING:
    from instgenie.cache.disk import DiskTier

log = logging.getLogger(__name__)

#: temp files this process is writing now (any DiskTier instance): not debris
_WRITING: set[str] = set()
_WRITING_LOCK = threading.Lock()

#: threads reading and verifying one step's chunks at once (shared by every reader)
READ_THREADS = max(1, min(8, os.cpu_count() or 1))
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _read_pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="igc-read")
        return _POOL


def step_of(chunk: tuple[int, int, int], reader: EntryReader) -> int:
    """The step a chunk index belongs to (for messages)."""
    per_step = -(-reader.layout.step_nbytes // reader._h.chunk_bytes)
    return chunk[0] // per_step


def _open_fd(tier: DiskTier, key: str) -> tuple[int, os.stat_result]:
    """Open an entry read-only: (fd, its fstat). Missing -> CacheMiss (counted); unreadable
    (permissions, a directory, a symlink, I/O error) -> CorruptEntry (quarantined); out of file
    descriptors or memory -> DiskBusy (the entry is kept)."""
    path = tier.path(key)
    try:
        before = os.lstat(path)  # what a failed open below tried to open, if unchanged
    except OSError:
        before = None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        tier._count(misses=1)
        raise CacheMiss(f"{key[:12]} is not on disk") from None
    except OSError as e:
        if e.errno in _TRANSIENT:
            tier._count(misses=1)
            raise DiskBusy(f"{key[:12]}: cannot open it now: {e}") from None
        raise tier._corrupt(key, f"unreadable: {e}", before) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise tier._corrupt(key, "not a regular file", st)
    return fd, st


class _OpenEntry:
    """Context manager opening an entry for reading (see _open_fd); an OSError inside it
    quarantines the entry (CorruptEntry)."""

    def __init__(self, tier: DiskTier, key: str) -> None:
        self.tier, self.key = tier, key
        self.f: BinaryIO | None = None
        self.st: os.stat_result | None = None  # fstat of f

    def __enter__(self) -> tuple[BinaryIO, os.stat_result]:
        """(the open file, its fstat: size and identity)."""
        fd, st = _open_fd(self.tier, self.key)
        self.f, self.st = os.fdopen(fd, "rb", buffering=0), st
        return self.f, st  # type: ignore[return-value]

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        assert self.f is not None
        self.f.close()
        if isinstance(exc, OSError):
            raise self.tier._corrupt(self.key, f"read error: {exc}", self.st) from exc


class EntryWriter:
    """Writes one entry into its temp file, a whole step per call (any order, each step once);
    `commit` writes the header, fsyncs and renames it into place (atomic); `abort` (a no-op
    after commit) removes the temp file. OSError propagates (the caller decides: ENOSPC)."""

    def __init__(self, tier: DiskTier, key: str, layout: TemplateLayout) -> None:
        self.tier, self.key, self.layout = tier, check_key(key), layout
        self._placeholder = encode_header(layout, tier.chunk_bytes, None)
        self.data_offset = data_offset(len(self._placeholder))
        #: the file's size in bytes once committed
        self.nbytes = self.data_offset + layout.nbytes
        self._hashes: list[int | None] = [None] * num_chunks(layout, tier.chunk_bytes)
        self.tmp = tier.entries_dir / f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        with _WRITING_LOCK:
            _WRITING.add(str(self.tmp))
        try:
            self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except BaseException:
            with _WRITING_LOCK:
                _WRITING.discard(str(self.tmp))
            raise
        self.done = False

    def preallocate(self) -> None:
        """Reserve the file's blocks now: a full disk fails here (ENOSPC), before any data is
        computed for it. Filesystems without fallocate are written to as they are."""
        try:
            os.posix_fallocate(self._fd, 0, self.nbytes)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise

    def write_step(self, step: int, data: memoryview) -> None:
        """data: the step's layout.step_nbytes bytes."""
        if self.done:
            raise RuntimeError("entry writer already committed or aborted")
        self.layout._check(step)
        if len(data) != self.layout.step_nbytes:
            raise ValueError(f"step of {len(data)} bytes != layout's {self.layout.step_nbytes}")
        base = self.data_offset + step * self.layout.step_nbytes
        for i, a, n in step_chunks(self.layout, self.tier.chunk_bytes, step):
            chunk = data[a : a + n]
            self._hashes[i] = checksum(chunk)
            self.tier._pwrite_all(self._fd, chunk, base + a)

    def flush(self) -> None:
        """Write the data so far to the device (fdatasync): a capture streamed to disk calls
        it per step in the background, so dirty pages stay bounded and `commit`'s fsync, on the
        serving loop's thread, has little left to write."""
        os.fdatasync(self._fd)

    def commit(self) -> None:
        if self.done:
            raise RuntimeError("entry writer already committed or aborted")
        if any(h is None for h in self._hashes):
            raise RuntimeError(f"incomplete disk entry {self.key[:12]}: steps missing")
        header = encode_header(self.layout, self.tier.chunk_bytes, self._hashes)  # type: ignore[arg-type]
        assert len(header) == len(self._placeholder)
        pre = encode_preamble(header)
        self.tier._pwrite_all(self._fd, memoryview(pre + header), 0)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self.tmp, self.tier.path(self.key))
        self.done = True
        with _WRITING_LOCK:
            _WRITING.discard(str(self.tmp))
        self.tier._count(bytes_written=self.nbytes)
        try:
            self.tier._fsync_dir()
        except OSError as e:
            # the entry is complete, fsynced and visible under its name: stored. Only the
            # rename's durability across a power loss is unconfirmed (a reboot may find the
            # previous state: no entry, which is a miss)
            log.warning("disk cache: fsync of the directory after writing %s: %s",
                        self.key[:12], e)  # fmt: skip

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        finally:
            self.tmp.unlink(missing_ok=True)
            with _WRITING_LOCK:
                _WRITING.discard(str(self.tmp))


class EntryReader:
    """An open entry, header verified: `read_step` reads one step into the caller's buffer
    (os.preadv, no intermediate copy) and verifies its chunks. The file stays open until
    `close`: an entry deleted or replaced meanwhile is still read from the inode that was
    opened. Safe to call from several threads at once (positional reads). A failed check or read
    quarantines that file and raises CorruptEntry."""

    def __init__(self, tier: DiskTier, key: str, layout: TemplateLayout | None = None) -> None:
        self.tier, self.key = tier, key
        self._fd, self._st = _open_fd(tier, key)
        try:
            h = tier._read_header(key, self._fd, self._st)
            if layout is not None and h.layout != layout:
                raise tier._corrupt(key, "layout differs from the expected one", self._st)
        except OSError as e:
            self.close()
            raise tier._corrupt(key, f"read error: {e}", self._st) from e
        except BaseException:
            self.close()
            raise
        self.layout, self.data_offset, self._h = h.layout, h.data_offset, h
        try:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead
        except OSError:
            pass

    def read_step(self, step: int, out: memoryview) -> None:
        """out: at least layout.step_nbytes writable bytes; filled with step `step`, verified.
        The step's chunks are read and verified in parallel (READ_THREADS): one thread copies
        a few GB/s out of the page cache, a step of an SDXL 1024² template is 0.42 GB."""
        self.layout._check(step)
        n = self.layout.step_nbytes
        if len(out) < n:
            raise ValueError(f"buffer of {len(out)} bytes < step of {n}")
        base = self.data_offset + step * n
        chunks = step_chunks(self.layout, self._h.chunk_bytes, step)
        if len(chunks) == 1:
            self._read_chunk(chunks[0], base, out)
        else:
            futs = [_read_pool().submit(self._read_chunk, c, base, out) for c in chunks]
            # every chunk's read ends before the step returns or raises: a failure closes the
            # file (the caller's reader), and a read still in flight on a closed, maybe reused,
            # descriptor would fail (counted corrupt again) or read another file
            wait(futs)
            for fut in futs:
                fut.result()  # the first failure raises
        self.tier._count(bytes_read=n)

    def _read_chunk(self, chunk: tuple[int, int, int], base: int, out: memoryview) -> None:
        """Read one chunk of a step into its place in `out` and verify it."""
        i, a, ln = chunk
        view, got = out[a : a + ln], 0
        try:
            while got < ln:  # short only at EOF (a chunk is far below Linux's 2 GiB cap)
                k = os.preadv(self._fd, [view[got:]], base + a + got)
                if not k:
                    raise self.tier._corrupt(self.key, "truncated data", self._st)
                got += k
        except OSError as e:
            raise self.tier._corrupt(self.key, f"read error: {e}", self._st) from e
        if checksum(view) != self._h.hashes[i]:
            raise self.tier._corrupt(
                self.key, f"checksum mismatch in chunk {i} (step {step_of(chunk, self)})", self._st
            )

    def advise(self, step: int) -> None:
        """Ask the kernel to start reading `step` into the page cache (no-op past the end)."""
        if self._fd < 0 or not 0 <= step < self.layout.num_steps:
            return
        n = self.layout.step_nbytes
        try:
            os.posix_fadvise(self._fd, self.data_offset + step * n, n, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EntryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
