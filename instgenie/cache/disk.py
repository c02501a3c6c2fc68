"""Local-disk tier: one checksummed file per template, written atomically.

File `<root>/entries/<digest>.igc` (digest = 64 lowercase hex; nothing else ever becomes a path),
in the format of disk_format.py: a checksummed header, then the data cut into chunks that never
straddle a step, so one step is read and verified on its own (streamed reads, disk_stream.py).
Checksums are xxh3-64 (xxhash): ~9 GB/s on one core against ~2 GB/s for zlib's CRC32, which
bounded reads (docs/decisions/0027-disk-tier-streaming.md). A file of an older version (1: CRC32)
is a miss: counted (`stale_format`) and removed, never misread.

Writes go to `.<digest>.<pid>.<random>.tmp` in the same directory (`EntryWriter`, disk_entry.py:
steps in any order, then the header), fsync, rename, fsync(dir): readers see the old entry or
the whole new one, never a part. A crash leaves only a temp file, removed by the next DiskTier
of the host once its writer pid is gone. Reads (`EntryReader`: one step at a time, `os.preadv`
into the caller's buffer, `posix_fadvise` SEQUENTIAL and WILLNEED for the next step) verify
every chunk they read; any mismatch moves the file to `<root>/quarantine/` and raises
CorruptEntry (the file that was read, by st_dev/st_ino: a newer entry a writer renamed over its
path meanwhile stays). Disk failures never raise from `write`: ENOSPC evicts and retries once,
then the tier switches itself off (`enabled = False`).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from instgenie.cache.disk_entry import (
    _WRITING,
    _WRITING_LOCK,
    EntryReader,
    EntryWriter,
    _OpenEntry,
)
from instgenie.cache.disk_format import (
    VERSION,
    BadFormat,
    Header,
    OlderVersion,
    data_offset,
    encode_header,
    read_header,
)
from instgenie.cache.layout import Buffer, TemplateLayout, as_uint8

# the miss types and key check live in misses.py; imported here for the tiers' users
from instgenie.cache.misses import (  # noqa: F401
    _KEY,
    CacheMiss,
    CorruptEntry,
    DiskBusy,
    StaleFormat,
    check_key,
)

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 << 20
_TMP = re.compile(r"\.([0-9a-f]{64})\.(\d+)\.[0-9a-f]{32}\.tmp")


def _ident(p: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the path itself (a symlink is not followed); None if it is gone."""
    try:
        st = os.lstat(p)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class DiskStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    quarantined: int = 0
    #: files of an older format version found (each removed)
    stale_format: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    enospc: int = 0
    evictions: int = 0
    write_errors: int = 0


#: (bytes needed, key being written) -> keys the tier may delete to make room, LRU first
VictimFn = Callable[[int, str], list[str]]


