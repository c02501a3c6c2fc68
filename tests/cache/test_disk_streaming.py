"""Templates larger than the DRAM tier: captured straight to disk, streamed back one step at a
time through a bounded ring of staging buffers, verified per step (disk_stream.py)."""

from __future__ import annotations

import errno
import functools
import json
import os
import struct
import uuid
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from instgenie.cache.disk import CacheMiss, CorruptEntry, DiskTier, StaleFormat
from instgenie.cache.disk_stream import DiskTemplateWriter, StreamedHandle, StreamedTemplate
from instgenie.cache.host_store import HostActivationStore
from instgenie.cache.host_template import TemplateWriter
from instgenie.cache.index import CacheFull
from instgenie.cache.layout import TemplateLayout, align_up
from instgenie.cache.misses import StreamCorrupt
from instgenie.cache.shm_segment import cleanup
from instgenie.cache.tiered import TieredStore
from instgenie.engine.family import load_family
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.scheduler.batching import get_policy
from instgenie.worker.batcher import Batcher
from tests.cache.test_tiered import template
from tests.conftest import make_image, make_mask, png_bytes

LAYOUT = TemplateLayout(5, 2, "bfloat16", ((48, 32), (24, 16)), (1, 4, 8, 8))
N = LAYOUT.nbytes
STEP_BUF = align_up(LAYOUT.step_nbytes, 4096)  # a staging buffer is whole pages
KA, KB, KC = "a" * 64, "b" * 64, "c" * 64


@pytest.fixture
def ns() -> str:
    name = "s" + uuid.uuid4().hex[:12]
    yield name
    cleanup(name)
    assert not list(Path("/dev/shm").glob(f"igc_{name}_*"))


def make(tmp_path: Path, ns: str, dram: int, disk: int = 10 * N, **kw) -> TieredStore:  # noqa: ANN003
    """chunk_bytes 4096: every step is several chunks."""
    return TieredStore(tmp_path, ns, dram, disk, chunk_bytes=4096, **kw)


