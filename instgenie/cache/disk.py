"""Local-disk tier: one checksummed file per template, written atomically.

File `<root>/entries/<digest>.igc` (digest = 64 lowercase hex; nothing else ever becomes a path):

    offset 0   preamble, 24 bytes little-endian: magic b"IGCACHE\\0", u32 version (2),
               u32 header_len, u64 xxh3_64(header)
    offset 24  header: JSON, sorted keys, utf-8: {"chunk_bytes", "data_bytes",
               "layout": TemplateLayout.to_dict(), "xxh3": ["%016x" per chunk]}
    data_offset = align_up(24 + header_len, 4096): the layout's buffer, data_bytes long
    file size == data_offset + data_bytes exactly

Chunks never straddle a step: step s's bytes [s * step_nbytes, (s + 1) * step_nbytes) of the data
are cut into pieces of chunk_bytes (the last one shorter), chunk index s * per_step + j with
per_step = ceil(step_nbytes / chunk_bytes); so one step is read and verified on its own (streamed
reads, disk_stream.py). Checksums are xxh3-64 (xxhash): ~9 GB/s on one core against ~2 GB/s for
zlib's CRC32, which bounded reads (docs/decisions/0027-disk-tier-streaming.md). A file of an
older version (1: CRC32) is a miss: counted (`stale_format`) and removed, never misread.

Writes go to `.<digest>.<pid>.<random>.tmp` in the same directory (`EntryWriter`: steps in any
order, then the header), fsync, rename, fsync(dir): readers see the old entry or the whole new
one, never a part. A crash leaves only a temp file, removed by the next DiskTier of the host once
its writer pid is gone. Reads (`EntryReader`: one step at a time, `os.preadv` into the caller's
buffer, `posix_fadvise` SEQUENTIAL and WILLNEED for the next step) verify every chunk they read;
any mismatch moves the file to `<root>/quarantine/` and raises CorruptEntry (the file that was
read, by st_dev/st_ino: a newer entry a writer renamed over its path meanwhile stays). Disk
failures never raise from `write`: ENOSPC evicts and retries once, then the tier switches itself
off (`enabled = False`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from instgenie.cache.layout import Buffer, TemplateLayout, align_up, as_uint8

# the miss types and key check live in misses.py; imported here for the tiers' users
from instgenie.cache.misses import (  # noqa: F401
    _KEY,
    _TRANSIENT,
    CacheMiss,
    CorruptEntry,
    DiskBusy,
    StaleFormat,
    check_key,
)

log = logging.getLogger(__name__)

MAGIC = b"IGCACHE\x00"
VERSION = 2
PREAMBLE = struct.Struct("<8sIIQ")
FILE_ALIGN = 4096
MAX_HEADER_BYTES = 16 << 20
DEFAULT_CHUNK_BYTES = 64 << 20
_TMP = re.compile(r"\.([0-9a-f]{64})\.(\d+)\.[0-9a-f]{32}\.tmp")
_HEADER_KEYS = {"chunk_bytes", "data_bytes", "layout", "xxh3"}
_HASH_HEX = 16  # hex digits of one xxh3-64 checksum in the header
#: temp files this process is writing now (any DiskTier instance): not debris
_WRITING: set[str] = set()
_WRITING_LOCK = threading.Lock()


def checksum(data: Buffer) -> int:
    """xxh3-64 of a bytes-like object (no copy)."""
    return xxhash.xxh3_64_intdigest(data)


def step_chunks(layout: TemplateLayout, chunk_bytes: int, step: int) -> list[tuple[int, int, int]]:
    """(chunk index, offset within the step, length) of every chunk of `step`, in bytes."""
    sn = layout.step_nbytes
    per_step = -(-sn // chunk_bytes)
    return [
        (step * per_step + j, j * chunk_bytes, min(chunk_bytes, sn - j * chunk_bytes))
        for j in range(per_step)
    ]


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


def num_chunks(layout: TemplateLayout, chunk_bytes: int) -> int:
    return layout.num_steps * -(-layout.step_nbytes // chunk_bytes)


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


@dataclass(frozen=True)
class _Header:
    layout: TemplateLayout
    chunk_bytes: int
    hashes: tuple[int, ...]
    data_offset: int


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
        return self._data_offset(len(self._header_bytes(layout, None))) + layout.nbytes

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

    def _header_bytes(self, layout: TemplateLayout, hashes: list[int] | None) -> bytes:
        n = num_chunks(layout, self.chunk_bytes)
        hexes = [f"{h:016x}" for h in hashes] if hashes is not None else ["0" * _HASH_HEX] * n
        h = {
            "chunk_bytes": self.chunk_bytes,
            "data_bytes": layout.nbytes,
            "layout": layout.to_dict(),
            "xxh3": hexes,
        }
        return json.dumps(h, sort_keys=True, separators=(",", ":")).encode()

    @staticmethod
    def _data_offset(header_len: int) -> int:
        return align_up(PREAMBLE.size + header_len, FILE_ALIGN)

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

    def _read_header(self, key: str, fd: int, st: os.stat_result) -> _Header:
        """st: fstat of fd (its size; its identity, for _corrupt)."""
        size = st.st_size
        pre = os.pread(fd, PREAMBLE.size, 0)
        if len(pre) != PREAMBLE.size:
            raise self._corrupt(key, "truncated preamble", st)
        magic, version, hlen, hsum = PREAMBLE.unpack(pre)
        if magic != MAGIC:
            raise self._corrupt(key, f"bad magic {magic!r}", st)
        if 0 < version < VERSION:
            raise self._stale(key, version, st)
        if version != VERSION:
            raise self._corrupt(key, f"bad version {version}", st)
        if hlen > MAX_HEADER_BYTES or PREAMBLE.size + hlen > size:
            raise self._corrupt(key, f"bad header length {hlen}", st)
        raw = os.pread(fd, hlen, PREAMBLE.size)
        if len(raw) != hlen or checksum(raw) != hsum:
            raise self._corrupt(key, "header checksum mismatch", st)
        try:
            d = json.loads(raw)
            if not isinstance(d, dict) or set(d) != _HEADER_KEYS:
                raise ValueError("unexpected header fields")
            layout = TemplateLayout.from_dict(d["layout"])
            chunk, n = d["chunk_bytes"], d["data_bytes"]
            if type(chunk) is not int or chunk <= 0 or n != layout.nbytes:
                raise ValueError("bad chunk or data size")
            hexes = d["xxh3"]
            if not isinstance(hexes, list) or not all(isinstance(h, str) for h in hexes):
                raise ValueError("bad checksum list")
            hashes = tuple(int(h, 16) for h in hexes if len(h) == _HASH_HEX)
            if len(hashes) != len(hexes) or len(hashes) != num_chunks(layout, chunk):
                raise ValueError("bad checksum list")
        except (ValueError, TypeError, AttributeError) as e:
            raise self._corrupt(key, f"bad header: {e}", st) from None
        data_offset = self._data_offset(hlen)
        if size != data_offset + n:
            raise self._corrupt(key, f"size {size} != {data_offset + n} bytes", st)
        return _Header(layout, chunk, hashes, data_offset)

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
        self._placeholder = tier._header_bytes(layout, None)
        self.data_offset = tier._data_offset(len(self._placeholder))
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
        header = self.tier._header_bytes(self.layout, self._hashes)  # type: ignore[arg-type]
        assert len(header) == len(self._placeholder)
        pre = PREAMBLE.pack(MAGIC, VERSION, len(header), checksum(header))
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
            for fut in [_read_pool().submit(self._read_chunk, c, base, out) for c in chunks]:
                fut.result()  # the first failure raises (the others finish: out stays valid)
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
