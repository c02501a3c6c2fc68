"""DiskTier: format, checksums, quarantine, hostile keys, atomic writes under crashes, ENOSPC."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from instgenie.cache.disk import CacheMiss, CorruptEntry, DiskBusy, DiskTier
from instgenie.cache.disk_format import MAGIC, PREAMBLE, VERSION, step_chunks
from instgenie.cache.layout import TemplateLayout

LAYOUT = TemplateLayout(3, 2, "bfloat16", ((50, 70), (30, 40)), (1, 4, 8, 8))
K1, K2, K3 = "1" * 64, "2" * 64, "3" * 64
REPO = Path(__file__).resolve().parents[2]


def rand_buf(layout: TemplateLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=g)


def read(tier: DiskTier, key: str, layout: TemplateLayout = LAYOUT) -> torch.Tensor:
    out = torch.empty(layout.nbytes, dtype=torch.uint8)
    tier.read_into(key, layout, out)
    return out


@pytest.fixture
def tier(tmp_path: Path) -> DiskTier:
    return DiskTier(tmp_path / "disk", None, chunk_bytes=4096)


def test_round_trip_and_format(tier: DiskTier) -> None:
    buf = rand_buf()
    assert tier.write(K1, LAYOUT, buf)
    raw = tier.path(K1).read_bytes()
    magic, version, hlen, hsum = PREAMBLE.unpack_from(raw)
    assert (magic, version) == (MAGIC, VERSION) == (MAGIC, 2)
    assert xxhash.xxh3_64_intdigest(raw[24 : 24 + hlen]) == hsum
    header = json.loads(raw[24 : 24 + hlen])
    assert TemplateLayout.from_dict(header["layout"]) == LAYOUT
    assert header["data_bytes"] == LAYOUT.nbytes and header["chunk_bytes"] == 4096
    # chunks never straddle a step: each step is cut into its own pieces
    per_step = -(-LAYOUT.step_nbytes // 4096)
    assert len(header["xxh3"]) == LAYOUT.num_steps * per_step > LAYOUT.num_steps
    off = (24 + hlen + 4095) // 4096 * 4096
    data = raw[off:]
    for s in range(LAYOUT.num_steps):
        for i, a, n in step_chunks(LAYOUT, 4096, s):
            piece = data[s * LAYOUT.step_nbytes + a :][:n]
            assert int(header["xxh3"][i], 16) == xxhash.xxh3_64_intdigest(piece)
    assert len(raw) == off + LAYOUT.nbytes == tier.file_nbytes(LAYOUT)
    assert raw[off:] == buf.numpy().tobytes()
    assert torch.equal(read(tier, K1), buf)
    assert tier.read_layout(K1) == LAYOUT and tier.keys() == [K1]
    c = tier.counters()
    assert c["hits"] == 1 and c["bytes_written"] == c["bytes_read"] == len(raw)
    # an overwrite replaces the whole entry
    assert tier.write(K1, LAYOUT, rand_buf(seed=1))
    assert torch.equal(read(tier, K1), rand_buf(seed=1))


def test_fp8_layout_and_memoryview_buffers(tier: DiskTier) -> None:
    lay = TemplateLayout(2, 1, "float8_e4m3fn", ((16, 32),), (4, 4), "float16", fp8_scales=True)
    src = bytearray(rand_buf(lay).numpy().tobytes())
    assert tier.write(K2, lay, memoryview(src))
    out = bytearray(lay.nbytes)
    tier.read_into(K2, lay, memoryview(out))
    assert out == src
    with pytest.raises(CorruptEntry):  # a layout other than the file's is a mismatch
        tier.read_into(K2, LAYOUT, torch.empty(LAYOUT.nbytes, dtype=torch.uint8))


HOSTILE = [
    "../x",
    "../" * 30 + "etc/passwd",
    "/tmp/evil",
    "/" + "a" * 63,
    "a" * 63 + "\x00",
    "\x00" * 64,
    "A" * 64,
    "a" * 65,
    "a" * 4096,
    "é" * 64,
    "a" * 63 + "\n",
    "a" * 64 + "\n",
    "",
    ".",
    "..",
    "a" * 62 + "/.",
]


def assert_rejected(tier: DiskTier, root_parent: Path, key: object) -> None:
    before = sorted(p for p in root_parent.rglob("*"))
    for call in (
        lambda: tier.write(key, LAYOUT, rand_buf()),  # type: ignore[arg-type]
        lambda: tier.read_into(key, LAYOUT, rand_buf()),  # type: ignore[arg-type]
        lambda: tier.read_layout(key),  # type: ignore[arg-type]
        lambda: tier.delete(key),  # type: ignore[arg-type]
        lambda: tier.contains(key),  # type: ignore[arg-type]
        lambda: tier.path(key),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError):
            call()
    assert sorted(p for p in root_parent.rglob("*")) == before


@pytest.mark.parametrize("key", HOSTILE + [None, 123, b"1" * 64])
def test_hostile_keys_rejected(tmp_path: Path, key: object) -> None:
    tier = DiskTier(tmp_path / "disk", None)
    assert_rejected(tier, tmp_path, key)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    key=st.one_of(st.text(max_size=4096), st.text(alphabet="0123456789abcdef/.\x00", max_size=70))
)
def test_hostile_keys_hypothesis(tmp_path: Path, key: str) -> None:
    tier = DiskTier(tmp_path / "disk", None)
    if len(key) == 64 and all(c in "0123456789abcdef" for c in key):
        return  # a valid digest
    assert_rejected(tier, tmp_path, key)


def _corrupt_and_check(tier: DiskTier, mutate, exc=CorruptEntry) -> None:  # noqa: ANN001
    assert tier.write(K1, LAYOUT, rand_buf())
    mutate(tier.path(K1))
    with pytest.raises(exc):
        read(tier, K1)
    assert not tier.contains(K1)  # never read again
    with pytest.raises(CacheMiss):
        read(tier, K1)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize(
    "where", ["magic", "version", "header_len", "header", "data_first", "data_last", "pad"]
)
def test_flipped_byte_is_quarantined(tier: DiskTier, where: str) -> None:
    def mutate(p: Path) -> None:
        size = p.stat().st_size
        data_off = size - LAYOUT.nbytes
        offset = {
            "magic": 0,
            "version": 8,
            "header_len": 12,
            "header": 40,
            "data_first": data_off,
            "data_last": size - 1,
        }.get(where, data_off - 1)
        flip(p, offset)

    if where == "pad":  # the zero padding before the data is not covered: still readable
        assert tier.write(K1, LAYOUT, rand_buf())
        mutate(tier.path(K1))
        assert torch.equal(read(tier, K1), rand_buf())
        return
    _corrupt_and_check(tier, mutate)
    c = tier.counters()
    assert c["corrupt"] == 1 and c["quarantined"] == 1 and c["misses"] == 1
    assert len(list(tier.quarantine_dir.iterdir())) == 1


@pytest.mark.parametrize("keep", [0, 10, 24, 100, -1])
def test_truncation_and_extension(tier: DiskTier, keep: int) -> None:
    def mutate(p: Path) -> None:
        size = p.stat().st_size
        os.truncate(p, size + 1 if keep == -1 else min(keep, size - 1) if keep else size - 1)

    _corrupt_and_check(tier, mutate)


def test_deleted_file_is_a_plain_miss(tier: DiskTier) -> None:
    _corrupt_and_check(tier, lambda p: p.unlink(), exc=CacheMiss)
    c = tier.counters()
    assert c["misses"] == 2 and c["corrupt"] == 0 and c["quarantined"] == 0


def test_unreadable_entry(tier: DiskTier) -> None:
    def mutate(p: Path) -> None:
        if os.geteuid() != 0:
            p.chmod(0)
        else:  # root reads mode-000 files: make the entry unreadable another way
            p.unlink()
            p.mkdir()

    _corrupt_and_check(tier, mutate)
    assert tier.counters()["quarantined"] == 1


def test_out_of_file_descriptors_is_a_miss_that_keeps_the_entry(tier: DiskTier) -> None:
    """EMFILE says nothing about the file: a miss for now, never a quarantine."""
    buf = rand_buf()
    assert tier.write(K1, LAYOUT, buf)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fds: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        with pytest.raises(OSError):
            while True:
                fds.append(os.open(os.devnull, os.O_RDONLY))
        with pytest.raises(DiskBusy, match="Too many open files"):
            tier.read_layout(K1)
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    c = tier.counters()
    assert c["corrupt"] == 0 and c["quarantined"] == 0 and tier.keys() == [K1]
    assert torch.equal(read(tier, K1), buf)


def test_symlinked_entry_is_not_followed(tier: DiskTier, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"secret")
    _corrupt_and_check(tier, lambda p: (p.unlink(), p.symlink_to(target)))
    assert target.read_bytes() == b"secret"


@pytest.mark.parametrize("when", ["before_quarantine", "during_rename", "twice"])
def test_quarantine_spares_a_newer_entry_written_meanwhile(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A reader finds K1 corrupt; a writer renames a new valid K1 over the path before the reader
    has moved the file it read to quarantine/: before it starts, or between its identity check
    and its rename (the rename then takes the new file, which is put back); "twice": a third
    writer's K1 lands before that put-back, and wins. The newest entry stays readable and no
    valid file is quarantined."""
    assert tier.write(K1, LAYOUT, rand_buf(seed=1))
    flip(tier.path(K1), tier.path(K1).stat().st_size - 1)  # last chunk: found after reading all
    newer = [rand_buf(seed=2), rand_buf(seed=3)]
    written: list[torch.Tensor] = []

    def writer_wins() -> None:  # a writer of another process, deterministically first
        written.append(newer[len(written)])
        assert tier.write(K1, LAYOUT, written[-1])

    if when == "before_quarantine":
        corrupt = tier._corrupt

        def racing_corrupt(*args):  # noqa: ANN002, ANN202
            writer_wins()
            return corrupt(*args)

        monkeypatch.setattr(tier, "_corrupt", racing_corrupt)
    else:
        replace, link = os.replace, os.link

        def racing_replace(src, dst) -> None:  # noqa: ANN001
            if Path(dst).parent == tier.quarantine_dir and not written:
                writer_wins()  # (the writer's own rename, into entries/, passes straight on)
            replace(src, dst)

        def racing_link(src, dst) -> None:  # noqa: ANN001
            if when == "twice":
                writer_wins()
            link(src, dst)

        monkeypatch.setattr(os, "replace", racing_replace)
        monkeypatch.setattr(os, "link", racing_link)
    with pytest.raises(CorruptEntry):
        read(tier, K1)
    monkeypatch.undo()
    assert len(written) == (2 if when == "twice" else 1)
    assert torch.equal(read(tier, K1), written[-1])
    assert list(tier.quarantine_dir.iterdir()) == []
    c = tier.counters()
    assert (c["corrupt"], c["quarantined"]) == (1, 0)


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
