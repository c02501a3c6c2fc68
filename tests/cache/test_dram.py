"""DramTier: shared-memory segments shared across processes, host index refcounts, eviction."""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from instgenie.cache import shm_segment as seg_mod
from instgenie.cache.disk import CacheMiss
from instgenie.cache.dram import DramTier
from instgenie.cache.hostmem import owner_alive, owner_id, pin, unpin
from instgenie.cache.index import CacheFull, EntryInUse
from instgenie.cache.layout import TemplateLayout
from instgenie.cache.shm_segment import Segment, check_namespace, cleanup, segment_name

LAYOUT = TemplateLayout(2, 2, "float16", ((64, 32), (16, 8)), (1, 4, 8, 8))
N = LAYOUT.nbytes
KA, KB, KC = "a" * 64, "b" * 64, "c" * 64
REPO = Path(__file__).resolve().parents[2]


def shm_names(ns: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"igc_{ns}_*"))


@pytest.fixture
def ns() -> str:
    name = "t" + uuid.uuid4().hex[:12]
    yield name
    cleanup(name)
    assert shm_names(name) == []


def fill(tier: DramTier, key: str, seed: int) -> torch.Tensor:
    seg = tier.create(key, LAYOUT)
    g = torch.Generator().manual_seed(seed)
    expected = torch.randint(0, 256, (N,), dtype=torch.uint8, generator=g)
    seg.data.copy_(expected)
    tier.commit(seg)
    seg.close()
    return expected


def test_names_are_validated() -> None:
    assert check_namespace("abc123") == "abc123"
    for bad in ["", "A", "a" * 17, "a_b", "../x", "a\x00", "é"]:
        with pytest.raises(ValueError):
            check_namespace(bad)
    assert segment_name("ns", KA) == "igc_ns_" + "a" * 40
    for bad in ["../x", "/dev/shm/x", "a" * 63, "A" * 64]:
        with pytest.raises(ValueError):
            segment_name("ns", bad)


def test_write_attach_zero_copy_and_refcounts(tmp_path: Path, ns: str) -> None:
    tier = DramTier(tmp_path, ns, 10 * N)
    expected = fill(tier, KA, 0)
    assert shm_names(ns) == [segment_name(ns, KA)]
    s1, s2 = tier.attach(KA), tier.attach(KA)
    assert torch.equal(s1.data, expected)
    assert tier.refcounts(KA) == {tier.owner: 2}
    s1.data[5] = 77  # both mappings see the same physical pages: no copy
    assert int(s2.data[5]) == 77
    v = LAYOUT.block_view(s2.data, 1, 0)
    assert v.dtype == torch.float16 and v.shape == (2, 64, 32)
    tier.release(s1)
    tier.release(s2)
    assert tier.refcounts(KA) == {}
    assert tier.attach(KC) is None


def test_reader_never_uses_a_segment_without_ready_flag(tmp_path: Path, ns: str) -> None:
    tier = DramTier(tmp_path, ns, 10 * N)
    seg = tier.create(KA, LAYOUT)
    assert tier.status(KA) == "building" and tier.attach(KA) is None
    with pytest.raises(CacheMiss):
        Segment.attach(ns, KA)  # flag not set yet
    with pytest.raises(ValueError):
        tier.create(KA, LAYOUT)
    tier.commit(seg)
    assert Segment.attach(ns, KA).is_ready and tier.status(KA) == "ready"
    tier.abort(seg)  # no-op: already committed, the segment stays
    assert shm_names(ns) == [segment_name(ns, KA)]


def test_abort_unlinks(tmp_path: Path, ns: str) -> None:
    tier = DramTier(tmp_path, ns, 10 * N)
    tier.abort(tier.create(KA, LAYOUT))
    assert tier.status(KA) == "absent" and shm_names(ns) == []


