"""Capture copies through the staging pool (decision 0046): bytes land exactly where a direct copy
puts them, pages are backed by the copy threads (not at segment creation), a full /dev/shm makes
the capture record nothing instead of failing its batch, and the pool's back-pressure holds with
fewer slots than chunks."""

from __future__ import annotations

import errno
import functools
import os
import threading
import uuid

import pytest
import torch

from instgenie.cache.capture_stage import CaptureStager, StageTicket
from instgenie.cache.host_store import HostActivationStore
from instgenie.cache.quant import FP8
from instgenie.cache.shm_segment import SHM_DIR, Segment, cleanup, segment_name
from instgenie.cache.store import TemplateMeta
from instgenie.cache.tiered import TieredStore
from instgenie.engine.family import load_family
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from tests.conftest import make_image, make_mask, png_bytes


@pytest.fixture
def stager():
    s = CaptureStager(slot_bytes=1000, slots=2, threads=3)  # odd slot size: chunks split rows
    yield s
    s.close()


def test_staged_copies_land_as_direct_copies_with_casts_and_split_chunks(stager) -> None:
    g = torch.Generator().manual_seed(0)
    ticket = StageTicket()
    pairs = []
    for shape, src_dtype, dst_dtype in [
        ((3, 50, 16), torch.float32, torch.float16),  # 4800 B: five chunks through two slots
        ((7,), torch.float64, torch.float64),
        ((2, 300), torch.float32, torch.bfloat16),
    ]:
        src = torch.randn(shape, generator=g, dtype=src_dtype)
        dst = torch.zeros(shape, dtype=dst_dtype)
        stager.copy(ticket, dst, src)
        pairs.append((dst, src))
    stager.drain(ticket)
    for dst, src in pairs:
        assert torch.equal(dst, src.to(dst.dtype))
    assert stager.bytes_copied == sum(d.numel() * d.element_size() for d, _ in pairs)


def test_each_range_is_backed_by_the_copy_thread_before_it_is_written(stager) -> None:
    dst = torch.zeros(4096, dtype=torch.uint8)
    backed: list[tuple[int, int]] = []
    written_before: list[bool] = []
    lock = threading.Lock()

    def back(ptr: int, n: int) -> None:
        lo = ptr - dst.data_ptr()
        with lock:
            written_before.append(bool(dst[lo : lo + n].any()))
            backed.append((lo, n))
        assert threading.current_thread().name.startswith("capture-stage")

    ticket = StageTicket()
    stager.copy(ticket, dst, torch.full((4096,), 7, dtype=torch.uint8), back)
    stager.drain(ticket)
    assert bool((dst == 7).all())
    assert sorted(backed) == [(i, min(1000, 4096 - i)) for i in range(0, 4096, 1000)]
    assert not any(written_before)


