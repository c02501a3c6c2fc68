"""TieredStore: writer -> DRAM -> demotion to disk -> acquire back, prefetch, failures."""

from __future__ import annotations

import errno
import gc
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from instgenie.cache.disk import CacheMiss, DiskBusy, DiskTier
from instgenie.cache.disk_stream import DiskTemplateWriter
from instgenie.cache.index import EntryInUse
from instgenie.cache.layout import TemplateLayout
from instgenie.cache.shm_segment import cleanup
from instgenie.cache.tiered import TieredStore

LAYOUT = TemplateLayout(3, 2, "bfloat16", ((48, 32), (24, 16)), (1, 4, 8, 8))
N = LAYOUT.nbytes
KEYS = [c * 64 for c in "abcdef"]
KA, KB, KC, KD, KE, KF = KEYS


@pytest.fixture
def ns() -> str:
    name = "t" + uuid.uuid4().hex[:12]
    yield name
    cleanup(name)
    assert not list(Path("/dev/shm").glob(f"igc_{name}_*"))


def make(tmp_path: Path, ns: str, dram: int = 2, disk: int = 10, **kw) -> TieredStore:  # noqa: ANN003
    return TieredStore(tmp_path, ns, dram * N, disk * N, chunk_bytes=4096, **kw)


@pytest.fixture
def store(tmp_path: Path, ns: str) -> TieredStore:
    s = make(tmp_path, ns)
    yield s
    s.close()


