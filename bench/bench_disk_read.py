"""Disk-tier read and verification throughput on this machine (docs/decisions/0027).

    python bench/bench_disk_read.py [--dir DIR] [--gib 1.0] [--repeat 3]

Prints GB/s (1e9 bytes per second) of: crc32 (zlib) vs xxh3-64 (xxhash) over a 256 MiB buffer;
reading a file of --gib GiB into a preallocated page-aligned buffer in 64 MiB pieces, with the
page cache warm and cold (posix_fadvise(DONTNEED) first), buffered (readinto / os.preadv,
fadvise SEQUENTIAL) and O_DIRECT; and cold buffered reads that verify each piece with xxh3 as
the disk tier's streamed handle does. Best of --repeat runs each.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
import zlib

import xxhash

PIECE = 64 << 20
ALIGN = 4096


def best(fn, repeat: int, nbytes: int) -> float:
    """GB/s of the fastest of `repeat` calls of fn (each processes nbytes)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_file(
    path: str, buf: mmap.mmap, *, direct: bool, preadv: bool, verify: bool, piece: int = PIECE
) -> None:
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        size, off = os.fstat(fd).st_size, 0
        mv = memoryview(buf)
        f = None if preadv else os.fdopen(os.dup(fd), "rb", buffering=0)
        try:
            while off < size:
                n = min(piece, size - off)
                dst = mv[:n] if not direct else mv[: (n + ALIGN - 1) // ALIGN * ALIGN]
                got = os.preadv(fd, [dst], off) if preadv or direct else f.readinto(dst)
                if got <= 0:
                    raise OSError(f"short read at {off}")
                if verify:
                    xxhash.xxh3_64_intdigest(mv[:got])
                off += got
        finally:
            if f is not None:
                f.close()
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()

    data = mmap.mmap(-1, 256 << 20)
    data.write(os.urandom(1 << 20) * 256)
    mv = memoryview(data)
    for name, fn in (("crc32 (zlib)", zlib.crc32), ("xxh3-64", xxhash.xxh3_64_intdigest)):
        print(f"{name:24s}       {best(lambda fn=fn: fn(mv), a.repeat, len(mv)):6.2f} GB/s")

    nbytes = int(a.gib * (1 << 30)) // PIECE * PIECE
    fd, path = tempfile.mkstemp(dir=a.dir, suffix=".bench")
    try:
        for off in range(0, nbytes, len(mv)):
            os.pwrite(fd, mv[: min(len(mv), nbytes - off)], off)
        os.fsync(fd)
        os.close(fd)
        buf = mmap.mmap(-1, 4 * PIECE)  # page-aligned, as O_DIRECT requires
        cases = [
            ("buffered readinto", dict(direct=False, preadv=False, verify=False)),
            ("buffered preadv", dict(direct=False, preadv=True, verify=False)),
            ("buffered preadv + xxh3", dict(direct=False, preadv=True, verify=True)),
            ("O_DIRECT preadv", dict(direct=True, preadv=True, verify=False)),
            (
                "O_DIRECT preadv 256 MiB",
                dict(direct=True, preadv=True, verify=False, piece=4 * PIECE),
            ),
        ]
        for name, kw in cases:
            for warm in (True, False):
                if kw["direct"] and warm:
                    continue  # O_DIRECT bypasses the page cache

                def run(kw=kw, warm=warm):
                    if not warm:
                        drop_cache(path)
                    read_file(path, buf, **kw)

                try:
                    run()  # warms the cache for the warm case
                    gbs = best(run, a.repeat, nbytes)
                    state = "warm" if warm else "cold"
                    print(f"{name:24s} {state}  {gbs:6.2f} GB/s")
                except OSError as e:
                    print(f"{name:24s} failed: {e}")
    finally:
        os.unlink(path)
    print(
        f"({nbytes / 1e9:.2f} GB file in {a.dir}, {PIECE >> 20} MiB reads, "
        f"{os.cpu_count()} CPUs, best of {a.repeat})"
    )


if __name__ == "__main__":
    main()
