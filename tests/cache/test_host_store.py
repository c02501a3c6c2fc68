"""The engine on the tiered host store: replay exactness through DRAM and disk, misses on
corruption fall back to full computation, fp8 entries, and pinning bookkeeping."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import uuid

import pytest
import torch

from instgenie.cache import host_store, host_template
from instgenie.cache.host_store import HostActivationStore
from instgenie.cache.index import CacheFull, TooLarge
from instgenie.cache.quant import FP8
from instgenie.cache.shm_segment import cleanup
from instgenie.cache.store import TemplateMeta
from instgenie.cache.tiered import TieredStore
from instgenie.engine.family import load_family
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.scheduler.batching import get_policy
from instgenie.worker.batcher import Batcher
from tests.conftest import make_image, make_mask, png_bytes

STEPS = 3


@functools.cache
def _family():
    return load_family("sdxl-inpaint:tiny", dtype="fp64")


@pytest.fixture
def host_pipe(tmp_path):
    ns = uuid.uuid4().hex[:10]
    tiered = TieredStore(tmp_path, ns, dram_capacity_bytes=64 << 20, disk_capacity_bytes=256 << 20)
    store = HostActivationStore(tiered, tmp_path)
    yield EditPipeline(_family(), store=store)
    tiered.close()
    cleanup(ns)


def _run(pipe, req):
    s = pipe.preprocess(req)
    while not s.is_done:
        pipe.denoise_step([s])
    return s


def _replay(pipe):
    img, mask = png_bytes(make_image(128, 128, seed=7)), png_bytes(make_mask(128, 128))
    common = dict(prompt="a linen shirt", seed=9, num_inference_steps=STEPS)
    key = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
    full = _run(pipe, EditRequest(uid="f", image=img, mask=mask, **common))
    edit = EditRequest(uid="m", image=None, template_id=key, mask=mask, **common)
    return key, full, edit


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert float((a - b).abs().max()) <= 1e-9 * float(b.abs().max())


def test_replay_exact_through_dram_then_disk(host_pipe) -> None:
    pipe = host_pipe
    key, full, edit = _replay(pipe)
    assert pipe.store.tier(key) == "dram"
    s = _run(pipe, edit)
    assert s.path == "masked"
    _close(s.latents, full.latents)
    # persist, drop the DRAM copy: the next edit loads from disk (checksummed) and is still exact
    assert pipe.store.tiered.persist(key)
    pipe.store.tiered.dram.delete(key)
    assert pipe.store.tier(key) == "disk"
    s2 = _run(pipe, edit)
    assert s2.path == "masked" and pipe.store.tier(key) == "dram"
    _close(s2.latents, full.latents)
    assert pipe.store.tiered.stats()["bytes_read_disk"] > 0


def test_corrupt_disk_entry_falls_back_to_full(host_pipe, tmp_path) -> None:
    pipe = host_pipe
    key, full, edit = _replay(pipe)
    assert pipe.store.tiered.persist(key)
    pipe.store.tiered.dram.delete(key)
    path = pipe.store.tiered.disk.entries_dir / f"{key}.igc"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # flip one byte of the activations
    path.write_bytes(bytes(data))
    s = pipe.preprocess(edit)
    assert (s.path, s.notes.cache) == ("full", "miss")
    pipe.release(s)
    stats = pipe.store.tiered.stats()
    assert stats["corrupt"] == 1 and stats["quarantined"] == 1
    assert pipe.store.status(key) == "absent"


def test_handles_are_released(host_pipe) -> None:
    pipe = host_pipe
    key, _, edit = _replay(pipe)
    s = _run(pipe, edit)
    assert s.cache_handle is None  # released at completion
    assert pipe.store.tiered.dram._mapped[key].users == 0  # kept mapped, unused
    refs = pipe.store.tiered.dram.refcounts(key)
    assert sum(refs.values()) == 0


def test_a_mapping_is_pinned_once_and_unpinned_when_its_entry_goes(tmp_path, monkeypatch) -> None:
    """Registering tens of GB as pinned memory takes seconds: a process maps and pins a ready
    segment once and keeps it across handles (requests), and unpins and unmaps it only once it
    is idle and its entry is gone (deleted here, or evicted by any process of the host)."""
    ns = uuid.uuid4().hex[:10]
    hs = _host_store(tmp_path, ns)
    other = _host_store(tmp_path, ns)  # another worker of the host, same cache
    pins, unpins = [], []
    monkeypatch.setattr(host_store, "pin", lambda t: pins.append(t.data_ptr()) or True)
    monkeypatch.setattr(host_store, "unpin", lambda t: unpins.append(t.data_ptr()) or True)
    hs.pin_memory = True
    try:
        keys = ["ab" * 32, "cd" * 32]
        for key in keys:
            _commit_tiny(hs, key)
        h1, h2 = hs.open(keys[0]), hs.open(keys[0])
        seg = h1._host.segment
        assert h2._host.segment is seg and seg.users == 2 and len(pins) == 1
        h1.close()
        h2.close()
        assert seg.users == 0 and seg.data is not None  # idle, still mapped and pinned
        h3 = hs.open(keys[0])  # a later request: no new mapping, no new registration
        assert h3._host.segment is seg and len(pins) == 1
        h3.close()
        other.delete(keys[0])  # gone from the host (another process deleted it)
        hs.open(keys[1]).close()  # any later use of the tier sweeps idle mappings
        assert unpins == [pins[0]] and seg.data is None and keys[0] not in hs.tiered.dram._mapped
        hs.delete(keys[1])  # deleted by this process: unpinned and unmapped at once
        assert len(unpins) == 2 and hs.tiered.dram._mapped == {}
    finally:
        hs.tiered.close()
        other.tiered.close()
        cleanup(ns)


def _commit_tiny(hs: HostActivationStore, key: str) -> None:
    w = hs.writer(key, TemplateMeta(num_steps=2, num_rows=1, timesteps=(1.0, 0.5)))
    for s in range(2):
        for b in range(2):
            w.put_block(s, b, torch.randn(1, 16, 8))
        w.put_latents(s, torch.randn(1, 4, 4, 4))
    w.commit()


def test_fp8_host_entries(tmp_path) -> None:
    ns = uuid.uuid4().hex[:10]
    fam = load_family("sdxl-inpaint:tiny")
    tiered = TieredStore(tmp_path, ns, dram_capacity_bytes=64 << 20, disk_capacity_bytes=0,
                         disk_enabled=False)  # fmt: skip
    try:
        pipe = EditPipeline(fam, store=HostActivationStore(tiered, tmp_path, dtype=FP8))
        img = png_bytes(make_image(128, 128, seed=8))
        key = pipe.build_template(TemplateSpec(image=img, num_inference_steps=STEPS))
        meta = pipe.store.meta(key)
        assert meta.cache_dtype == "float8_e4m3fn"
        s = _run(
            pipe,
            EditRequest(
                uid="q",
                image=None,
                template_id=key,
                prompt="x",
                mask=png_bytes(make_mask(128, 128)),
                num_inference_steps=STEPS,
            ),
        )
        assert s.path == "masked" and torch.isfinite(s.latents).all()
    finally:
        tiered.close()
        cleanup(ns)
    assert not [n for n in os.listdir("/dev/shm") if ns in n]


def test_prefetch_at_queue_time_loads_disk_entry_once(host_pipe) -> None:
    pipe = host_pipe
    key, full, edit = _replay(pipe)
    assert pipe.store.tiered.persist(key)
    pipe.store.tiered.dram.delete(key)
    assert pipe.store.tier(key) == "disk"
    fut = pipe.prefetch(key)  # the request is queued: start the disk read now
    assert fut is not None
    fut.result(timeout=60)
    assert pipe.store.tier(key) == "dram"
    read = pipe.store.tiered.stats()["bytes_read_disk"]
    s = _run(pipe, edit)
    assert s.path == "masked"
    assert pipe.store.tiered.stats()["bytes_read_disk"] == read  # no second disk read
    _close(s.latents, full.latents)
    assert pipe.prefetch("f" * 64) is None  # unknown template: nothing to do


_KILLED_AFTER_COMMIT = """
import os, sys, torch
from instgenie.cache.host_store import HostActivationStore
from instgenie.cache.store import TemplateMeta
from instgenie.cache.host_template import TemplateWriter
from instgenie.cache.tiered import TieredStore
root, ns, key = sys.argv[1:]
hs = HostActivationStore(TieredStore(root, ns, 1 << 22, 1 << 24, chunk_bytes=4096), root)
w = hs.writer(key, TemplateMeta(num_steps=2, num_rows=1, timesteps=(1.0, 0.5)))
for s in range(2):
    for b in range(2):
        w.put_block(s, b, torch.randn(1, 16, 8))
    w.put_latents(s, torch.randn(1, 4, 4, 4))