def test_lru_eviction_demotes_through_callback(tmp_path: Path, ns: str) -> None:
    demoted: dict[str, bytes] = {}

    def demote(key: str, layout: TemplateLayout, data: torch.Tensor) -> bool:
        assert layout == LAYOUT
        demoted[key] = data.numpy().tobytes()
        return True

    tier = DramTier(tmp_path, ns, 2 * N, disk_capacity_bytes=10 * N, demote=demote)
    a, _ = fill(tier, KA, 1), fill(tier, KB, 2)
    held = tier.attach(KB)  # KB in use: never evicted, KA is the victim
    fill(tier, KC, 3)
    assert demoted == {KA: a.numpy().tobytes()}
    assert tier.status(KA) == "absent" and segment_name(ns, KA) not in shm_names(ns)
    with tier.txn() as t:
        assert t.idx.state(KA, "disk") == "ready"
    assert tier.stats.demotions == 1 and tier.stats.evictions == 1
    seg = tier.attach(KC)
    with pytest.raises(CacheFull):  # both entries in use
        tier.create(KA, LAYOUT, fresh=False)
    with pytest.raises(EntryInUse):
        tier.delete(KB)
    tier.release(seg)
    tier.release(held)
    tier.delete(KB)
    assert segment_name(ns, KB) not in shm_names(ns)


def test_drop_without_disk_and_failed_demotion(tmp_path: Path, ns: str) -> None:
    tier = DramTier(tmp_path, ns, N)
    fill(tier, KA, 1)
    fill(tier, KB, 2)  # no disk tier: KA is dropped
    assert shm_names(ns) == [segment_name(ns, KB)] and tier.stats.demotions == 0
    tier2 = DramTier(tmp_path / "2", ns + "x", N, disk_capacity_bytes=N, demote=lambda *a: False)
    try:
        fill(tier2, KA, 1)
        fill(tier2, KB, 2)
        with tier2.txn() as t:  # the disk reservation was aborted
            assert t.idx.state(KA, "disk") == "absent"
    finally:
        cleanup(ns + "x")


def test_dev_shm_full_is_a_clean_error(tmp_path: Path, ns: str, monkeypatch) -> None:  # noqa: ANN001
    """posix_fallocate fails with ENOSPC on a full /dev/shm: CacheFull, nothing left behind, and
    no byte of the segment written before it (on a real full tmpfs that write is a SIGBUS)."""
    written_before = []

    def full(fd: int, offset: int, length: int) -> None:
        written_before.append(any(os.pread(fd, length, offset)))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(seg_mod.os, "posix_fallocate", full)
    tier = DramTier(tmp_path, ns, 10 * N)
    with pytest.raises(CacheFull, match="/dev/shm cannot hold"):
        tier.create(KA, LAYOUT)
    assert written_before == [False]
    assert tier.status(KA) == "absent" and shm_names(ns) == []


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root (private tmpfs)"
)
def test_real_full_dev_shm_is_cache_full_not_sigbus(tmp_path: Path) -> None:
    """The same on a real full tmpfs over /dev/shm, in a private mount namespace."""
    script = textwrap.dedent(
        """
        mount -t tmpfs -o size=256k tmpfs /dev/shm || exit 77
        dd if=/dev/zero of=/dev/shm/filler bs=4k 2>/dev/null
        exec "$0" -c "$1" "$2"
        """
    )
    child = textwrap.dedent(
        """
        import sys
        from instgenie.cache.dram import DramTier
        from instgenie.cache.index import CacheFull
        from instgenie.cache.layout import TemplateLayout
        tier = DramTier(sys.argv[1], "full", 1 << 30)
        try:
            tier.create("ef" * 32, TemplateLayout(2, 1, "float32", ((64, 64),), (1, 4, 4)))
        except CacheFull as e:
            print("CacheFull:", e)
        """
    )
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, child, str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if r.returncode == 77 or "unshare failed" in r.stderr:
        pytest.skip(f"no private mount namespace here: {r.stderr.strip()}")
    assert r.returncode == 0, (r.returncode, r.stderr)  # -7: killed by SIGBUS
    assert "CacheFull: /dev/shm cannot hold" in r.stdout


