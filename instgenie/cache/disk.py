"""Local-disk tier: one checksummed file per template, written atomically.

File `<root>/entries/<digest>.igc` (digest = 64 lowercase hex; nothing else ever becomes a path):

    offset 0   preamble, 24 bytes little-endian: magic b"IGCACHE\\0", u32 version,
               u32 header_len, u32 crc32(header), 4 zero bytes
    offset 24  header: JSON, sorted keys, utf-8: {"chunk_bytes", "crc32": ["%08x" per chunk],
               "data_bytes", "layout": TemplateLayout.to_dict()}
    data_offset = align_up(24 + header_len, 4096): the layout's buffer, data_bytes long; chunk i
               covers [i * chunk_bytes, min((i + 1) * chunk_bytes, data_bytes)) of it
    file size == data_offset + data_bytes exactly

Writes go to `.<digest>.<pid>.<random>.tmp` in the same directory, fsync, rename, fsync(dir):
readers see the old entry or the whole new one, never a part. A crash leaves only a temp file,
removed by the next DiskTier of the host once its writer pid is gone. Reads verify everything
while streaming chunk by chunk into the caller's buffer; any mismatch moves the file to
`<root>/quarantine/` and raises CorruptEntry (the file that was read, by st_dev/st_ino: a newer
entry a writer renamed over its path meanwhile stays). Disk failures never raise from `write`:
ENOSPC evicts and retries once, then the tier switches itself off (`enabled = False`).
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
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from instgenie.cache.layout import Buffer, TemplateLayout, align_up, as_uint8

# the miss types and key check live in misses.py; imported here for the tiers' users
from instgenie.cache.misses import _KEY, _TRANSIENT, CacheMiss, CorruptEntry, DiskBusy, check_key  # noqa: F401

log = logging.getLogger(__name__)

MAGIC = b"IGCACHE\x00"
VERSION = 1
PREAMBLE = struct.Struct("<8sIII4x")
FILE_ALIGN = 4096
MAX_HEADER_BYTES = 16 << 20
DEFAULT_CHUNK_BYTES = 64 << 20
_TMP = re.compile(r"\.([0-9a-f]{64})\.(\d+)\.[0-9a-f]{32}\.tmp")
_HEADER_KEYS = {"chunk_bytes", "crc32", "data_bytes", "layout"}
#: temp files this process is writing now (any DiskTier instance): not debris
_WRITING: set[str] = set()
_WRITING_LOCK = threading.Lock()


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
    bytes_written: int = 0
    bytes_read: int = 0
    enospc: int = 0
    evictions: int = 0
    write_errors: int = 0


@dataclass(frozen=True)
class _Header:
    layout: TemplateLayout
    chunk_bytes: int
    crcs: tuple[int, ...]
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
        """Exact size in bytes of the file holding layout (crc32s are fixed-width hex)."""
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
        tmp = self.entries_dir / f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        with _WRITING_LOCK:
            _WRITING.add(str(tmp))
        try:
            written = self._write_tmp(key, layout, src, tmp)
        finally:
            with _WRITING_LOCK:
                _WRITING.discard(str(tmp))
        self._count(bytes_written=written)
        try:
            self._fsync_dir()
        except OSError as e:
            # the entry is complete, fsynced and visible under its name: stored. Only the
            # rename's durability across a power loss is unconfirmed (a reboot may find the
            # previous state: no entry, which is a miss)
            log.warning("disk cache: fsync of the directory after writing %s: %s", key[:12], e)

    def _write_tmp(self, key: str, layout: TemplateLayout, src: Any, tmp: Path) -> int:
        """Write the whole entry into tmp, fsync it and rename it into place; its bytes."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                data = memoryview(src.numpy())[: layout.nbytes]
                placeholder = self._header_bytes(layout, None)
                data_offset = self._data_offset(len(placeholder))
                crcs = []
                for a in range(0, layout.nbytes, self.chunk_bytes):
                    chunk = data[a : a + self.chunk_bytes]
                    crcs.append(zlib.crc32(chunk))
                    self._pwrite_all(fd, chunk, data_offset + a)
                header = self._header_bytes(layout, crcs)
                assert len(header) == len(placeholder)
                pre = PREAMBLE.pack(MAGIC, VERSION, len(header), zlib.crc32(header))
                self._pwrite_all(fd, memoryview(pre + header), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path(key))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return data_offset + layout.nbytes

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

    def _header_bytes(self, layout: TemplateLayout, crcs: list[int] | None) -> bytes:
        n_chunks = -(-layout.nbytes // self.chunk_bytes)
        crc_hex = [f"{c:08x}" for c in crcs] if crcs is not None else ["0" * 8] * n_chunks
        h = {
            "chunk_bytes": self.chunk_bytes,
            "crc32": crc_hex,
            "data_bytes": layout.nbytes,
            "layout": layout.to_dict(),
        }
        return json.dumps(h, sort_keys=True, separators=(",", ":")).encode()

    @staticmethod
    def _data_offset(header_len: int) -> int:
        return align_up(PREAMBLE.size + header_len, FILE_ALIGN)

    # ---- read -----------------------------------------------------------------------------------
    def read_layout(self, key: str) -> TemplateLayout:
        """The entry's layout, header verified (CacheMiss / CorruptEntry otherwise)."""
        with self._open(key) as (f, st):
            return self._read_header(key, f, st).layout

    def read_into(self, key: str, layout: TemplateLayout, out: Buffer) -> None:
        """Fill out[:layout.nbytes] with the entry, verifying every chunk's crc32 as it streams
        in. On CacheMiss/CorruptEntry the buffer's contents are undefined."""
        dst = as_uint8(out)
        if dst.numel() < layout.nbytes:
            raise ValueError(f"buffer of {dst.numel()} bytes < layout's {layout.nbytes}")
        mv = memoryview(dst.numpy())
        with self._open(key) as (f, st):
            h = self._read_header(key, f, st)
            if h.layout != layout:
                raise self._corrupt(key, "layout differs from the expected one", st)
            f.seek(h.data_offset)
            for i, crc in enumerate(h.crcs):
                a = i * h.chunk_bytes
                chunk = mv[a : min(a + h.chunk_bytes, layout.nbytes)]
                got = 0
                while got < len(chunk):
                    n = f.readinto(chunk[got:])
                    if not n:
                        raise self._corrupt(key, "truncated data", st)
                    got += n
                if zlib.crc32(chunk) != crc:
                    raise self._corrupt(key, f"crc mismatch in chunk {i}", st)
        self._count(hits=1, bytes_read=h.data_offset + layout.nbytes)
        try:
            os.utime(self.path(key))  # LRU by mtime
        except OSError:
            pass

    def _open(self, key: str) -> _OpenEntry:
        return _OpenEntry(self, key)

    def _read_header(self, key: str, f: BinaryIO, st: os.stat_result) -> _Header:
        """st: fstat of f (its size; its identity, for _corrupt)."""
        size = st.st_size
        pre = f.read(PREAMBLE.size)
        if len(pre) != PREAMBLE.size:
            raise self._corrupt(key, "truncated preamble", st)
        magic, version, hlen, hcrc = PREAMBLE.unpack(pre)
        if magic != MAGIC or version != VERSION:
            raise self._corrupt(key, f"bad magic/version {magic!r}/{version}", st)
        if hlen > MAX_HEADER_BYTES or PREAMBLE.size + hlen > size:
            raise self._corrupt(key, f"bad header length {hlen}", st)
        raw = f.read(hlen)
        if len(raw) != hlen or zlib.crc32(raw) != hcrc:
            raise self._corrupt(key, "header crc mismatch", st)
        try:
            d = json.loads(raw)
            if not isinstance(d, dict) or set(d) != _HEADER_KEYS:
                raise ValueError("unexpected header fields")
            layout = TemplateLayout.from_dict(d["layout"])
            chunk, n = d["chunk_bytes"], d["data_bytes"]
            if type(chunk) is not int or chunk <= 0 or n != layout.nbytes:
                raise ValueError("bad chunk or data size")
            crcs = tuple(int(c, 16) for c in d["crc32"] if len(c) == 8)
            if len(crcs) != len(d["crc32"]) or len(crcs) != -(-n // chunk):
                raise ValueError("bad crc list")
        except (ValueError, TypeError, AttributeError) as e:
            raise self._corrupt(key, f"bad header: {e}", st) from None
        data_offset = self._data_offset(hlen)
        if size != data_offset + n:
            raise self._corrupt(key, f"size {size} != {data_offset + n} bytes", st)
        return _Header(layout, chunk, crcs, data_offset)

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


class _OpenEntry:
    """Context manager opening an entry for reading: missing -> CacheMiss (counted); unreadable
    (permissions, a directory, a symlink, I/O error) -> CorruptEntry (quarantined)."""

    def __init__(self, tier: DiskTier, key: str) -> None:
        self.tier, self.key = tier, key
        self.f: BinaryIO | None = None
        self.st: os.stat_result | None = None  # fstat of f

    def __enter__(self) -> tuple[BinaryIO, os.stat_result]:
        """(the open file, its fstat: size and identity)."""
        path = self.tier.path(self.key)
        try:
            before = os.lstat(path)  # what a failed open below tried to open, if unchanged
        except OSError:
            before = None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            self.tier._count(misses=1)
            raise CacheMiss(f"{self.key[:12]} is not on disk") from None
        except OSError as e:
            if e.errno in _TRANSIENT:
                self.tier._count(misses=1)
                raise DiskBusy(f"{self.key[:12]}: cannot open it now: {e}") from None
            raise self.tier._corrupt(self.key, f"unreadable: {e}", before) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise self.tier._corrupt(self.key, "not a regular file", st)
        self.f, self.st = os.fdopen(fd, "rb", buffering=0), st
        return self.f, st  # type: ignore[return-value]

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        assert self.f is not None
        self.f.close()
        if isinstance(exc, OSError):
            raise self.tier._corrupt(self.key, f"read error: {exc}", self.st) from exc