commit = TemplateWriter.commit
def killed(self):  # SIGKILL / OOM killer the moment the entry is ready to every process
    commit(self)
    os._exit(9)
TemplateWriter.commit = killed
w.commit()
"""


def _host_store(root, ns: str) -> HostActivationStore:
    return HostActivationStore(TieredStore(root, ns, 1 << 22, 1 << 24, chunk_bytes=4096), root)


def test_a_capture_killed_at_commit_leaves_a_usable_entry(tmp_path) -> None:
    """Every process sees an entry as ready only once its meta (what an edit must match) is on
    disk: a capture killed right after its commit leaves a usable template."""
    ns, key = uuid.uuid4().hex[:10], "ab" * 32
    r = subprocess.run([sys.executable, "-c", _KILLED_AFTER_COMMIT, str(tmp_path), ns, key])
    assert r.returncode == 9
    hs = _host_store(tmp_path, ns)
    try:
        assert hs.status(key) == "ready"
        assert hs.meta(key).timesteps == (1.0, 0.5) and hs.meta(key).nbytes > 0
        with pytest.raises(KeyError, match="already ready"):
            hs.writer(key, TemplateMeta(num_steps=2, num_rows=1))
        # a ready entry whose meta file is gone (removed by hand) is removed: captured again
        (tmp_path / "meta" / f"{key}.json").unlink()
        fresh = _host_store(tmp_path, ns)
        try:
            assert fresh.status(key) == "absent" and hs.tiered.status(key) == "absent"
            fresh.writer(key, TemplateMeta(num_steps=2, num_rows=1)).abort()
        finally:
            fresh.tiered.close()
    finally:
        hs.tiered.close()
        cleanup(ns)


def test_a_failed_pin_does_not_leak_the_reference(tmp_path, monkeypatch) -> None:
    """open() takes a reference and then pins the pages (CUDA): if pinning fails, the reference
    is released (a leaked one keeps the entry from ever being evicted or deleted)."""
    ns, key = uuid.uuid4().hex[:10], "cd" * 32
    hs = _host_store(tmp_path, ns)
    try:
        w = hs.writer(key, TemplateMeta(num_steps=1, num_rows=1, timesteps=(1.0,)))
        w.put_block(0, 0, torch.randn(1, 16, 8))
        w.put_latents(0, torch.randn(1, 4, 4, 4))
        w.commit()

        def fail(t: torch.Tensor) -> bool:
            raise RuntimeError("cudaHostRegister failed with CUDA error 2")

        hs.pin_memory = True
        monkeypatch.setattr(host_store, "pin", fail)
        with pytest.raises(RuntimeError, match="cudaHostRegister"):
            hs.open(key)
        assert hs.tiered.dram._mapped[key].pinned is None
        hs.delete(key)  # EntryInUse if the reference had leaked
        assert hs.status(key) == "absent"
    finally:
        hs.tiered.close()
        cleanup(ns)


def test_a_capture_with_no_room_records_nothing_and_the_batch_goes_on(tmp_path) -> None:
    """DRAM holds one template, disk is off, and that template is in use by an edit: a second
    template's capture, batched with the edit, cannot reserve room. It records nothing and says
    why (capture_no_room); the step does not fail, and the edit beside it finishes masked."""
    used = 0
    for dram in (64 << 20, None):  # a first run measures one template's DRAM bytes
        ns = uuid.uuid4().hex[:10]
        root = tmp_path / ns
        tiered = TieredStore(root, ns, dram_capacity_bytes=dram or used, disk_capacity_bytes=0)
        try:
            pipe = EditPipeline(_family(), store=HostActivationStore(tiered, root))
            key, full, edit = _replay(pipe)
            used = int(tiered.stats()["bytes_dram"])
            if dram is not None:
                continue
            img2 = png_bytes(make_image(128, 128, seed=8))
            other = pipe.register_template(TemplateSpec(image=img2, prompt="a coat", seed=2,
                                                        num_inference_steps=STEPS))  # fmt: skip
            s_edit = pipe.preprocess(edit)  # reads `key`: its entry is in use until it is done
            s_cap = pipe.capture_state(other)
            batcher = Batcher(pipe, get_policy("continuous"), max_batch=4)
            for s in (s_edit, s_cap):
                batcher.submit(s)
            retired = {}
            while not batcher.idle:
                retired.update((r.state.uid, (r.error, batcher.steps)) for r in batcher.iterate())
            assert s_edit.path == "masked" and s_edit.is_done
            _close(s_edit.latents, full.latents)
            assert pipe.store.status(other) == "absent"  # nothing committed
            assert "do not fit" in s_cap.notes.capture_no_room
            assert not s_cap.notes.capture_too_large  # it fits once the edit is done
            # the capture left after its first step (recording nothing, it would only spend
            # steps), answered without an error; the edit ran all of its steps
            assert retired[s_cap.uid] == (None, 1) and not s_cap.is_done
            assert retired[s_edit.uid] == (None, STEPS) and batcher.steps == STEPS
            assert s_cap.uid in batcher.records[0].left and s_cap.writer is None
        finally:
            tiered.close()
            cleanup(ns)


def test_a_template_larger_than_every_tier_is_too_large_for_good(tmp_path) -> None:
    """A layout larger than the DRAM tier's whole capacity and than the disk tier's (or with
    the disk tier off) raises TooLarge, saying both capacities; one that some tier could hold
    once its entries leave raises the plain CacheFull of "no room now"."""
    layout = _tiny_layout()
    for disk, words in ((0, "disk tier (off)"), (layout.nbytes - 1, "disk tier (2.5 KiB)")):
        ns = uuid.uuid4().hex[:10]
        tiered = TieredStore(tmp_path / ns, ns, dram_capacity_bytes=layout.nbytes - 1,
                             disk_capacity_bytes=disk)  # fmt: skip
        try:
            with pytest.raises(TooLarge, match=r"larger than this host's dram tier \(2.5 KiB\)"):
                tiered.writer("ab" * 32, layout)
            with pytest.raises(TooLarge, match=re.escape(words)):
                tiered.writer("ab" * 32, layout)
            assert tiered.status("ab" * 32) == "absent"
        finally:
            tiered.close()
            cleanup(ns)
    ns = uuid.uuid4().hex[:10]
    tiered = TieredStore(tmp_path / ns, ns, dram_capacity_bytes=layout.nbytes,
                         disk_capacity_bytes=0)  # fmt: skip
    try:
        first = tiered.writer("ab" * 32, layout)  # building: in use, never evicted
        with pytest.raises(CacheFull) as info:
            tiered.writer("cd" * 32, layout)
        assert not isinstance(info.value, TooLarge)
        first.abort()
    finally:
        tiered.close()
        cleanup(ns)


def _tiny_layout():
    from instgenie.cache.layout import TemplateLayout

    return TemplateLayout(num_steps=2, rows=1, dtype="float32", block_shapes=((16, 8), (16, 8)),
                          latent_shape=(1, 4, 4, 4), latent_dtype="float32")  # fmt: skip


def _fill(w) -> None:
    for s in range(2):
        for b in range(2):
            w.put_block(s, b, torch.randn(1, 16, 8))
        w.put_latents(s, torch.randn(1, 4, 4, 4))


def test_a_pinned_capture_hands_its_mapping_to_readers_and_unpins_it_once(
    tmp_path, monkeypatch
) -> None:
    """A capture that pinned its segment (TemplateWriter.pin, CUDA) keeps that mapping as the
    process's mapping of the ready entry: a reader pins nothing more, and the pages are unpinned
    once, when the entry goes. An aborted pinned capture unpins at once. Pinning bookkeeping only
    (pin/unpin stand in for cudaHostRegister/Unregister on this CPU machine)."""
    ns = uuid.uuid4().hex[:10]
    hs = _host_store(tmp_path, ns)
    writer_pins, reader_pins, unpins = [], [], []
    monkeypatch.setattr(host_template, "pin", lambda t: writer_pins.append(t.data_ptr()) or True)
    monkeypatch.setattr(host_template, "unpin", lambda t: unpins.append(t.data_ptr()) or True)
    monkeypatch.setattr(host_store, "pin", lambda t: reader_pins.append(t.data_ptr()) or True)
    monkeypatch.setattr(host_store, "unpin", lambda t: unpins.append(t.data_ptr()) or True)
    hs.pin_memory = True
    key, lost = "ab" * 32, "cd" * 32
    try:
        w = hs.tiered.writer(key, _tiny_layout())
        assert w.pin() and w.pin()  # once: the second call registers nothing
        _fill(w)
        w.commit()
        assert len(writer_pins) == 1
        seg = hs.tiered.dram._mapped[key]
        assert seg.pinned == {} and seg.users == 0 and seg.data is not None
        h = hs.open(key)  # the capture's mapping, already pinned
        assert h._host.segment is seg and reader_pins == []
        h.close()
        hs.tiered.delete(key)
        assert unpins == writer_pins and seg.data is None

        w = hs.tiered.writer(lost, _tiny_layout())
        w.pin()
        w.put_block(0, 0, torch.randn(1, 16, 8))
        w.abort()
        assert len(unpins) == 2 and hs.tiered.status(lost) == "absent"
    finally:
        hs.tiered.close()
        cleanup(ns)


def test_a_capture_whose_pin_fails_copies_without_it(tmp_path, monkeypatch, caplog) -> None:
    """cudaHostRegister can fail (the locked-memory limit): the capture goes on with pageable
    copies and commits a readable entry; the failure is logged, never the step's."""
    ns, key = uuid.uuid4().hex[:10], "ef" * 32
    hs = _host_store(tmp_path, ns)

    def fail(t: torch.Tensor) -> bool:
        raise RuntimeError("cudaHostRegister failed with CUDA error 2")

    monkeypatch.setattr(host_template, "pin", fail)
    try:
        w = hs.tiered.writer(key, _tiny_layout())
        assert not w.pin() and "pinning its DRAM segment failed" in caplog.text
        _fill(w)
        w.commit()
        assert hs.tiered.status(key) == "dram"  # ready in DRAM
        assert key not in hs.tiered.dram._mapped  # unpinned mappings are not kept
    finally:
        hs.tiered.close()
        cleanup(ns)
