"""The device tier above the host store (cache/device_tier.py), on CPU: the hot set promotes a
template on its second use, demotes the least recently used copy under budget pressure, never
demotes a copy in use, never promotes one larger than its budget, drops a deleted template's
copy, and is off at budget 0; an edit served from the tier gives the image the host tier gives."""

from __future__ import annotations

import functools
import hashlib
import uuid

import numpy as np
import pytest
import torch

from instgenie.cache.device_tier import DeviceTierStore, auto_budget
from instgenie.cache.host_store import HostActivationStore
from instgenie.cache.quant import FP8, QuantizedRows
from instgenie.cache.shm_segment import cleanup
from instgenie.cache.store import TemplateMeta, tier_of
from instgenie.cache.tiered import TieredStore
from instgenie.config import Config, WorkerConfig
from instgenie.engine.family import load_family
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.worker.child_runtime import make_store
from tests.conftest import make_image, make_mask, png_bytes

STEPS, ROWS, L, C = 2, 2, 16, 8
#: one synthetic template's device copy, bytes: two float32 blocks and float32 latents
BLOCK_SHAPES = {0: (L, C), 1: (L // 2, C)}
LATENTS = (1, 4, 4, 4)
COPY_BYTES = 4 * STEPS * (ROWS * sum(l * c for l, c in BLOCK_SHAPES.values()) + 64)


def _key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


@pytest.fixture
def host(tmp_path):
    ns = uuid.uuid4().hex[:10]
    tiered = TieredStore(tmp_path, ns, dram_capacity_bytes=64 << 20, disk_capacity_bytes=0,
                         disk_enabled=False)  # fmt: skip
    yield HostActivationStore(tiered, tmp_path)
    tiered.close()
    cleanup(ns)


def _capture(store, name: str, seed: int = 0) -> tuple[str, dict]:
    """A synthetic template written through the store's writer (as a capture run does); returns
    its key and the tensors written, {(step, block): y} and {step: latents}."""
    key, g = _key(name), torch.Generator().manual_seed(seed)
    writer = store.writer(key, TemplateMeta(num_steps=STEPS, num_rows=ROWS))
    blocks, latents = {}, {}
    for s in range(STEPS):
        for b, (lb, cb) in BLOCK_SHAPES.items():
            blocks[(s, b)] = torch.randn(ROWS, lb, cb, generator=g)
            writer.put_block(s, b, blocks[(s, b)])
        latents[s] = torch.randn(LATENTS, generator=g)
        writer.put_latents(s, latents[s])
    writer.commit()
    return key, {"blocks": blocks, "latents": latents}


def _tier(host, budget: int, **kw) -> DeviceTierStore:
    return DeviceTierStore(host, "cpu", torch.float32, budget_bytes=budget, **kw)


def _use(store, key: str) -> str:
    """Open and close `key` once; the tier that served it."""
    h = store.open(key)
    served = getattr(h, "tier", None) or "host"
    h.close()
    return served


def test_second_use_is_served_from_the_device_copy_in_the_stacked_layout(host) -> None:
    store = _tier(host, budget=10 * COPY_BYTES)
    key, data = _capture(store, "a")
    assert store.tier(key) == "dram" and store.nbytes == 0
    assert _use(store, key) == "host"  # the first use reads DRAM and promotes
    assert store.tier(key) == "cpu" and tier_of(store, key) == "cpu"
    assert store.nbytes == COPY_BYTES
    h = store.open(key)
    assert h.tier == "cpu" and h.device == torch.device("cpu")
    for (s, b), y in data["blocks"].items():
        stack = h.block_steps(b, h.device)
        assert stack.shape == (STEPS, ROWS, *BLOCK_SHAPES[b]) and stack.is_contiguous()
        assert torch.equal(stack[s], y) and torch.equal(h.block(s, b), y)
    for s, lat in data["latents"].items():
        assert torch.equal(h.latents(s), lat)
    h.close()
    st = store.stats()
    assert (st["promotions_cpu"], st["hits_cpu"], st["entries_cpu"]) == (1, 1, 1)
    assert st["bytes_cpu"] == COPY_BYTES and st["budget_cpu_bytes"] == 10 * COPY_BYTES
    assert st["bytes_dram"] > 0  # inclusive: the host keeps its entry
    assert store.bytes_by_tier(key) == {"cpu": COPY_BYTES, "dram": store.host.meta(key).nbytes}


def test_promote_after_counts_opens(host) -> None:
    store = _tier(host, budget=10 * COPY_BYTES, promote_after=3)
    key, _ = _capture(store, "a")
    assert [_use(store, key) for _ in range(4)] == ["host", "host", "host", "cpu"]


def test_lru_copy_is_demoted_to_make_room(host) -> None:
    store = _tier(host, budget=2 * COPY_BYTES)
    a, b, c = (_capture(store, n)[0] for n in "abc")
    for k in (a, b):
        _use(store, k)
    assert store.tier(a) == store.tier(b) == "cpu"
    _use(store, a)  # a is now the most recently used: b is the LRU copy
    _use(store, c)  # promoting c needs room: b goes
    assert [store.tier(k) for k in (a, b, c)] == ["cpu", "dram", "cpu"]
    st = store.stats()
    assert (st["demotions_cpu"], st["evictions_cpu"], st["promotions_cpu"]) == (1, 1, 3)
    assert store.nbytes == 2 * COPY_BYTES
    assert store.status(b) == "ready"  # demoted from the device: still in the host store


def test_a_copy_in_use_is_never_demoted(host) -> None:
    store = _tier(host, budget=COPY_BYTES)
    a, b = (_capture(store, n)[0] for n in "ab")
    _use(store, a)
    held = store.open(a)  # in use: pins a's copy
    assert held.tier == "cpu"
    for _ in range(3):  # b wants the room a holds
        assert _use(store, b) == "host"
    assert store.tier(a) == "cpu" and store.tier(b) == "dram"
    assert store.stats()["demotions_cpu"] == 0
    held.close()
    _use(store, b)  # a is free now: demoted for b
    assert store.tier(a) == "dram" and store.tier(b) == "cpu"
    held.close()  # closing twice is harmless


def test_a_template_larger_than_the_budget_is_never_promoted(host) -> None:
    store = _tier(host, budget=COPY_BYTES - 1)
    key, _ = _capture(store, "a")
    assert [_use(store, key) for _ in range(3)] == ["host"] * 3
    assert store.nbytes == 0 and store.stats()["promotions_cpu"] == 0


def test_delete_drops_the_device_copy(host) -> None:
    store = _tier(host, budget=10 * COPY_BYTES)
    key, _ = _capture(store, "a")
    _use(store, key)
    assert store.tier(key) == "cpu"
    store.delete(key)
    assert store.status(key) == "absent" and store.nbytes == 0
    # captured again: the promotion count starts over (first use from DRAM)
    _capture(store, "a", seed=1)
    assert _use(store, key) == "host"


def test_delete_while_a_handle_reads_the_copy(host) -> None:
    store = _tier(host, budget=COPY_BYTES)
    key, data = _capture(store, "a")
    _use(store, key)
    held = store.open(key)
    store.delete(key)
    assert store.status(key) == "absent"
    assert torch.equal(held.block(0, 0), data["blocks"][(0, 0)])  # still readable
    assert store.nbytes == COPY_BYTES  # counted until the last handle closes
    held.close()
    assert store.nbytes == 0


def test_budget_zero_is_off_and_a_smaller_budget_demotes(host) -> None:
    store = _tier(host, budget=0)
    key, _ = _capture(store, "a")
    assert [_use(store, key) for _ in range(3)] == ["host"] * 3
    assert store.nbytes == 0 and store.tier(key) == "dram"
    store.set_budget(COPY_BYTES)
    _use(store, key)
    assert store.tier(key) == "cpu"
    store.set_budget(0)
    assert store.tier(key) == "dram" and store.nbytes == 0
    assert store.stats()["demotions_cpu"] == 1


def test_fp8_host_entries_are_dequantised_for_the_graph_path(tmp_path) -> None:
    ns = uuid.uuid4().hex[:10]
    tiered = TieredStore(tmp_path, ns, dram_capacity_bytes=64 << 20, disk_capacity_bytes=0,
                         disk_enabled=False)  # fmt: skip
    try:
        store = _tier(HostActivationStore(tiered, tmp_path, dtype=FP8), budget=10 * COPY_BYTES)
        key, _ = _capture(store, "a")
        host_h = store.open(key)  # promotes
        cached = host_h.block(1, 0)
        assert isinstance(cached, QuantizedRows)
        dev_h = store.open(key)
        assert dev_h.block_steps(0, dev_h.device).dtype == torch.float32  # the activation dtype
        assert torch.equal(dev_h.block(1, 0), cached.dequantize(torch.float32))
        assert store.nbytes == COPY_BYTES  # dequantised bytes
        host_h.close()
        dev_h.close()
    finally:
        tiered.close()
        cleanup(ns)


def test_make_store_wires_the_tier_only_where_asked(tmp_path) -> None:
    def cfg(gpu_bytes: int) -> Config:
        w = WorkerConfig(cache_root=str(tmp_path), cache_dram_bytes=16 << 20, cache_disk_bytes=0,
                         cache_gpu_bytes=gpu_bytes)  # fmt: skip
        return Config(worker=w)

    namespace = hashlib.sha256(str(tmp_path.resolve()).encode()).hexdigest()[:12]
    stores = []
    try:
        explicit = make_store(cfg(1 << 20), "cpu", torch.float32, device_tier=True)
        stores.append(explicit.tiered)
        assert isinstance(explicit, DeviceTierStore) and explicit.budget_bytes == 1 << 20
        for store in (
            make_store(cfg(-1), "cpu", torch.float32, device_tier=True),  # auto on CPU: off
            make_store(cfg(0), "cpu", torch.float32, device_tier=True),
            make_store(cfg(1 << 20), "cpu", torch.float32),  # pre/post processes: no tier
        ):
            stores.append(store.tiered)
            assert isinstance(store, HostActivationStore)
        assert auto_budget("cpu") == 0
    finally:
        for t in stores:
            t.close()
        cleanup(namespace)


# ---- end to end: an edit served from DRAM, then from the device tier --------------------------
@functools.cache
def _family():
    return load_family("sdxl-inpaint:tiny")


def test_edit_from_the_device_tier_equals_the_edit_from_dram(host) -> None:
    fam = _family()
    store = DeviceTierStore(host, fam.device, fam.dtype, budget_bytes=64 << 20)
    pipe = EditPipeline(fam, store=store)
    img, mask = png_bytes(make_image(64, 64, seed=7)), png_bytes(make_mask(64, 64))
    common = dict(prompt="a linen shirt", seed=9, num_inference_steps=2)
    key = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
    assert store.tier(key) == "dram"

    def edit(uid: str):
        req = EditRequest(uid=uid, image=None, template_id=key, mask=mask, **common)
        state = pipe.preprocess(req)
        while not state.is_done:
            pipe.denoise_step([state])
        return state, pipe.postprocess([state])[0]

    (s1, first), (s2, second) = edit("e1"), edit("e2")
    assert (first.path, first.cache, first.cache_tier) == ("masked", "hit", "dram")
    assert (second.path, second.cache, second.cache_tier) == ("masked", "hit", "cpu")
    assert torch.equal(s1.latents, s2.latents)
    assert torch.equal(torch.from_numpy(np.array(first.image)),
                       torch.from_numpy(np.array(second.image)))  # fmt: skip
    st = store.stats()
    assert (st["promotions_cpu"], st["hits_cpu"], st["entries_cpu"]) == (1, 1, 1)
    assert store.nbytes == st["bytes_cpu"] > 0