def test_a_failed_copy_is_raised_by_drain_and_the_next_copy_and_frees_its_slots(stager) -> None:
    ticket = StageTicket()

    def full(ptr: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    stager.copy(ticket, torch.zeros(3000, dtype=torch.uint8), torch.ones(3000, dtype=torch.uint8),
                full)  # fmt: skip
    with pytest.raises(OSError, match="No space"):
        stager.drain(ticket)
    with pytest.raises(OSError):
        stager.copy(ticket, torch.zeros(4), torch.ones(4))
    # the pool is whole again: another writer's copies go through
    other = StageTicket()
    dst = torch.zeros(5000, dtype=torch.uint8)
    stager.copy(other, dst, torch.ones(5000, dtype=torch.uint8))
    stager.drain(other)
    assert bool((dst == 1).all())
    with pytest.raises(ValueError, match="shape"):
        stager.copy(other, torch.zeros(3), torch.ones(4))


# ---- through the host store -------------------------------------------------------------------
STEPS = 3


@functools.cache
def _family():
    return load_family("sdxl-inpaint:tiny", dtype="fp64")


def _store(tmp_path, ns: str, copies: str) -> HostActivationStore:
    tiered = TieredStore(tmp_path / copies, ns, dram_capacity_bytes=64 << 20, disk_capacity_bytes=0)
    store = HostActivationStore(tiered, tmp_path / copies)
    store.capture_copies = copies
    return store


def _run(pipe, req):
    s = pipe.preprocess(req)
    while not s.is_done:
        pipe.denoise_step([s])
    return s


def test_a_staged_capture_stores_the_bytes_of_a_direct_one_and_replays_exactly(tmp_path) -> None:
    ns = uuid.uuid4().hex[:10]
    img, mask = png_bytes(make_image(128, 128, seed=7)), png_bytes(make_mask(128, 128))
    common = dict(prompt="a linen shirt", seed=9, num_inference_steps=STEPS)
    entries, pipes = {}, {}
    try:
        for copies in ("direct", "staged"):
            store = _store(tmp_path, ns + copies[0], copies)
            pipe = pipes[copies] = EditPipeline(_family(), store=store)
            key = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
            assert store.status(key) == "ready"
            host = store.tiered.acquire(key)
            entries[copies] = host.data.clone()
            host.close()
        assert torch.equal(entries["staged"], entries["direct"])
        pipe = pipes["staged"]
        full = _run(pipe, EditRequest(uid="f", image=img, mask=mask, **common))
        edit = _run(pipe, EditRequest(uid="m", image=None, template_id=key, mask=mask, **common))
        assert edit.path == "masked"
        assert float((edit.latents - full.latents).abs().max()) <= 1e-9 * float(
            full.latents.abs().max()
        )
    finally:
        for p in pipes.values():
            p.store.tiered.close()
        cleanup(ns + "d")
        cleanup(ns + "s")


def _meta() -> TemplateMeta:
    return TemplateMeta(num_steps=2, num_rows=1, timesteps=(1.0, 0.5))


def _allocated(ns: str, key: str) -> int:
    return os.stat(SHM_DIR / segment_name(ns, key)).st_blocks * 512


def test_staged_segments_are_backed_by_the_copies_not_at_creation(tmp_path) -> None:
    ns = uuid.uuid4().hex[:10]
    store = _store(tmp_path, ns, "staged")
    key = "ab" * 32
    try:
        w = store.writer(key, _meta())
        big = torch.randn(1, 2048, 64)  # 1 MiB a block in fp64
        w.put_block(0, 0, big)
        w.put_block(0, 1, big)
        w.put_latents(0, torch.randn(1, 4, 8, 8))  # the layout is known: the segment exists
        layout = w._writer.layout
        created = _allocated(ns, key)
        step0 = 2 * big.numel() * big.element_size() + 4 * 8 * 8 * 4
        # the header and step 0's copies (which may have landed already), not step 1's half
        assert created <= step0 + 8 * 4096 < layout.nbytes
        for b in range(2):
            w.put_block(1, b, big)
        w.put_latents(1, torch.randn(1, 4, 8, 8))
        w.commit()
        assert _allocated(ns, key) >= layout.nbytes
        host = store.tiered.acquire(key)
        assert torch.equal(host.block(1, 1), big)
        host.close()
    finally:
        store.tiered.close()
        cleanup(ns)


def test_a_full_shm_makes_a_staged_capture_record_nothing(tmp_path, monkeypatch) -> None:
    ns = uuid.uuid4().hex[:10]
    store = _store(tmp_path, ns, "staged")
    key = "cd" * 32
    calls = []

    def full(self, ptr: int, n: int) -> None:
        calls.append(n)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Segment, "back", full)
    try:
        w = store.writer(key, _meta())
        for s in range(2):
            for b in range(2):
                w.put_block(s, b, torch.randn(1, 16, 8))  # never raises into the step
            w.put_latents(s, torch.randn(1, 4, 4, 4))
        w.commit()
        assert calls and w.no_room.startswith("DRAM segment")
        assert store.status(key) == "absent"
        assert not (SHM_DIR / segment_name(ns, key)).exists()
    finally:
        store.tiered.close()
        cleanup(ns)


def test_fp8_entries_stage_their_scales_too(tmp_path) -> None:
    ns = uuid.uuid4().hex[:10]
    stores = {c: _store(tmp_path, ns + c[0], c) for c in ("direct", "staged")}
    g = torch.Generator().manual_seed(3)
    blocks = [torch.randn(1, 16, 8, generator=g) for _ in range(4)]
    lat = [torch.randn(1, 4, 4, 4, generator=g) for _ in range(2)]
    try:
        data = {}
        for copies, store in stores.items():
            store.dtype = FP8
            w = store.writer("ef" * 32, _meta())
            for s in range(2):
                for b in range(2):
                    w.put_block(s, b, blocks[2 * s + b])
                w.put_latents(s, lat[s])
            w.commit()
            host = store.tiered.acquire("ef" * 32)
            data[copies] = host.data.clone()
            host.close()
        assert torch.equal(data["staged"], data["direct"])
    finally:
        for c, store in stores.items():
            store.tiered.close()
            cleanup(ns + c[0])
