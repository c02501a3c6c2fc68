"""The disk tier's file format: preamble, JSON header, chunk checksums (encode and verify).

File `<root>/entries/<digest>.igc`:

    offset 0   preamble, 24 bytes little-endian: magic b"IGCACHE\\0", u32 version (2),
               u32 header_len, u64 xxh3_64(header)
    offset 24  header: JSON, sorted keys, utf-8: {"chunk_bytes", "data_bytes",
               "layout": TemplateLayout.to_dict(), "xxh3": ["%016x" per chunk]}
    data_offset = align_up(24 + header_len, 4096): the layout's buffer, data_bytes long
    file size == data_offset + data_bytes exactly

Chunks never straddle a step: step s's bytes [s * step_nbytes, (s + 1) * step_nbytes) of the data
are cut into pieces of chunk_bytes (the last one shorter), chunk index s * per_step + j with
per_step = ceil(step_nbytes / chunk_bytes). Checksums are fixed-width hex, so a header's length
is known before the data is written (the placeholder header has the final size). Pure codec:
the store's actions on a bad file (quarantine, removal, counters) are disk.py's.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import xxhash

from instgenie.cache.layout import Buffer, TemplateLayout, align_up

MAGIC = b"IGCACHE\x00"
VERSION = 2
PREAMBLE = struct.Struct("<8sIIQ")
FILE_ALIGN = 4096
MAX_HEADER_BYTES = 16 << 20
_HEADER_KEYS = {"chunk_bytes", "data_bytes", "layout", "xxh3"}
_HASH_HEX = 16  # hex digits of one xxh3-64 checksum in the header


class BadFormat(Exception):
    """The file is not a valid entry of this format; str(e) says why."""


class OlderVersion(Exception):
    """The file has an older format version (`version`): stale, never misread."""

    def __init__(self, version: int) -> None:
        super().__init__(version)
        self.version = version


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


def num_chunks(layout: TemplateLayout, chunk_bytes: int) -> int:
    return layout.num_steps * -(-layout.step_nbytes // chunk_bytes)


@dataclass(frozen=True)
class Header:
    layout: TemplateLayout
    chunk_bytes: int
    hashes: tuple[int, ...]
    data_offset: int


def encode_header(layout: TemplateLayout, chunk_bytes: int, hashes: list[int] | None) -> bytes:
    """The header's JSON bytes; hashes None: a placeholder of the final length (all zeros)."""
    n = num_chunks(layout, chunk_bytes)
    hexes = [f"{h:016x}" for h in hashes] if hashes is not None else ["0" * _HASH_HEX] * n
    h = {
        "chunk_bytes": chunk_bytes,
        "data_bytes": layout.nbytes,
        "layout": layout.to_dict(),
        "xxh3": hexes,
    }
    return json.dumps(h, sort_keys=True, separators=(",", ":")).encode()


def encode_preamble(header: bytes) -> bytes:
    return PREAMBLE.pack(MAGIC, VERSION, len(header), checksum(header))


def data_offset(header_len: int) -> int:
    """Byte offset of the data in a file whose header is header_len bytes."""
    return align_up(PREAMBLE.size + header_len, FILE_ALIGN)


def read_header(fd: int, size: int) -> Header:
    """Read and verify the preamble and header of the open file fd of `size` bytes (the whole
    file's size must match the header). BadFormat / OlderVersion on a bad file; OSError from
    the reads propagates."""
    pre = os.pread(fd, PREAMBLE.size, 0)
    if len(pre) != PREAMBLE.size:
        raise BadFormat("truncated preamble")
    magic, version, hlen, hsum = PREAMBLE.unpack(pre)
    if magic != MAGIC:
        raise BadFormat(f"bad magic {magic!r}")
    if 0 < version < VERSION:
        raise OlderVersion(version)
    if version != VERSION:
        raise BadFormat(f"bad version {version}")
    if hlen > MAX_HEADER_BYTES or PREAMBLE.size + hlen > size:
        raise BadFormat(f"bad header length {hlen}")
    raw = os.pread(fd, hlen, PREAMBLE.size)
    if len(raw) != hlen or checksum(raw) != hsum:
        raise BadFormat("header checksum mismatch")
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
        raise BadFormat(f"bad header: {e}") from None
    off = data_offset(hlen)
    if size != off + n:
        raise BadFormat(f"size {size} != {off + n} bytes")
    return Header(layout, chunk, hashes, off)