def template(layout: TemplateLayout, seed: int) -> dict[tuple, torch.Tensor]:
    """Random tensors for every slab: ("y", step, block), ("s", step, block), ("lat", step)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[tuple, torch.Tensor] = {}
    for s in range(layout.num_steps):
        for b in range(layout.num_blocks):
            out[("y", s, b)] = torch.randn(layout.block_shape(b), generator=g).to(
                layout.torch_dtype
            )
            if layout.fp8_scales:
                out[("s", s, b)] = torch.rand(*layout.block_shape(b)[:2], 1, generator=g)
        out[("lat", s)] = torch.randn(layout.latent_shape, generator=g)
    return out


def write(store: TieredStore, key: str, seed: int, layout: TemplateLayout = LAYOUT) -> dict:
    t = template(layout, seed)
    with store.writer(key, layout) as w:
        for s in range(layout.num_steps):
            for b in range(layout.num_blocks):
                w.put_block(s, b, t[("y", s, b)], scale=t.get(("s", s, b)))
            w.put_latents(s, t[("lat", s)])
        w.commit()
    return t


def assert_same(store: TieredStore, key: str, t: dict) -> None:
    """Every slab bit for bit."""
    with store.acquire(key) as h:
        lay = h.layout
        for s in range(lay.num_steps):
            for b in range(lay.num_blocks):
                got, want = h.block(s, b), t[("y", s, b)]
                assert got.dtype == want.dtype
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                if lay.fp8_scales:
                    assert torch.equal(h.scales(s, b), t[("s", s, b)])
            assert torch.equal(h.latents(s), t[("lat", s)])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_replay_through_disk_is_bit_exact(tmp_path: Path, ns: str, dtype: str) -> None:
    lay = TemplateLayout(3, 2, dtype, ((48, 32), (24, 16)), (1, 4, 8, 8), "float32",
                         fp8_scales=dtype == "float8_e4m3fn")  # fmt: skip
    with TieredStore(tmp_path, ns, lay.nbytes, 10 * lay.nbytes, chunk_bytes=4096) as store:
        t = write(store, KA, 1, lay)
        assert store.status(KA) == "dram"
        write(store, KB, 2, lay)  # capacity pressure demotes KA
        assert (store.status(KA), store.status(KB)) == ("disk", "dram")
        assert_same(store, KA, t)  # loaded back, checksums verified
        st = store.stats()
        assert st["demotions"] == 2 and st["hits_disk"] == 1 and st["corrupt"] == 0
        assert st["entries_dram"] == 1 and st["entries_disk"] == 2


def test_status_and_counters(store: TieredStore) -> None:
    assert store.status(KA) == "absent"
    w = store.writer(KA, LAYOUT)
    assert store.status(KA) == "building"
    with pytest.raises(CacheMiss):  # a capture in progress is not waited for
        store.acquire(KA)
    w.abort()
    assert store.status(KA) == "absent"
    t = write(store, KA, 1)
    assert_same(store, KA, t)
    with pytest.raises(CacheMiss):
        store.acquire(KB)
    s = store.stats()
    assert (s["hits_dram"], s["hits_disk"], s["misses"]) == (1, 0, 2)
    assert s["bytes_dram"] == N and s["entries_dram"] == 1 and s["disk_enabled"]


def test_writer_validation(store: TieredStore) -> None:
    with store.writer(KA, LAYOUT) as w:
        with pytest.raises(ValueError):
            w.put_block(0, 0, torch.zeros(2, 48, 31))
        with pytest.raises(IndexError):
            w.put_block(3, 0, torch.zeros(2, 48, 32))
        w.put_block(0, 0, torch.zeros(2, 48, 32))
        with pytest.raises(RuntimeError, match="incomplete"):
            w.commit()
    assert store.status(KA) == "absent"
    with pytest.raises(ZeroDivisionError), store.writer(KA, LAYOUT):
        1 / 0  # noqa: B018
    assert store.status(KA) == "absent"
    write(store, KA, 1)
    with pytest.raises(ValueError):
        store.writer(KA, LAYOUT)
    assert store.persist(KA)
    store.dram.delete(KA)
    with pytest.raises(ValueError):  # on disk only: a capture must not shadow it
        store.writer(KA, LAYOUT)
    with pytest.raises(ValueError):
        store.writer("../" + "a" * 61, LAYOUT)


def test_entries_in_use_are_never_evicted(store: TieredStore) -> None:
    ta = write(store, KA, 1)
    with store.acquire(KA) as h:
        before = h.block(2, 1).clone()
        for i, k in enumerate([KB, KC, KD]):
            write(store, k, 10 + i)  # churn: only the unused entry rotates
            assert store.status(KA) == "dram"
        with store.acquire(KD):
            # both DRAM slots are in use: a capture goes straight to disk instead
            with store.writer(KE, LAYOUT) as w:
                assert isinstance(w, DiskTemplateWriter)
                assert store.status(KA) == store.status(KD) == "dram"
            with pytest.raises(EntryInUse):
                store.delete(KA)
        assert torch.equal(h.block(2, 1), before)
    assert_same(store, KA, ta)


def _corrupt_file(store: TieredStore, key: str) -> Path:
    assert store.persist(key)
    store.dram.delete(key)
    assert store.status(key) == "disk"
    return store.disk.path(key)


def test_corrupt_disk_entry_is_a_counted_miss(store: TieredStore, ns: str) -> None:
    write(store, KA, 1)
    p = _corrupt_file(store, KA)
    with open(p, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\xff" * 4)
    with pytest.raises(CacheMiss):
        store.acquire(KA)
    s = store.stats()
    assert (s["corrupt"], s["quarantined"], s["misses"]) == (1, 1, 1)
    assert store.status(KA) == "absent" and s["entries_dram"] == s["entries_disk"] == 0
    assert not list(Path("/dev/shm").glob(f"igc_{ns}_*"))  # the load's segment was freed
    write(store, KA, 2)  # recompute and cache again


def test_missing_disk_file_is_a_miss(store: TieredStore) -> None:
    write(store, KA, 1)
    _corrupt_file(store, KA).unlink()
    with pytest.raises(CacheMiss):
        store.acquire(KA)
    s = store.stats()
    assert s["misses"] == 1 and s["corrupt"] == 0 and store.status(KA) == "absent"


def test_prefetch_overlaps_and_acquire_does_not_reload(store: TieredStore) -> None:
    t = write(store, KA, 1)
    _corrupt_file(store, KA)  # (intact: only moved to disk)
    started, go = threading.Event(), threading.Event()
    reads = []
    real = store.disk.read_into

    def slow_read(key, layout, out) -> None:  # noqa: ANN001
        reads.append(key)
        started.set()
        assert go.wait(10)
        real(key, layout, out)

    store.disk.read_into = slow_read
    t0 = time.monotonic()
    fut = store.prefetch(KA)
    # returned at once, not after the held read (go: 10 s); a loaded machine may take seconds
    assert fut is not None and time.monotonic() - t0 < 5.0
    assert started.wait(5) and not fut.done()  # the load runs in the background...
    assert store.status(KA) == "building" and store.prefetch(KA) is fut  # one load per key
    got = []
    waiter = threading.Thread(target=lambda: got.append(store.acquire(KA)))
    waiter.start()  # ...and a concurrent acquire waits for it instead of reading again
    time.sleep(0.1)
    assert not got
    go.set()
    waiter.join(10)
    got[0].close()
    assert reads == [KA] and fut.result() is None
    assert_same(store, KA, t)
    assert reads == [KA] and store.stats()["prefetches"] == 1
    assert store.prefetch(KA) is None and store.prefetch(KB) is None  # nothing to load


def test_disk_full_runs_without_disk_and_recovers(store: TieredStore) -> None:
    def enospc(fd: int, mv: memoryview, off: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    store.disk._pwrite = enospc
    for i, k in enumerate([KA, KB, KC]):
        write(store, k, i)  # KA's demotion hits ENOSPC twice: dropped, requests go on
    s = store.stats()
    assert not s["disk_enabled"] and s["enospc"] == 2 and s["entries_disk"] == 0
    assert store.status(KA) == "absent" and store.persist(KB) is False
    store.disk._pwrite = os.pwrite
    assert store.recover_disk()
    t = write(store, KD, 3)  # demotes KC (persist just used KB) to disk again
    assert store.status(KC) == "disk" and store.stats()["disk_enabled"]
    assert_same(store, KD, t)


def _enospc(fd: int, mv: memoryview, off: int) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_tier_switches_itself_back_on_when_space_returns(tmp_path: Path, ns: str) -> None:
    with make(tmp_path, ns, dram=1, recover_interval_s=0.0) as store:
        store.disk._pwrite = _enospc
        write(store, KA, 1)
        write(store, KB, 2)  # KA's demotion hits ENOSPC twice: the tier is off
        assert not store.stats()["disk_enabled"] and store.status(KA) == "absent"
        store.disk._pwrite = os.pwrite  # space is back; nobody calls recover_disk()
        write(store, KC, 3)  # the capture checks the filesystem first: KB is demoted to disk
        assert store.stats()["disk_enabled"] and store.status(KB) == "disk"
    with make(tmp_path / "x", ns + "x", dram=1, recover_interval_s=3600.0) as store:
        write(store, KA, 1)  # the first capture checked; the next check is an hour away
        store.disk._pwrite = _enospc
        write(store, KB, 2)
        store.disk._pwrite = os.pwrite
        write(store, KC, 3)
        assert not store.stats()["disk_enabled"] and store.status(KB) == "absent"
    cleanup(ns + "x")


def test_restart_retries_a_disk_tier_that_enospc_switched_off(tmp_path: Path, ns: str) -> None:
    store = make(tmp_path, ns, dram=1)
    store.disk._pwrite = _enospc
    write(store, KA, 1)
    write(store, KB, 2)
    assert not store.stats()["disk_enabled"]  # persisted in the host index
    store.close()
    with make(tmp_path, ns, dram=1) as again:  # space is back, the worker restarts
        write(again, KC, 3)  # demotes KB
        assert again.stats()["disk_enabled"] and again.status(KB) == "disk"


def test_restart_with_the_disk_tier_switched_on_uses_it(tmp_path: Path, ns: str) -> None:
    with make(tmp_path, ns, dram=1, disk_enabled=False) as store:
        write(store, KA, 1)
    with make(tmp_path, ns, dram=1) as store:  # the operator turned the disk tier on
        write(store, KB, 2)
        write(store, KC, 3)
        assert store.stats()["disk_enabled"] and store.status(KB) == "disk"


def test_a_process_without_the_disk_tier_does_not_switch_it_off_for_the_host(
    tmp_path: Path, ns: str
) -> None:
    """B runs without a disk tier, A (configured last: the host's capacities are A's) with one.
    B's DRAM eviction is routed to disk by the host index and B cannot write it: the entry is
    dropped, but the host's disk tier stays on (before, B switched it off host-wide and A
    switched it back on at its next recovery check, over and over)."""
    with make(tmp_path, ns, dram=1, disk_enabled=False) as b, make(tmp_path, ns, dram=1) as a:
        write(b, KA, 1)
        write(b, KB, 2)  # evicts KA: B's write refuses it
        assert b.status(KA) == "absent" and b.disk.keys() == []
        assert a.stats()["disk_enabled"]
        write(a, KC, 3)  # evicts KB: A demotes it to disk
        assert a.status(KB) == "disk"


def test_loading_from_disk_keeps_the_entry_being_loaded(tmp_path: Path, ns: str) -> None:
    """Disk holds KA (LRU) and KB, DRAM holds KC: loading KA demotes KC, and the disk room for
    KC must not be made by deleting KA's file before it is read."""
    with make(tmp_path, ns, dram=1, disk=2) as store:
        ta = write(store, KA, 1)
        write(store, KB, 2)  # demotes KA
        write(store, KC, 3)  # demotes KB
        assert [store.status(k) for k in (KA, KB, KC)] == ["disk", "disk", "dram"]
        assert_same(store, KA, ta)
        assert [store.status(k) for k in (KA, KB, KC)] == ["dram", "absent", "disk"]
        assert sorted(store.disk.keys()) == sorted([KA, KC])