class DiskTier:
    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int | None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        choose_victims: VictimFn | None = None,
    ) -> None:
        """capacity_bytes bounds the sum of file sizes (None: the caller's index bounds it).
        choose_victims: who decides what to evict (default: least recently used file by mtime;
        reads refresh the mtime)."""
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.root = Path(root)
        self.entries_dir = self.root / "entries"
        self.quarantine_dir = self.root / "quarantine"
        for d in (self.entries_dir, self.quarantine_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.chunk_bytes = chunk_bytes
        self.choose_victims = choose_victims or self._lru_victims
        self.enabled = True
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._pwrite = os.pwrite  # tests inject failures here
        self._remove_stale_temps()

    # ---- names ----------------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.entries_dir / f"{check_key(key)}.igc"

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def keys(self) -> list[str]:
        return [k for k, _, _ in self.scan()]

    def scan(self) -> list[tuple[str, int, float]]:
        """(key, file bytes, mtime seconds) of every entry file, least recently used first."""
        out = []
        for de in os.scandir(self.entries_dir):
            if de.name.endswith(".igc") and _KEY.fullmatch(de.name[:-4]):
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append((de.name[:-4], st.st_size, st.st_mtime))
        return sorted(out, key=lambda t: t[2])

    def used_bytes(self) -> int:
        return sum(n for _, n, _ in self.scan())

    def file_nbytes(self, layout: TemplateLayout) -> int:
        """Exact size in bytes of the file holding layout (checksums are fixed-width hex)."""
        return data_offset(len(encode_header(layout, self.chunk_bytes, None))) + layout.nbytes

    # ---- write ----------------------------------------------------------------------------------
    def write(self, key: str, layout: TemplateLayout, buffer: Buffer) -> bool:
        """Store atomically; False (never an exception) when the disk cannot take it."""
        check_key(key)
        src = as_uint8(buffer)
        if src.numel() < layout.nbytes:
            raise ValueError(f"buffer of {src.numel()} bytes < layout's {layout.nbytes}")
        if not self.enabled:
            return False
        need = self.file_nbytes(layout)
        if self.capacity_bytes is not None:
            if need > self.capacity_bytes:
                return False
            used = sum(n for k, n, _ in self.scan() if k != key)
            if used + need > self.capacity_bytes:
                self._evict(used + need - self.capacity_bytes, key)
                if sum(n for k, n, _ in self.scan() if k != key) + need > self.capacity_bytes:
                    return False
        for attempt in range(2):
            try:
                self._write_file(key, layout, src)
                return True
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    log.warning("disk cache write of %s failed: %s", key[:12], e)
                    self._count(write_errors=1)
                    return False
                self._count(enospc=1)
                if attempt == 0:
                    self._evict(need, key)
        log.warning("disk cache full (ENOSPC after eviction): disk tier switched off")
        self.enabled = False
        return False

    def _write_file(self, key: str, layout: TemplateLayout, src: Any) -> None:
        """The whole entry from one buffer, through an EntryWriter (removed on any failure)."""
        w = EntryWriter(self, key, layout)
        try:
            data = memoryview(src.numpy())
            sn = layout.step_nbytes
            for s in range(layout.num_steps):
                w.write_step(s, data[s * sn : (s + 1) * sn])
            w.commit()
        finally:
            w.abort()  # a no-op after commit

    def begin(self, key: str, layout: TemplateLayout) -> EntryWriter:
        """A writer of one entry, step by step (captures streamed straight to disk)."""
        return EntryWriter(self, key, layout)

    def _pwrite_all(self, fd: int, mv: memoryview, offset: int) -> None:
        while len(mv):
            n = self._pwrite(fd, mv, offset)
            mv, offset = mv[n:], offset + n

    def _fsync_dir(self) -> None:
        dfd = os.open(self.entries_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # ---- read -----------------------------------------------------------------------------------
    def read_layout(self, key: str) -> TemplateLayout:
        """The entry's layout, header verified (CacheMiss / CorruptEntry otherwise)."""
        with self._open(key) as (f, st):
            return self._read_header(key, f.fileno(), st).layout

    def read_into(self, key: str, layout: TemplateLayout, out: Buffer) -> None:
        """Fill out[:layout.nbytes] with the entry, verifying every chunk's checksum as it
        streams in. On CacheMiss/CorruptEntry the buffer's contents are undefined."""
        dst = as_uint8(out)
        if dst.numel() < layout.nbytes:
            raise ValueError(f"buffer of {dst.numel()} bytes < layout's {layout.nbytes}")
        mv = memoryview(dst.numpy())
        sn = layout.step_nbytes
        with self.reader(key, layout) as r:
            for s in range(layout.num_steps):
                r.advise(s + 1)
                r.read_step(s, mv[s * sn : (s + 1) * sn])
        self._count(hits=1, bytes_read=r.data_offset)  # the data was counted per step
        self.touch(key)

    def reader(self, key: str, layout: TemplateLayout | None = None) -> EntryReader:
        """The entry opened for reading, header verified (and its layout == `layout` if given)."""
        return EntryReader(self, key, layout)

    def touch(self, key: str) -> None:
        """Mark as recently read (LRU by mtime)."""
        try:
            os.utime(self.path(key))
        except OSError:
            pass

    def _open(self, key: str) -> _OpenEntry:
        return _OpenEntry(self, key)

    def _read_header(self, key: str, fd: int, st: os.stat_result) -> Header:
        """st: fstat of fd (its size; its identity, for _corrupt). A bad file is quarantined
        (CorruptEntry), one of an older format removed (StaleFormat)."""
        try:
            return read_header(fd, st.st_size)
        except OlderVersion as e:
            raise self._stale(key, e.version, st) from None
        except BadFormat as e:
            raise self._corrupt(key, str(e), st) from None

    def _stale(self, key: str, version: int, read: os.stat_result) -> StaleFormat:
        """A file of an older format: count, remove it (the very file that was read, by
        identity: a newer entry renamed over its path meanwhile stays) and return the miss."""
        if _ident(self.path(key)) == (read.st_dev, read.st_ino):
            self._remove_path(self.path(key))
        self._count(stale_format=1, misses=1)
        log.info("disk cache entry %s has format version %d (now %d): removed", key[:12],
                 version, VERSION)  # fmt: skip
        return StaleFormat(f"{key[:12]}: disk format version {version}, expected {VERSION}")

    def _corrupt(self, key: str, why: str, read: os.stat_result | None) -> CorruptEntry:
        """Count, move the file that was read out of entries/ (never read again) and return the
        error. read: (l)stat of that file, which identifies it by (st_dev, st_ino); None when
        unknown (nothing is moved then)."""
        moved = read is not None and self._quarantine(key, (read.st_dev, read.st_ino))
        self._count(corrupt=1, quarantined=int(moved))
        log.warning("disk cache entry %s is corrupt (%s): %s", key[:12], why,
                    "quarantined" if moved else "not moved (gone or replaced since)")  # fmt: skip
        return CorruptEntry(f"{key[:12]}: {why}")

    def _quarantine(self, key: str, ident: tuple[int, int]) -> bool:
        """Move the entry file whose (st_dev, st_ino) is ident to quarantine/. A writer may have
        renamed a newer entry over the path since it was read: the path is moved only while it
        names that very file, so a newer entry is never quarantined (nor deleted). False when
        the file was not moved (gone, replaced meanwhile, or not movable: then deleted)."""
        src = self.path(key)
        if _ident(src) != ident:
            return False  # gone, or replaced by a newer entry: the corrupt file is unlinked
        dst = self.quarantine_dir / f"{key}.{time.time_ns()}.igc"
        try:
            os.replace(src, dst)
        except FileNotFoundError:
            return False
        except OSError:
            if _ident(src) == ident:  # as above, with a window of two syscalls
                self._remove_path(src)
            return False
        if _ident(dst) == ident:
            return True
        # a writer's rename landed between the check and ours: put its entry back (link never
        # replaces: if an even newer one is there already, ours is superseded and dropped).
        # Until then the entry is missing: a reader in that window sees a plain miss
        try:
            os.link(dst, src)
        except FileExistsError:
            pass
        except OSError as e:
            log.warning("disk cache: could not restore %s from %s: %s", src, dst, e)
            return False  # left in quarantine/: the entry is lost (a miss), never misread
        self._remove_path(dst)
        return False

    # ---- delete / evict / recover ---------------------------------------------------------------
    def delete(self, key: str) -> bool:
        """Remove the file (open readers keep reading their inode)."""
        return self._remove_path(self.path(key))

    def evict(self, key: str) -> bool:
        ok = self.delete(key)
        self._count(evictions=int(ok))
        return ok

    def try_enable(self, min_free_bytes: int = 0) -> bool:
        """Switch the tier back on when the filesystem has min_free_bytes free again."""
        try:
            st = os.statvfs(self.entries_dir)
        except OSError:
            return False
        if st.f_bavail * st.f_frsize >= min_free_bytes:
            self.enabled = True
        return self.enabled

    def _evict(self, nbytes: int, key: str) -> None:
        for victim in self.choose_victims(nbytes, key):
            if victim != key:
                self.evict(victim)

    def _lru_victims(self, nbytes: int, key: str) -> list[str]:
        out, freed = [], 0
        for k, n, _ in self.scan():
            if freed >= nbytes:
                break
            if k != key:
                out.append(k)
                freed += n
        return out

    def _remove_path(self, p: Path) -> bool:
        try:
            if p.is_dir() and not p.is_symlink():
                os.rmdir(p)
            else:
                p.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("could not remove %s: %s", p, e)
            return False

    def _remove_stale_temps(self) -> None:
        """Temp files of dead writers (or of an earlier process with our pid) are crash debris;
        those another DiskTier of this process is writing now are not."""
        for de in os.scandir(self.entries_dir):
            m = _TMP.fullmatch(de.name)
            if m and (int(m.group(2)) == os.getpid() or not _pid_alive(int(m.group(2)))):
                with _WRITING_LOCK:
                    if de.path in _WRITING:
                        continue
                self._remove_path(Path(de.path))

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return asdict(self.stats)
