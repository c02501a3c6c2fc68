"""DiskTier: format, checksums, quarantine, hostile keys (writes under crashes and a full disk:
test_disk_writes.py)."""

from __future__ import annotations

import json
import os
import resource
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
