"""What pinning a template's DRAM segment costs, and whether it can run beside the serving loop.

A capture registers its fresh /dev/shm segment as pinned memory (decision 0036): 5.4-6.8 s for
an 8.39 GB SDXL template on the H200 host, in the capture's first step, which every edit batched
beside it waits for (docs/benchmarks/cluster-h200.md). This measures, on one GPU host:

- `register_s`: cudaHostRegister of a fresh (fallocated, never touched) segment; after the pages
  were faulted in first (`populate_s`: madvise(MADV_POPULATE_WRITE), no CUDA call); in chunks;
- how a stand-in serving step (GEMMs plus many small kernels, synchronised, as a loop's step) is
  slowed while another thread registers, populates or memcpys a segment: the median and worst
  step against the same loop alone.

    python bench/pin_stall.py --gib 8 --out $OUT/pin_stall.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instgenie.cache import hostmem  # noqa: E402
from instgenie.cache.hostmem import pin, unpin  # noqa: E402
from instgenie.cache.layout import as_uint8  # noqa: E402
from instgenie.cache.shm_segment import close_shm, open_shm, unlink_shm  # noqa: E402


def segment(name: str, nbytes: int):
    """A fresh fallocated shm segment of `nbytes` (no page touched) and its uint8 view."""
    unlink_shm(name)
    shm = open_shm(name, nbytes)
    os.posix_fallocate(shm._fd, 0, nbytes)  # type: ignore[attr-defined]
    return shm, as_uint8(shm.buf)


def populate(t: torch.Tensor) -> None:
    """Fault every page of `t` in, writable, without writing it (no CUDA call)."""
    if not hostmem.populate(t.data_ptr(), t.numel()):
        raise OSError("this kernel has no MADV_POPULATE_WRITE")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return round(time.perf_counter() - t0, 3)


class StepLoop:
    """A stand-in serving step: 20 GEMMs of 4096² and 400 small kernels, then a sync."""

    def __init__(self) -> None:
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        self.v = torch.randn(1 << 16, device="cuda")
        self.dst = torch.empty(1 << 24, dtype=torch.uint8, pin_memory=True)
        self.src = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")

    def step(self) -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            self.a @ self.a
        for _ in range(400):
            self.v.mul_(1.0001)
        self.dst.copy_(self.src, non_blocking=True)  # a capture's D2H copy into pinned memory
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0)

    def run_beside(self, work=None) -> dict:
        """Steps until `work` (in a thread) ends, or 40 steps alone; ms per step."""
        done = threading.Event()
        took: dict = {}
        if work is not None:

            def target() -> None:
                took["s"] = timed(work)
                done.set()

            th = threading.Thread(target=target)
            th.start()
        ms = []
        while (work is not None and not done.is_set()) or (work is None and len(ms) < 40):
            ms.append(self.step())
        if work is not None:
            th.join()
        return {"steps": len(ms), "median_ms": round(statistics.median(ms), 2),
                "max_ms": round(max(ms), 2), "work_s": took.get("s")}  # fmt: skip


@contextlib.contextmanager
def fresh_segment(tag: str, nbytes: int):
    """A fresh fallocated segment's uint8 view, unmapped and unlinked on exit."""
    name = f"igc_pinbench_{tag}"
    shm, t = segment(name, nbytes)
    try:
        yield t
    finally:
        del t
        close_shm(shm)  # the caller's view may live on: the mapping lingers until it is gone
        unlink_shm(name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--chunk-mib", type=int, default=256)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    n = int(args.gib * (1 << 30)) // mmap.PAGESIZE * mmap.PAGESIZE
    out: dict = {"gib": args.gib, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save() -> None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out), flush=True)

    # 1. register alone: fresh pages, pages faulted in by a first registration, populated pages
    with fresh_segment("a", n) as t:
        out["register_fresh_s"] = timed(lambda: pin(t))
        out["unregister_s"] = timed(lambda: unpin(t))
        out["register_again_s"] = timed(lambda: pin(t))
        unpin(t)
    with fresh_segment("b", n) as t:
        out["populate_s"] = timed(lambda: populate(t))
        out["register_populated_s"] = timed(lambda: pin(t))
        unpin(t)
    save()
    # 2. beside a serving loop
    loop = StepLoop()
    for _ in range(5):
        loop.step()
    out["alone"] = loop.run_beside()
    with fresh_segment("c", n) as t:
        out["beside_register_fresh"] = loop.run_beside(lambda: pin(t))
        unpin(t)
    with fresh_segment("d", n) as t:
        out["beside_populate"] = loop.run_beside(lambda: populate(t))
        out["beside_register_populated"] = loop.run_beside(lambda: pin(t))
        unpin(t)
        chunk = args.chunk_mib << 20
        chunks = [t[i : i + chunk] for i in range(0, n, chunk)]
        per: list[float] = []

        def register_chunks() -> None:
            for c in chunks:
                per.append(timed(lambda c=c: pin(c)))

        out["beside_register_chunks"] = loop.run_beside(register_chunks)
        out["chunk_register_max_s"] = max(per)
        for c in chunks:
            unpin(c)
        chunks.clear()
        out["beside_memcpy"] = loop.run_beside(lambda: t.copy_(torch.empty_like(t)))
    out["alone_after"] = loop.run_beside()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
