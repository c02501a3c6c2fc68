"""DiskTier writes: atomic under crashes (in-process and SIGKILL), ENOSPC, capacity and eviction,
temp files of live and dead writers."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from instgenie.cache.disk import CacheMiss, DiskTier
from instgenie.cache.layout import TemplateLayout
from tests.cache.test_disk import K1, K2, K3, LAYOUT, rand_buf, read

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tier(tmp_path: Path) -> DiskTier:
    """As test_disk's (a fixture imported by name would shadow the tests' argument)."""
    return DiskTier(tmp_path / "disk", None, chunk_bytes=4096)


def test_crash_mid_write_keeps_old_entry(tier: DiskTier) -> None:
    assert tier.write(K1, LAYOUT, rand_buf(seed=0))
    calls = []

    def dying_pwrite(fd: int, mv: memoryview, off: int) -> int:
        calls.append(off)
        if len(calls) == 3:
            raise KeyboardInterrupt  # a crash in the middle of the data
        return os.pwrite(fd, mv, off)

    tier._pwrite = dying_pwrite
    with pytest.raises(KeyboardInterrupt):
        tier.write(K1, LAYOUT, rand_buf(seed=1))
    assert torch.equal(read(tier, K1), rand_buf(seed=0))
    assert [p.name for p in tier.entries_dir.iterdir()] == [f"{K1}.igc"]  # temp removed


def test_reader_never_sees_a_partial_entry(tier: DiskTier) -> None:
    assert tier.write(K1, LAYOUT, rand_buf(seed=0))
    started, go = threading.Event(), threading.Event()

    def slow_pwrite(fd: int, mv: memoryview, off: int) -> int:
        started.set()
        go.wait(5)
        return os.pwrite(fd, mv, off)

    tier._pwrite = slow_pwrite
    t = threading.Thread(target=tier.write, args=(K1, LAYOUT, rand_buf(seed=1)))
    t.start()
    assert started.wait(5)
    assert torch.equal(read(tier, K1), rand_buf(seed=0))  # old entry while the new is written
    with pytest.raises(CacheMiss):
        read(tier, K2)
    go.set()
    t.join(5)
    assert torch.equal(read(tier, K1), rand_buf(seed=1))


WRITER = textwrap.dedent(
    """
    import os, sys, time, torch
    from instgenie.cache.disk import DiskTier
    from instgenie.cache.layout import TemplateLayout
    lay = TemplateLayout(4, 2, "float32", ((256, 256),), (4, 64, 64))
    tier = DiskTier(sys.argv[1], None, chunk_bytes=4096)
    n = [0]
    def pwrite(fd, mv, off):
        n[0] += 1
        if n[0] == 5:
            print("writing", flush=True)
            time.sleep(60)
        return os.pwrite(fd, mv, off)
    tier._pwrite = pwrite
    tier.write(sys.argv[2], lay, torch.ones(lay.nbytes, dtype=torch.uint8))
    """
)


def test_sigkill_during_write_leaves_old_entry_and_temp_is_cleaned(tmp_path: Path) -> None:
    lay = TemplateLayout(4, 2, "float32", ((256, 256),), (4, 64, 64))
    tier = DiskTier(tmp_path / "disk", None, chunk_bytes=4096)
    old = rand_buf(lay, seed=3)
    assert tier.write(K1, lay, old)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "disk"), K1],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
    temps = [p for p in tier.entries_dir.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].stat().st_size > 0  # the crash debris
    assert tier.keys() == [K1]
    out = torch.empty(lay.nbytes, dtype=torch.uint8)
    tier.read_into(K1, lay, out)
    assert torch.equal(out, old)
    DiskTier(tmp_path / "disk", None)  # the next start removes the dead writer's temp file
    assert [p.name for p in tier.entries_dir.iterdir()] == [f"{K1}.igc"]


def enospc_after(tier: DiskTier, fail_calls: set[int]) -> list[int]:
    calls: list[int] = []

    def pwrite(fd: int, mv: memoryview, off: int) -> int:
        calls.append(off)
        if len(calls) in fail_calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.pwrite(fd, mv, off)

    tier._pwrite = pwrite
    return calls


def test_enospc_evicts_lru_and_retries_once(tier: DiskTier) -> None:
    assert tier.write(K1, LAYOUT, rand_buf(seed=1))
    assert tier.write(K2, LAYOUT, rand_buf(seed=2))
    os.utime(tier.path(K1), (1000, 1000))  # K1 is the least recently used
    os.utime(tier.path(K2), (2000, 2000))
    enospc_after(tier, {2})
    assert tier.write(K3, LAYOUT, rand_buf(seed=3))
    assert sorted(tier.keys()) == sorted([K2, K3]) and tier.enabled
    assert torch.equal(read(tier, K3), rand_buf(seed=3))
    c = tier.counters()
    assert c["enospc"] == 1 and c["evictions"] == 1
    assert not [p for p in tier.entries_dir.iterdir() if p.name.endswith(".tmp")]


def test_enospc_twice_switches_tier_off_without_raising(tier: DiskTier) -> None:
    assert tier.write(K1, LAYOUT, rand_buf(seed=1))
    calls = enospc_after(tier, set(range(1, 1000)))
    assert tier.write(K2, LAYOUT, rand_buf(seed=2)) is False
    assert not tier.enabled and tier.counters()["enospc"] == 2
    assert not [p for p in tier.entries_dir.iterdir() if p.name.endswith(".tmp")]
    n = len(calls)
    assert tier.write(K3, LAYOUT, rand_buf()) is False and len(calls) == n  # no more tries
    tier._pwrite = os.pwrite
    assert tier.try_enable(min_free_bytes=1)  # space came back
    assert tier.write(K3, LAYOUT, rand_buf(seed=3))
    assert torch.equal(read(tier, K3), rand_buf(seed=3))


def test_other_write_errors_are_reported_not_raised(tier: DiskTier) -> None:
    def eio(fd: int, mv: memoryview, off: int) -> int:
        raise OSError(errno.EIO, "I/O error")

    tier._pwrite = eio
    assert tier.write(K1, LAYOUT, rand_buf()) is False
    assert tier.enabled and tier.counters()["write_errors"] == 1 and tier.keys() == []


def test_directory_fsync_error_after_the_rename_still_stores(tier: DiskTier) -> None:
    """Once renamed into place the entry is complete and fsynced: write() reports it stored
    (False would make the caller drop its index entry and leave an uncounted file)."""

    def eio() -> None:
        raise OSError(errno.EIO, "Input/output error")

    tier._fsync_dir = eio
    buf = rand_buf()
    assert tier.write(K1, LAYOUT, buf) is True
    assert tier.keys() == [K1] and torch.equal(read(tier, K1), buf)


def test_a_second_tier_of_the_same_process_keeps_a_write_in_flight(tmp_path: Path) -> None:
    """A DiskTier starting removes temp files of dead writers, not one this process is writing
    through another DiskTier (same pid)."""
    first = DiskTier(tmp_path / "disk", None, chunk_bytes=4096)
    started = []

    def pwrite(fd: int, mv: memoryview, off: int) -> int:
        if not started:
            started.append(DiskTier(tmp_path / "disk", None, chunk_bytes=4096))
        return os.pwrite(fd, mv, off)

    first._pwrite = pwrite
    buf = rand_buf()
    assert first.write(K1, LAYOUT, buf) is True
    assert started and torch.equal(read(first, K1), buf)


def test_capacity_evicts_least_recently_read(tmp_path: Path) -> None:
    size = DiskTier(tmp_path / "probe", None, chunk_bytes=4096).file_nbytes(LAYOUT)
    tier = DiskTier(tmp_path / "disk", int(2.5 * size), chunk_bytes=4096)
    assert tier.write(K1, LAYOUT, rand_buf(seed=1))
    assert tier.write(K2, LAYOUT, rand_buf(seed=2))
    os.utime(tier.path(K1), (1000, 1000))
    os.utime(tier.path(K2), (2000, 2000))
    read(tier, K1)  # refreshes K1's mtime: K2 becomes the LRU entry
    assert tier.write(K3, LAYOUT, rand_buf(seed=3))
    assert sorted(tier.keys()) == sorted([K1, K3]) and tier.used_bytes() <= 2.5 * size
    assert tier.counters()["evictions"] == 1
    small = DiskTier(tmp_path / "small", size - 1)
    assert small.write(K1, LAYOUT, rand_buf()) is False


def test_injected_victim_policy(tmp_path: Path) -> None:
    asked = []

    def victims(nbytes: int, key: str) -> list[str]:
        asked.append((nbytes, key))
        return [K2]

    tier = DiskTier(tmp_path / "disk", None, chunk_bytes=4096, choose_victims=victims)
    assert tier.write(K1, LAYOUT, rand_buf(seed=1)) and tier.write(K2, LAYOUT, rand_buf(seed=2))
    enospc_after(tier, {1})
    assert tier.write(K3, LAYOUT, rand_buf(seed=3))
    assert asked == [(tier.file_nbytes(LAYOUT), K3)]
    assert sorted(tier.keys()) == sorted([K1, K3])


def test_scan_ignores_foreign_files_and_live_temps(tier: DiskTier) -> None:
    (tier.entries_dir / "notes.txt").write_text("x")
    live = tier.entries_dir / f".{K1}.1.{'0' * 32}.tmp"  # pid 1 is alive
    live.write_bytes(b"x")
    assert tier.keys() == []
    DiskTier(tier.root, None)
    assert live.exists()