def test_views_outlive_release_without_dangling(tmp_path: Path, ns: str) -> None:
    tier = DramTier(tmp_path, ns, 10 * N)
    expected = fill(tier, KA, 4)
    seg = tier.attach(KA)
    view = LAYOUT.latents_view(seg.data, 1)
    tier.release(seg)
    assert seg.data is not None  # kept mapped for this process's next handle
    tier.delete(KA)  # the entry goes: the idle mapping closes, and lingers while `view` lives
    off, _ = LAYOUT.latents_slab(1)
    assert (
        view.contiguous().view(torch.uint8).flatten().tolist()
        == expected[off : off + view.numel() * view.element_size()].tolist()
    )
    assert seg_mod._LINGERING  # unmapping now would leave `view` dangling
    del view
    gc.collect()
    fill(tier, KB, 2)
    tier.release(tier.attach(KB))
    tier.delete(KB)  # any later close sweeps the lingering mapping
    assert seg_mod._LINGERING == []


def test_debris_is_reconciled_at_start(tmp_path: Path, ns: str) -> None:
    tier = DramTier(tmp_path, ns, 10 * N)
    fill(tier, KA, 1)
    fill(tier, KB, 2)
    seg_mod.unlink_shm(segment_name(ns, KA))  # listed, but its segment vanished
    stray = seg_mod.open_shm(segment_name(ns, KC), 4096)  # a segment the index does not list
    seg_mod.close_shm(stray)
    tier2 = DramTier(tmp_path, ns, 10 * N)
    assert tier2.status(KA) == "absent" and tier2.status(KB) == "ready"
    assert shm_names(ns) == [segment_name(ns, KB)] and tier2.stats.stale_segments == 1