def capture(store: TieredStore, key: str, seed: int, layout: TemplateLayout = LAYOUT) -> dict:
    t = template(layout, seed)
    with store.writer(key, layout) as w:
        for s in range(layout.num_steps):
            for b in reversed(range(layout.num_blocks)):  # any block order within a step
                w.put_block(s, b, t[("y", s, b)], scale=t.get(("s", s, b)))
            w.put_latents(s, t[("lat", s)])
        w.commit()
    return t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def stream_all(h: StreamedTemplate, t: dict) -> None:
    """Every step in increasing order (as an edit reads them), bit for bit."""
    lay = h.layout
    for s in range(lay.num_steps):
        for b in range(lay.num_blocks):
            assert same(h.block(s, b), t[("y", s, b)])
            if lay.fp8_scales:
                assert torch.equal(h.scales(s, b), t[("s", s, b)])
        assert torch.equal(h.latents(s), t[("lat", s)])


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_template_larger_than_dram_is_captured_to_disk_and_streamed(
    tmp_path: Path, ns: str, dtype: str
) -> None:
    lay = TemplateLayout(5, 2, dtype, ((48, 32), (24, 16)), (1, 4, 8, 8), "float32",
                         fp8_scales=dtype == "float8_e4m3fn")  # fmt: skip
    with make(tmp_path, ns, dram=lay.nbytes // 2) as store:
        w = store.writer(KA, lay)
        assert isinstance(w, DiskTemplateWriter) and store.status(KA) == "building"
        w.abort()
        assert store.status(KA) == "absent" and not list(store.disk.entries_dir.iterdir())
        t = capture(store, KA, 1, lay)
        assert store.status(KA) == "disk"  # ready on disk only, never in DRAM
        st = store.stats()
        assert (st["entries_dram"], st["entries_disk"], st["disk_captures"]) == (0, 1, 1)
        with pytest.raises(CacheMiss):  # DRAM cannot take it: without streaming, a miss
            store.acquire(KA)
        with store.acquire(KA, stream=True) as h:
            assert isinstance(h, StreamedTemplate)
            stream_all(h, t)
            assert store.status(KA) == "disk"
        st = store.stats()
        assert st["streams"] == 1 and st["hits_disk"] == 1 and st["corrupt"] == 0
        # each step was read from the file exactly once: header + data
        assert st["bytes_read_disk"] == store.disk.file_nbytes(lay)
        assert store.dram.refcounts(KA) == {}


def test_dram_full_of_entries_in_use_captures_to_disk(tmp_path: Path, ns: str) -> None:
    with make(tmp_path, ns, dram=N) as store:
        ta = capture(store, KA, 1)
        assert store.status(KA) == "dram"
        with store.acquire(KA) as h:  # the only DRAM slot is in use: KB goes to disk
            w = store.writer(KB, LAYOUT)
            assert isinstance(w, DiskTemplateWriter)
            w.abort()
            tb = capture(store, KB, 2)
            assert store.status(KB) == "disk" and same(h.block(4, 1), ta[("y", 4, 1)])
        with store.writer(KC, LAYOUT) as w:
            assert isinstance(w, TemplateWriter)  # DRAM has room again
        # KB fits DRAM once KA is unused: loaded there as before, not streamed
        with store.acquire(KB, stream=True) as h:
            assert not isinstance(h, StreamedTemplate)
            assert same(h.block(3, 0), tb[("y", 3, 0)])


def test_disk_capture_validation(tmp_path: Path, ns: str) -> None:
    with make(tmp_path, ns, dram=N // 2) as store:
        t = template(LAYOUT, 1)
        with store.writer(KA, LAYOUT) as w:
            with pytest.raises(ValueError):
                w.put_block(0, 0, torch.zeros(2, 48, 31))
            with pytest.raises(IndexError):
                w.put_block(5, 0, t[("y", 0, 0)])
            w.put_block(0, 0, t[("y", 0, 0)])
            with pytest.raises(RuntimeError, match="before its blocks"):
                w.put_latents(0, t[("lat", 0)])
            with pytest.raises(RuntimeError, match="one step at a time"):
                w.put_block(1, 0, t[("y", 1, 0)])
            w.put_block(0, 1, t[("y", 0, 1)])
            w.put_latents(0, t[("lat", 0)])
            with pytest.raises(RuntimeError, match="already written"):
                w.put_block(0, 0, t[("y", 0, 0)])
            with pytest.raises(RuntimeError, match="incomplete"):
                w.commit()
        assert store.status(KA) == "absent"
        assert list(store.disk.entries_dir.iterdir()) == []  # the temp file is gone
        capture(store, KA, 1)
        with pytest.raises(ValueError):  # on disk: a second capture must not shadow it
            store.writer(KA, LAYOUT)


def test_staging_is_a_bounded_ring_pinned_once_and_reused(tmp_path: Path, ns: str) -> None:
    with make(tmp_path, ns, dram=N // 2, stream_ring=3) as store:
        t = capture(store, KA, 1)
        pool = store.staging
        # the capture filled one step while the previous one was written: 2 step buffers
        assert (pool.allocations, pool.live, pool.free_bytes) == (2, 2, 2 * STEP_BUF)
        with store.acquire(KA, stream=True) as h:
            assert len(h.buffers) == 3 and all(b.nbytes == STEP_BUF for b in h.buffers)
            # step 0 is read at open, step 1 is already being prefetched
            assert {s.step for s in h._slots} == {0, 1, None}
            for s in range(LAYOUT.num_steps):
                h.block(s, 0)
                held = [x.step for x in h._slots if x.step is not None]
                assert len(held) <= 3 and s in held  # never more steps than the ring
                if s + 1 < LAYOUT.num_steps:
                    assert s + 1 in held  # the next step is read while this one is used
            stream_all(h, t)  # a second pass (steps behind the ring) is read again
            assert pool.live == 3 and pool.live_bytes == 3 * STEP_BUF  # nothing more held
        assert pool.allocations == 3  # the capture's 2 buffers were reused
        for _ in range(3):  # a handle per request: the pool's pinned buffers are reused
            with store.acquire(KA, stream=True) as h:
                stream_all(h, t)
        assert pool.allocations == 3 and pool.free_bytes == 3 * STEP_BUF
        assert store.stats()["staging_bytes"] == 3 * STEP_BUF
    assert pool.live == 0  # closing the store frees them


def test_corrupt_step_mid_edit_is_a_typed_error_and_quarantined(tmp_path: Path, ns: str) -> None:
    with make(tmp_path, ns, dram=N // 2) as store:
        t = capture(store, KA, 1)
        path = store.disk.path(KA)
        size = path.stat().st_size
        with open(path, "r+b") as f:  # one byte of the last step
            f.seek(size - LAYOUT.step_nbytes // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
        h = store.acquire(KA, stream=True)  # step 0 is fine: the edit starts
        for s in range(LAYOUT.num_steps - 1):
            assert same(h.block(s, 1), t[("y", s, 1)])
        with pytest.raises(StreamCorrupt, match="failed verification") as err:
            h.block(LAYOUT.num_steps - 1, 0)
        assert isinstance(err.value, CorruptEntry) and isinstance(err.value, CacheMiss)
        with pytest.raises(StreamCorrupt):  # the handle stays broken
            h.latents(0)
        assert not path.exists() and len(list(store.disk.quarantine_dir.iterdir())) == 1
        assert store.status(KA) == "absent"  # forgotten by the index: captured again
        h.close()
        st = store.stats()
        assert st["corrupt"] == 1 and st["quarantined"] == 1 and st["entries_disk"] == 0
        capture(store, KA, 2)  # a new capture of the same template works
        assert store.status(KA) == "disk"


def test_corrupt_first_step_is_a_plain_miss_at_open(tmp_path: Path, ns: str) -> None:
    with make(tmp_path, ns, dram=N // 2) as store:
        capture(store, KA, 1)
        path = store.disk.path(KA)
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size - N + 10)  # step 0's first chunk
            f.write(b"\xff\xff")
        with pytest.raises(CorruptEntry) as err:
            store.acquire(KA, stream=True)
        assert type(err.value) is CorruptEntry  # not StreamCorrupt: the edit runs in full
        assert store.status(KA) == "absent" and store.stats()["misses"] == 1
        assert store.staging.live == store.staging.allocations  # buffers back in the pool
        assert store.staging.free_bytes == store.staging.live_bytes


def _v1_file(tier: DiskTier, key: str, layout: TemplateLayout, data: bytes) -> None:
    """An entry as format version 1 wrote it: CRC32 over fixed 4096-byte chunks."""
    crcs = [f"{zlib.crc32(data[a : a + 4096]):08x}" for a in range(0, len(data), 4096)]
    header = json.dumps({"chunk_bytes": 4096, "crc32": crcs, "data_bytes": len(data),
                         "layout": layout.to_dict()}, sort_keys=True,
                        separators=(",", ":")).encode()  # fmt: skip
    pre = struct.pack("<8sIII4x", b"IGCACHE\x00", 1, len(header), zlib.crc32(header))
    off = align_up(24 + len(header), 4096)
    tier.path(key).write_bytes((pre + header).ljust(off, b"\0") + data)


def test_old_format_file_is_a_counted_miss_and_removed(tmp_path: Path, ns: str) -> None:
    tier = DiskTier(tmp_path / "probe", None, chunk_bytes=4096)
    _v1_file(tier, KA, LAYOUT, bytes(range(256)) * (N // 256))
    with pytest.raises(StaleFormat):
        tier.read_into(KA, LAYOUT, torch.empty(N, dtype=torch.uint8))
    assert not tier.contains(KA) and list(tier.quarantine_dir.iterdir()) == []
    c = tier.counters()
    assert (c["stale_format"], c["misses"], c["corrupt"]) == (1, 1, 0)
    # a host cache restarted after the upgrade: the old file is dropped, not indexed
    store = make(tmp_path, ns, dram=N // 2)
    store.close()
    _v1_file(store.disk, KB, LAYOUT, bytes(N))
    with make(tmp_path, ns, dram=N // 2) as store:
        assert store.status(KB) == "absent" and not store.disk.contains(KB)
        assert store.stats()["stale_format"] == 1


def test_disk_full_fails_the_capture_and_switches_the_tier_off(tmp_path: Path, ns: str) -> None:
    with make(tmp_path, ns, dram=N // 2) as store:

        def enospc(fd: int, mv: memoryview, off: int) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        store.disk._pwrite = enospc
        with pytest.raises(CacheFull, match="disk: no room"):
            capture(store, KA, 1)
        st = store.stats()
        assert not st["disk_enabled"] and st["enospc"] == 2
        assert store.status(KA) == "absent" and list(store.disk.entries_dir.iterdir()) == []
        with pytest.raises(CacheFull, match="dram.*disk"):  # neither tier can take it now
            store.writer(KA, LAYOUT)
        store.disk._pwrite = os.pwrite
        assert store.recover_disk()
        t = capture(store, KA, 1)
        with store.acquire(KA, stream=True) as h:
            stream_all(h, t)


# ---- end to end: the tiny model through EditPipeline ---------------------------------------------
STEPS = 3


@functools.cache
def _family():
    return load_family("sdxl-inpaint:tiny", dtype="fp64")


def _edit(pipe: EditPipeline) -> tuple[str, EditRequest]:
    img, mask = png_bytes(make_image(128, 128, seed=7)), png_bytes(make_mask(128, 128))
    common = dict(prompt="a linen shirt", seed=9, num_inference_steps=STEPS)
    key = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
    return key, EditRequest(uid="m", image=None, template_id=key, mask=mask, **common)


def _edit_image(pipe: EditPipeline, edit: EditRequest, handle_type: type):  # noqa: ANN202
    s = pipe.preprocess(edit)
    assert s.path == "masked" and isinstance(s.cache_handle, handle_type)
    while not s.is_done:
        pipe.denoise_step([s])
    assert s.cache_handle is None  # released at completion
    return s, pipe.postprocess([s])[0]


def test_edit_streams_a_template_larger_than_dram_and_matches_dram(tmp_path: Path) -> None:
    ns_dram, ns_disk = "e" + uuid.uuid4().hex[:10], "f" + uuid.uuid4().hex[:10]
    big = TieredStore(tmp_path / "dram", ns_dram, 256 << 20, 256 << 20)
    try:
        pipe = EditPipeline(_family(), store=HostActivationStore(big, tmp_path / "dram"))
        key, edit = _edit(pipe)
        assert pipe.store.tier(key) == "dram"
        nbytes = pipe.store.meta(key).nbytes
        want_state, want = _edit_image(pipe, edit, object)
        assert want.cache_tier == "dram"
    finally:
        big.close()
        cleanup(ns_dram)
    # DRAM smaller than one template: captured to disk, every edit streams it
    small = TieredStore(tmp_path / "disk", ns_disk, nbytes // 2, 256 << 20, chunk_bytes=1 << 16)
    try:
        pipe = EditPipeline(_family(), store=HostActivationStore(small, tmp_path / "disk"))
        key2, edit2 = _edit(pipe)
        assert key2 == key and pipe.store.tier(key) == "disk" and pipe.store.status(key) == "ready"
        st = small.stats()
        assert (st["disk_captures"], st["entries_dram"], st["entries_disk"]) == (1, 0, 1)
        got_state, got = _edit_image(pipe, edit2, StreamedHandle)
        assert (got.path, got.cache, got.cache_tier) == ("masked", "hit", "disk")
        assert torch.equal(got_state.latents, want_state.latents)
        assert np.array_equal(np.asarray(got.image), np.asarray(want.image))
        assert got.data == want.data
        st = small.stats()
        assert st["streams"] == 1 and st["entries_dram"] == 0 and st["corrupt"] == 0
        assert small.dram.refcounts(key) == {}
        # through a device step window (what CUDA does): the staging ring's steps are copied a
        # step ahead into the window, and the edit is the same
        ex = pipe.family.masked
        ex.windows = "on"
        try:
            win_state, win = _edit_image(pipe, edit2, StreamedHandle)
        finally:
            ex.windows = "auto"
        assert torch.equal(win_state.latents, want_state.latents) and win.data == want.data
        assert ex._windows[-1].bytes_copied > 0 and ex._windows[-1].stacks == {}  # closed
        # a step corrupted on disk fails the edit that reaches it with the typed error (the
        # serving loop fails that step's batch), and the entry is gone: captured again later
        path = small.disk.path(key)
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size - 1000)  # the last step
            f.write(b"\x5a" * 8)
        s = pipe.preprocess(edit2)
        assert s.path == "masked"  # step 0 verified at open
        # in the serving loop's batch, only that edit fails (before its step computes), with a
        # retryable typed error; its batch mate (a full-path edit) finishes
        mate = pipe.preprocess(EditRequest(uid="mate", image=png_bytes(make_image(128, 128)),
                                           mask=edit2.mask, prompt="x", seed=1,
                                           num_inference_steps=STEPS))  # fmt: skip
        batcher = Batcher(pipe, get_policy("continuous"), max_batch=4)
        batcher.submit(s)
        batcher.submit(mate)
        retired = {}
        while not batcher.idle:
            retired.update((r.state.uid, r.error) for r in batcher.iterate())
        assert retired["mate"] is None and mate.is_done
        code, message = retired["m"]
        assert code == "cache_unreadable" and "StreamCorrupt" in message
        assert s.cache_handle is None  # released
        assert pipe.store.status(key) == "absent" and small.stats()["quarantined"] == 1
        assert pipe.preprocess(edit2).path == "full"
    finally:
        small.close()
        cleanup(ns_disk)
