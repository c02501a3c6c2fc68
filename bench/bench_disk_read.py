"""Disk-tier read and verification throughput on this machine (docs/decisions/0027).

    python bench/bench_disk_read.py [--dir DIR] [--gib 1.0] [--repeat 3]

Prints GB/s (1e9 bytes per second) of: crc32 (zlib) vs xxh3-64 (xxhash) over a 256 MiB buffer;
reading a file of --gib GiB into a preallocated page-aligned buffer in 64 MiB pieces, with the
page cache warm and cold (posix_fadvise(DONTNEED) first), buffered (readinto / os.preadv,
fadvise SEQUENTIAL) and O_DIRECT; cold buffered reads that verify each piece with xxh3; and the
disk tier itself: a template of the same size captured straight to disk (DRAM tier smaller than
it) and streamed back step by step through a StreamedTemplate, cold and warm. Best of --repeat
runs each.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
import zlib

import torch
import xxhash

from instgenie.cache.layout import TemplateLayout
from instgenie.cache.tiered import TieredStore

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


def bench_tier(a: argparse.Namespace, nbytes: int) -> None:
    """Capture to disk, then stream every step (as an edit reads them), cold and warm."""
    steps = 8
    rows = max(1, nbytes // steps // (4096 * 1024 * 4))
    lay = TemplateLayout(steps, 1, "float32", ((4096 * rows, 1024),), (1, 4, 8, 8))
    block = torch.randn(lay.block_shape(0))
    with tempfile.TemporaryDirectory(dir=a.dir) as root:
        ns = "bench" + str(os.getpid())[-8:]
        with TieredStore(root, ns, lay.nbytes // 2, 4 * lay.nbytes) as store:
            key = "b" * 64
            t0 = time.perf_counter()
            with store.writer(key, lay) as w:
                for s in range(steps):
                    w.put_block(s, 0, block)
                    w.put_latents(s, torch.zeros(lay.latent_shape))
                w.commit()
            gbs = lay.nbytes / (time.perf_counter() - t0) / 1e9
            print(f"{'capture to disk':24s}       {gbs:6.2f} GB/s (incl. fdatasync per step)")
            for warm in (False, True):

                def stream(warm=warm):
                    if not warm:
                        drop_cache(str(store.disk.path(key)))
                    with store.acquire(key, stream=True) as h:
                        for s in range(steps):
                            h.block(s, 0)
                            h.latents(s)

                stream()
                gbs = best(stream, a.repeat, lay.nbytes)
                print(f"{'streamed handle':24s} {'warm' if warm else 'cold'}  {gbs:6.2f} GB/s")


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
    bench_tier(a, nbytes)
    print(
        f"({nbytes / 1e9:.2f} GB file in {a.dir}, {PIECE >> 20} MiB reads, "
        f"{os.cpu_count()} CPUs, best of {a.repeat})"
    )


if __name__ == "__main__":
    main()