def test_differently_configured_processes_do_not_fight_over_capacity(
    tmp_path: Path, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two processes of a host sharing one index, configured with different DRAM capacities: the
    one configured last sets the host's capacity and the other follows it, instead of writing its
    own back on every transaction (which flipped the capacity and evicted entries back and forth).
    A process that is reconfigured applies its new capacity at its next transaction."""
    big = DramTier(tmp_path, ns, 3 * N)
    fill(big, KA, 1)
    fill(big, KB, 2)
    small = DramTier(tmp_path, ns, 2 * N)  # started last: the host's DRAM capacity is 2N
    with caplog.at_level(logging.WARNING, logger="instgenie.cache.dram"):
        fill(big, KC, 3)  # must fit in 2N: the LRU entry KA goes
        for _ in range(3):  # alternating transactions change nothing
            for tier in (big, small):
                with tier.txn() as t:
                    assert t.idx.capacities["dram"] == 2 * N
                assert [tier.status(k) for k in (KA, KB, KC)] == ["absent", "ready", "ready"]
    warned = [r.getMessage() for r in caplog.records if "configured for" in r.getMessage()]
    assert len(warned) == 1 and f"configured for {3 * N}" in warned[0]  # once, by `big`
    big.capacities["dram"] = 4 * N
    for tier in (big, small):
        with tier.txn() as t:
            assert t.idx.capacities["dram"] == 4 * N


def test_nested_transaction_refused(tmp_path: Path, ns: str) -> None:
    tier = DramTier(tmp_path, ns, N)
    with tier.txn(), pytest.raises(RuntimeError):
        tier.status(KA)


def test_pin_is_a_noop_on_cpu() -> None:
    t = torch.zeros(4096, dtype=torch.uint8)
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning is real")
    assert pin(t) is False and unpin(t) is False


def test_owner_liveness() -> None:
    me = owner_id()
    assert owner_alive(me) and me.startswith(f"{os.getpid()}:")
    pid, start = me.split(":")
    assert not owner_alive(f"{pid}:{int(start) + 1}")  # same pid, other process (pid reuse)
    assert not owner_alive("garbage") and not owner_alive("999999999:0")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    cid = owner_id(child.pid)
    while child.poll() is None:
        time.sleep(0.01)
    assert not owner_alive(cid)


# ---- across processes --------------------------------------------------------------------------
def _writer_proc(root: str, ns: str, key: str) -> None:
    fill(DramTier(root, ns, 10 * N), key, 7)


def _reader_proc(root: str, ns: str, key: str, q: mp.Queue, start: mp.Event, go: mp.Event) -> None:
    assert start.wait(60)
    tier = DramTier(root, ns, 10 * N)
    seg = tier.attach(key)
    q.put(("attached", seg.data.numpy().tobytes(), tier.owner))
    go.wait(30)
    q.put(("seen", int(seg.data[0])))
    time.sleep(60)  # holds its reference until killed


def test_two_processes_share_one_segment_and_kill9_drops_refs(tmp_path: Path, ns: str) -> None:
    ctx = mp.get_context("spawn")
    q, start, go = ctx.Queue(), ctx.Event(), ctx.Event()
    b = ctx.Process(target=_reader_proc, args=(str(tmp_path), ns, KA, q, start, go))
    b.start()  # starts up (imports) while A writes
    try:
        a = ctx.Process(target=_writer_proc, args=(str(tmp_path), ns, KA))
        a.start()
        a.join(60)
        assert a.exitcode == 0
        assert shm_names(ns) == [segment_name(ns, KA)]  # outlives its creator
        tier = DramTier(tmp_path, ns, 10 * N)
        mine = tier.attach(KA)
        expected = mine.data.numpy().tobytes()
        start.set()
        tag, data, b_owner = q.get(timeout=60)
        assert tag == "attached" and data == expected
        assert tier.refcounts(KA) == {tier.owner: 1, b_owner: 1}
        assert shm_names(ns) == [segment_name(ns, KA)]  # no second copy on the host
        mine.data[0] = (int(mine.data[0]) + 1) % 256
        go.set()
        assert q.get(timeout=30) == ("seen", int(mine.data[0]))  # B reads our write: shared
        os.kill(b.pid, signal.SIGKILL)
        b.join(30)
    finally:
        if b.is_alive():  # a failed assertion above: do not leave B behind
            b.kill()
            b.join(30)
    assert tier.refcounts(KA) == {tier.owner: 1}  # the dead reader's reference is gone
    assert tier.stats.dead_owners == 1
    tier.release(mine)


def _dying_builder(root: str, ns: str, key: str, q: mp.Queue) -> None:
    DramTier(root, ns, 10 * N).create(key, LAYOUT)
    q.put("building")
    time.sleep(60)


def test_dead_builder_segment_is_unlinked(tmp_path: Path, ns: str) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_dying_builder, args=(str(tmp_path), ns, KA, q))
    p.start()
    try:
        assert q.get(timeout=60) == "building"
        tier = DramTier(tmp_path, ns, 10 * N)
        assert tier.status(KA) == "building"
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    assert tier.status(KA) == "absent" and shm_names(ns) == []
    fill(tier, KA, 1)  # the key can be built again


CREATOR = textwrap.dedent(
    """
    import sys, torch
    from multiprocessing import resource_tracker, shared_memory
    from instgenie.cache.dram import DramTier
    from instgenie.cache.layout import TemplateLayout
    root, ns, key = sys.argv[1:]
    lay = TemplateLayout(2, 2, "float16", ((64, 32), (16, 8)), (1, 4, 8, 8))
    tier = DramTier(root, ns, 10 * lay.nbytes)
    seg = tier.create(key, lay)
    seg.data.fill_(42)
    tier.commit(seg)
    control = shared_memory.SharedMemory(f"igc_{ns}_control", create=True, size=4096)
    print(resource_tracker._resource_tracker._pid, flush=True)
    """
)


def test_segment_survives_creator_exit_and_its_resource_tracker(tmp_path: Path, ns: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", CREATOR, str(tmp_path), ns, KA],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    tracker = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while owner_alive(owner_id(tracker)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not owner_alive(owner_id(tracker)), "the creator's resource tracker did not exit"
    # the tracked control segment was unlinked by the tracker; ours was not
    assert shm_names(ns) == [segment_name(ns, KA)]
    tier = DramTier(tmp_path, ns, 10 * N)
    seg = tier.attach(KA)
    assert int(seg.data.min()) == int(seg.data.max()) == 42
    tier.release(seg)