def test_a_second_process_starting_keeps_an_entry_committed_meanwhile(
    tmp_path: Path, ns: str, monkeypatch
) -> None:  # noqa: ANN001
    """A worker starting lists the disk files to reconcile the index; another worker demoting
    an entry right then must not have it forgotten (an orphan file, uncounted, never evicted)."""
    a = make(tmp_path, ns, dram=1)  # the other worker (its own lock file descriptor)
    write(a, KA, 1)
    real_scan = DiskTier.scan
    other = threading.Thread(target=write, args=(a, KB, 2))  # demotes KA to disk

    def scan(self: DiskTier) -> list:
        out = real_scan(self)
        if not other.is_alive() and other.ident is None:
            other.start()
            other.join(timeout=2.0)  # finishes now unless the listing holds the host lock
        return out

    monkeypatch.setattr(DiskTier, "scan", scan)
    try:
        with make(tmp_path, ns, dram=1):
            pass
        other.join()
        assert a.status(KA) == "disk" and a.stats()["bytes_disk"] == N
    finally:
        a.close()


def test_a_disk_entry_that_cannot_be_opened_now_stays_indexed(store: TieredStore) -> None:
    t = write(store, KA, 1)
    write(store, KB, 2)
    write(store, KC, 3)  # KA demoted to disk
    assert store.status(KA) == "disk"
    real = store.disk.read_into

    def busy(*args: object) -> None:
        raise DiskBusy("out of file descriptors")

    store.disk.read_into = busy
    with pytest.raises(DiskBusy):
        store.acquire(KA)
    assert store.status(KA) == "disk" and store.disk.contains(KA)
    store.disk.read_into = real
    assert_same(store, KA, t)


