"""A PNG encoder that filters and deflates bands of rows on a thread pool (ExecConfig
png_compression "fast"; decision 0053).

Pillow encodes a PNG on one core, and most of its time at zlib level 1 is its row filtering, not
the deflate (docs/benchmarks/png-encoding.md: level 0 took 104 of 142 ms). Here the rows are cut
into bands; each band is filtered with PNG's adaptive heuristic (per row the filter of the least
sum of absolute signed bytes among None, Sub, Up and Paeth, the heuristic libpng and Pillow
use, so the bytes match Pillow's within a few per mille) by vectorised numpy, and deflated as a
raw deflate segment ending on a full flush (byte-aligned, no back-reference into the next band)
— numpy and zlib release the GIL, so bands run in parallel. The segments, after one zlib header
and before the Adler-32 of every filtered byte, make one valid zlib stream in one IDAT chunk
(how pigz joins its blocks). Filters read the row above, which a band takes from its neighbour's
last unfiltered row, so the output does not depend on the band count.

Units: rows and bytes. Images are (H, W, 3) uint8 RGB (8-bit truecolour, no interlace).
"""

from __future__ import annotations

import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: bands are at least this many rows (fewer, larger bands for small images)
MIN_BAND_ROWS = 32
#: threads of the shared pool (the post-processing process's cores, at most 8)
THREADS = max(1, min(8, os.cpu_count() or 1))
_FILTERS = (0, 1, 2, 4)  # None, Sub, Up, Paeth (PNG filter type bytes)
_POOL: ThreadPoolExecutor | None = None
_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(THREADS, thread_name_prefix="png")
    return _POOL


def _filtered(x: np.ndarray, prev: np.ndarray, bpp: int) -> np.ndarray:
    """(h, 1 + n) filtered rows of band `x` (h, n) uint8, each led by its filter type byte;
    `prev` (n,): the unfiltered row above the band (zeros above the image)."""
    up = np.empty_like(x)
    up[0], up[1:] = prev, x[:-1]
    left = np.zeros_like(x)
    left[:, bpp:] = x[:, :-bpp]
    upleft = np.zeros_like(x)
    upleft[:, bpp:] = up[:, :-bpp]
    a, b, c = (t.astype(np.int16) for t in (left, up, upleft))
    pa, pb, pc = np.abs(b - c), np.abs(a - c), np.abs(a + b - 2 * c)
    paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, upleft))
    candidates = np.stack([x, x - left, x - up, x - paeth])  # uint8 arithmetic wraps: mod 256
    cost = np.abs(candidates.view(np.int8).astype(np.int16)).sum(axis=2, dtype=np.int64)
    best = cost.argmin(axis=0)  # ties: the lower filter type, as libpng
    h, n = x.shape
    out = np.empty((h, 1 + n), dtype=np.uint8)
    out[:, 0] = np.asarray(_FILTERS, dtype=np.uint8)[best]
    out[:, 1:] = candidates[best, np.arange(h)]
    return out


def _band(x: np.ndarray, prev: np.ndarray, bpp: int, level: int, strategy: int,
          last: bool) -> tuple[int, bytes, int]:  # fmt: skip
    """(Adler-32 of the band's filtered bytes, its raw deflate segment, their count)."""
    raw = _filtered(x, prev, bpp).reshape(-1)
    co = zlib.compressobj(level, zlib.DEFLATED, -15, 9, strategy)
    seg = co.compress(raw) + co.flush(zlib.Z_FINISH if last else zlib.Z_FULL_FLUSH)
    return zlib.adler32(raw), seg, len(raw)


def _adler_combine(a1: int, a2: int, len2: int) -> int:
    """Adler-32 of A + B from adler(A), adler(B) and len(B) (zlib's adler32_combine)."""
    base = 65521
    rem = len2 % base
    s1 = a1 & 0xFFFF
    s2 = (rem * s1) % base
    s1 += (a2 & 0xFFFF) + base - 1
    s2 += (a1 >> 16) + (a2 >> 16) + base - rem
    s1 %= base
    s2 %= base
    return (s2 << 16) | s1


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(rgb: np.ndarray, level: int, strategy: int = zlib.Z_DEFAULT_STRATEGY,
               bands: int | None = None) -> bytes:  # fmt: skip
    """PNG bytes of `rgb` (H, W, 3) uint8 at zlib `level` / `strategy`, in `bands` bands (None:
    one per thread, each of at least MIN_BAND_ROWS rows)."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or 0 in rgb.shape:
        raise ValueError(f"expected a non-empty (H, W, 3) uint8 image, got {rgb.dtype} {rgb.shape}")
    H, W, bpp = rgb.shape
    x = np.ascontiguousarray(rgb).reshape(H, W * bpp)
    n = bands if bands is not None else max(1, min(THREADS, H // MIN_BAND_ROWS))
    rows = -(-H // max(1, min(n, H)))
    starts = range(0, H, rows)
    zero = np.zeros(W * bpp, dtype=np.uint8)
    jobs = [(x[s : s + rows], x[s - 1] if s else zero, bpp, level, strategy, s + rows >= H)
            for s in starts]  # fmt: skip
    if len(jobs) == 1:
        parts = [_band(*jobs[0])]
    else:
        parts = list(_pool().map(lambda job: _band(*job), jobs))
    adler = 1
    for a, _, length in parts:
        adler = _adler_combine(adler, a, length)
    # zlib header: deflate, 32 KiB window; FLEVEL names the level class (what readers show)
    flevel = 0 if level <= 1 else 1 if level <= 5 else 2 if level == 6 else 3
    cmf, flg = 0x78, flevel << 6
    flg |= 31 - ((cmf << 8) | flg) % 31
    stream = bytes((cmf, flg)) + b"".join(seg for _, seg, _ in parts) + struct.pack(">I", adler)
    header = struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return _SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", stream) + _chunk(b"IEND", b"")