def test_disk_disabled_drops(tmp_path: Path, ns: str) -> None:
    with TieredStore(tmp_path, ns, N, 10 * N, disk_enabled=False, chunk_bytes=4096) as store:
        write(store, KA, 1)
        write(store, KB, 2)
        assert store.status(KA) == "absent" and store.disk.keys() == []
        assert store.persist(KB) is False and not store.stats()["disk_enabled"]


def test_restart_reindexes_disk(tmp_path: Path, ns: str) -> None:
    store = make(tmp_path, ns)
    t = write(store, KA, 1)
    assert store.persist(KA)
    store.close()
    cleanup(ns)  # a reboot: DRAM is gone, the disk and the index file remain
    (tmp_path / "host" / f"index-{ns}.json").unlink()
    with make(tmp_path, ns) as again:
        assert again.status(KA) == "disk"
        assert_same(again, KA, t)


def test_delete_everywhere(store: TieredStore) -> None:
    write(store, KA, 1)
    assert store.persist(KA) and store.persist(KA)  # idempotent
    store.delete(KA)
    assert store.status(KA) == "absent" and store.disk.keys() == []
    store.delete(KB)  # absent: nothing to do


def test_latents_and_blocks_are_zero_copy_views(store: TieredStore) -> None:
    write(store, KA, 1)
    with store.acquire(KA) as h1, store.acquire(KA) as h2:
        h1.latents(0)[0, 0, 0, 0] = 123.0  # same pages behind both handles
        assert float(h2.latents(0)[0, 0, 0, 0]) == 123.0
        assert h1.block(0, 1).data_ptr() - h1.data.data_ptr() == LAYOUT.slab(0, 1)[0]
    assert h1.closed
    with pytest.raises(RuntimeError):
        h1.block(0, 0)


def test_dropped_handle_releases_its_reference(store: TieredStore) -> None:
    write(store, KA, 1)
    h = store.acquire(KA)
    assert store.dram.refcounts(KA) == {store.dram.owner: 1}
    del h
    gc.collect()
    assert store.dram.refcounts(KA) == {}


def test_writer_takes_quantized_rows(store: TieredStore, tmp_path: Path, ns: str) -> None:
    from instgenie.cache.quant import quantize_rows

    lay = TemplateLayout(1, 2, "float8_e4m3fn", ((48, 32),), (4, 4), fp8_scales=True)
    y = torch.randn(2, 48, 32)
    qr = quantize_rows(y)
    with store.writer(KF, lay) as w:
        w.put_block(0, 0, qr)
        w.put_latents(0, torch.zeros(4, 4))
        w.commit()
    with store.acquire(KF) as h:
        assert torch.equal(h.block(0, 0).view(torch.uint8), qr.q.view(torch.uint8))
        assert torch.equal(h.scales(0, 0), qr.scale)
        back = h.block(0, 0).float() * h.scales(0, 0)
        torch.testing.assert_close(back, y, rtol=0.07, atol=1e-3)
