"""Where templates are built and where the server believes their caches live (templates.py).

Real: a pool of two CPU workers (tiny SD2) made to look like two nodes (`slot.node`), each with
its own host cache root whose DRAM tier holds one template (as two Ray nodes would): a template
is built on one node only and is ready once that node has it; an edit routed to the other node
registers it there first (its capture runs, the edit takes the full path beside it) and the next
edit there is masked; a template evicted by a later one on its node leaves that worker's
`templates_ready` at the next health poll. Without processes: the node-wide sharing of DRAM/disk
residency between the workers of one node (fake slots, the registry's own logic).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from instgenie.config import Config, LimitsConfig, ModelConfig, WorkerConfig
from instgenie.messages import RegisterTemplate, TemplateReady
from instgenie.server.config import ServerConfig
from instgenie.server.native import _template_view
from instgenie.server.pool import WorkerPool, WorkerSlot
from instgenie.server.runtime import Runtime
from instgenie.server.templates import (
    TemplateRecord,
    TemplateRegistry,
    WorkerBuild,
    template_id_of,
)
from instgenie.tensorshm import SHM_DIR
from instgenie.worker.names import capture_uid
from tests.conftest import make_image, make_mask, png_bytes

MODEL = "sd2-inpaint:tiny"
SIZE = 64
STEPS = 2
#: one node's DRAM tier: one SIZE x SIZE template at STEPS steps (542,720 bytes), not two
DRAM_BYTES = 800_000
HOLD = "HOLD"  # the template prompt whose capture the loop holds while the gate file exists
DEADLINE_S = 120.0  # generous: a loaded 2-core machine


class Pinned:
    """Routing that sends every edit to worker `index` (the test says where)."""

    name = "pinned"

    def __init__(self) -> None:
        self.index = 0

    def choose(self, request, workers) -> int | None:
        return self.index


async def _until(what: str, cond, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


def _template(seed: int, prompt: str = "") -> TemplateRecord:
    image = png_bytes(make_image(SIZE, SIZE, seed=seed))
    msg = RegisterTemplate(template_id=template_id_of(image), image=image, prompt=prompt,
                           seed=seed, num_inference_steps=STEPS)  # fmt: skip
    return TemplateRecord(msg, SIZE, SIZE)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory):
    """(pool, gate file): two started CPU workers, nodes "n0" and "n1", a cache root each."""
    tmp = tmp_path_factory.mktemp("nodes")
    roots = [tmp / f"cache{i}" for i in range(2)]
    w = dict(max_batch=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=15.0,
             stall_timeout_s=60.0, cache_dram_bytes=DRAM_BYTES, cache_disk_bytes=0)  # fmt: skip
    configs = [Config(model=ModelConfig(model=MODEL),
                      worker=WorkerConfig(cache_root=str(r), **w)) for r in roots]  # fmt: skip
    gate = tmp / "gate"
    with pytest.MonkeyPatch.context() as mp:  # the workers' processes inherit these
        mp.setenv("INSTGENIE_FAULTS", f"hold={HOLD}")
        mp.setenv("INSTGENIE_FAULT_GATE", str(gate))
        pool = WorkerPool(configs, slots=4, start_timeout_s=240)
        pool.start()
    for i, slot in enumerate(pool.slots):
        slot.node = f"n{i}"
    try:
        yield pool, gate
    finally:
        pool.close(drain=False, timeout=30)
        for root in roots:
            ns = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
            for seg in SHM_DIR.glob(f"igc_{ns}_*"):
                seg.unlink()


async def _edit(rt: Runtime, rec: TemplateRecord, worker: int, seed: int) -> dict:
    rt.dispatcher.policy.index = worker
    spec = rt.prepare_edit(image=None, mask=png_bytes(make_mask(SIZE, SIZE)),
                           template_id=rec.template_id, prompt="a red hat", seed=seed)  # fmt: skip
    return await rt.execute(rt.admit(spec), spec)


def test_a_template_is_built_on_one_node_and_where_its_edits_go(two_nodes) -> None:
    pool, gate = two_nodes

    async def scenario() -> None:
        cfg = ServerConfig(health_poll_s=0.2, health_timeout_s=10.0)
        rt = Runtime(pool, cfg, LimitsConfig())
        rt.dispatcher.policy = Pinned()
        await rt.start()
        try:
            await run(rt)
        finally:
            await rt.stop()

    async def run(rt: Runtime) -> None:
        reg = rt.templates
        rec, created = await reg.register(_template(1, prompt=HOLD))
        assert created
        # placement: one node (both unknown and empty: the lowest id), every worker of it
        assert set(rec.builds) == {0}, "registration built the template beyond one node"
        await _until("ready on n0", lambda: rec.state(pool) == "ready")
        assert set(rec.builds) == {0}  # ready after one node; n1 was never sent it
        view = _template_view(rt, rec)
        assert view["status"] == "ready"
        assert view["nodes"] == [{"node": "n0", "status": "ready", "tier": "dram"}]
        assert [(w["worker"], w["node"], w["tier"]) for w in view["workers"]] == [(0, "n0", "dram")]

        # an edit routed to n1: RegisterTemplate goes first, the capture starts there, and the
        # edit (admitted by the loop while the capture is held mid-run) takes the full path
        gate.touch()
        try:
            task = asyncio.create_task(_edit(rt, rec, worker=1, seed=3))
            client = pool.slots[1].client
            await _until("the edit reached n1's loop (or failed)",
                         lambda: task.done() or client.stats().get("in_loop", 0) >= 1)  # fmt: skip
        finally:
            gate.unlink()
        first = await asyncio.wait_for(task, DEADLINE_S)
        assert (first["worker"], first["path"], first["cache"]) == (1, "full", "miss")
        assert 1 in rec.builds
        await _until("built on n1", lambda: rec.builds[1].state == "ready")
        again = await _edit(rt, rec, worker=1, seed=4)
        assert (again["worker"], again["path"], again["cache_tier"]) == (1, "masked", "dram")
        view = _template_view(rt, rec)
        assert [n["node"] for n in view["nodes"]] == ["n0", "n1"]
        assert {n["status"] for n in view["nodes"]} == {"ready"}

        # a second template on a node whose DRAM holds one: the first is evicted there, and
        # the next health poll says so (no longer resident for that worker)
        tid = rec.template_id
        other, _ = await reg.register(_template(2))
        (node_slot,) = [pool.slots[i] for i in other.builds]
        await _until("the second template built", lambda: other.state(pool) == "ready")
        await _until(
            "the eviction seen",
            lambda: (
                tid not in node_slot.templates_ready
                and node_slot.template_tiers.get(other.template_id) == "dram"
            ),
        )
        assert tid not in node_slot.template_tiers
        rest = pool.slots[1 - node_slot.index]  # the other node still holds it
        assert rest.template_tiers.get(tid) == "dram" and tid in rest.templates_ready
        workers = {w["worker"]: w["tier"] for w in _template_view(rt, rec)["workers"]}
        assert workers == {node_slot.index: None, rest.index: "dram"}

        # an edit of the evicted template sent to that node again: it is registered there
        # again and captured again (a miss now), so the next edit there reads its cache
        miss = await _edit(rt, rec, worker=node_slot.index, seed=5)
        assert (miss["worker"], miss["path"]) == (node_slot.index, "full")
        await _until("captured again", lambda: tid in node_slot.templates_ready)
        hit = await _edit(rt, rec, worker=node_slot.index, seed=6)
        assert (hit["path"], hit["cache"]) == ("masked", "hit")

    asyncio.run(scenario())


# ---- node-wide residency, without processes ------------------------------------------------------
def _fake_registry(nodes: list[str]) -> tuple[TemplateRegistry, list[WorkerSlot]]:
    slots = []
    for i, node in enumerate(nodes):
        slot = WorkerSlot(i, Config(), 4, node=node, state="up")
        proc = SimpleNamespace(poll=lambda: None)  # a live supervisor
        slot.handle = SimpleNamespace(proc=proc, client=None, pid=1, address=f"ipc://{i}")
        slots.append(slot)
    return TemplateRegistry(SimpleNamespace(slots=slots), ServerConfig()), slots


def test_dram_and_disk_residency_is_shared_by_a_nodes_workers_and_evictions_are_seen() -> None:
    reg, (a, b, c) = _fake_registry(["n0", "n0", "n1"])
    t1, t2 = _template(1), _template(2)
    for rec in (t1, t2):
        reg.records[rec.template_id] = rec
    now = time.monotonic()
    one, two = t1.template_id, t2.template_id
    reg.refresh(a, {one: {"gpu": 10, "dram": 10}, two: {"disk": 7}, "ff" * 32: {"dram": 1}}, now)
    assert a.template_tiers == {one: "gpu", two: "disk"}  # unregistered ids are ignored
    assert b.template_tiers == {one: "dram", two: "disk"}  # its node's tiers, not a's GPU
    assert b.templates_ready == {one, two}
    assert c.templates_ready == set() and c.template_tiers == {}  # another node
    reg.refresh(b, {}, now)  # b itself holds nothing of its own
    assert b.template_tiers == {one: "dram", two: "disk"}
    reg.refresh(a, {two: {"disk": 7}}, now)  # one evicted from the node
    assert a.template_tiers == {two: "disk"} and b.template_tiers == {two: "disk"}
    assert one not in a.templates_ready | b.templates_ready
    reg.refresh(c, {one: {"dram": 10}}, now)
    assert c.template_tiers == {one: "dram"} and one not in b.templates_ready


def test_placement_prefers_the_node_with_the_most_free_dram() -> None:
    reg, (a, b, c) = _fake_registry(["n0", "n0", "n1"])
    a.stats = {"cache_budget_dram_bytes": 100.0, "cache_bytes_dram": 90.0}
    c.stats = {"cache_budget_dram_bytes": 100.0, "cache_bytes_dram": 20.0}
    views = {v.node: v for v in reg.node_views()}
    assert (views["n0"].workers, views["n0"].dram_free_bytes) == (2, 10)
    assert (views["n1"].workers, views["n1"].dram_free_bytes) == (1, 80)
    assert (views["n0"].templates, views["n1"].templates) == (0, 0)
    rec = _template(1)
    reg.records[rec.template_id] = rec
    rec.builds[2] = WorkerBuild()  # being built on n1: counted there (a burst spreads)
    a.templates_ready = {"ee" * 32}
    assert [v.templates for v in reg.node_views()] == [1, 1]
    c.state = "restarting"  # no accepting worker: never placed there
    assert reg.node_views()[1].workers == 0


def test_a_template_no_tier_can_hold_fails_after_one_step_and_its_edits_run_full(two_nodes) -> None:
    """A 96 x 96 template's cache at 8 steps (9x a 64 x 64 one's at 2) is larger than a
    node's DRAM tier (DRAM_BYTES) and the disk tier is off: its build fails for good after
    the capture's first step (of 8), saying what would hold it, instead of waiting for room
    that cannot come; an edit of it runs the full path."""
    pool, _ = two_nodes
    side = 96

    async def scenario() -> None:
        rt = Runtime(pool, ServerConfig(health_poll_s=0.2, health_timeout_s=10.0), LimitsConfig())
        rt.dispatcher.policy = Pinned()
        await rt.start()
        try:
            image = png_bytes(make_image(side, side, seed=11))
            msg = RegisterTemplate(template_id=template_id_of(image), image=image, prompt="",
                                   seed=11, num_inference_steps=8)  # fmt: skip
            marks = [max((e.step + 1 for e in s.client.step_log()), default=0) for s in pool.slots]
            rec, created = await rt.templates.register(TemplateRecord(msg, side, side))
            (index,) = rec.builds
            assert created
            client, mark = pool.slots[index].client, marks[index]
            await _until("failed", lambda: rec.state(pool) == "failed")
            error = _template_view(rt, rec)["error"]
            assert "larger than this host's dram tier (781 KiB) and disk tier (off)" in error
            assert "can never be cached here" in error
            rt.dispatcher.policy.index = index
            spec = rt.prepare_edit(image=None, mask=png_bytes(make_mask(side, side)),
                                   template_id=rec.template_id, prompt="a hat", seed=3)  # fmt: skip
            out = await rt.execute(rt.admit(spec), spec)
            assert (out["path"], out["cache"]) == ("full", "miss")
            assert rec.builds[index].state == "failed"  # the edit started no capture of its own
            # read after the edit's steps: a capture that went on would have stepped beside it
            ran = [step for e in client.step_log(mark) for uid, step in e.members
                   if uid == capture_uid(rec.template_id)]  # fmt: skip
            assert ran == [0], f"the capture ran steps {ran}"
        finally:
            await rt.stop()

    asyncio.run(scenario())


class _Builds:
    """A worker client that records RegisterTemplate sends; the test answers each."""

    def __init__(self) -> None:
        self.sent: list[Future] = []

    def submit_template(self, msg: RegisterTemplate) -> Future:
        self.sent.append(Future())
        return self.sent[-1]


def test_a_build_that_found_no_room_is_sent_again_with_backoff_until_ready() -> None:
    """No room on the node now (its tiers full of caches in use) is not the template's fault:
    the build stays "building", says why and when it is sent again (retry_after_s, doubling),
    and is sent again without any edit, until it is ready; an edit meanwhile sends nothing."""
    reg, (slot,) = _fake_registry(["n0"])
    reg.cfg = ServerConfig(retry_after_s=1)
    slot.handle.client = client = _Builds()
    slot.starts = 1
    rec = _template(1)
    tid = rec.template_id
    why = "no room in this node's cache tiers now (dram: ...)"
    no_room = TemplateReady(template_id=tid, ok=False, retryable=True, message=why)

    async def scenario() -> None:
        await reg.register(rec)
        assert len(client.sent) == 1
        client.sent[0].set_result(no_room)
        await _until("answered", lambda: "sent again" in rec.builds[0].message, 5.0)
        assert rec.state(reg.pool) == "building" and "in 1 s" in rec.builds[0].message
        reg.ensure(slot, tid)  # an edit of it now: no second send
        assert len(client.sent) == 1
        await _until("sent again", lambda: len(client.sent) == 2, 5.0)
        assert rec.builds[0].attempts == 1
        t0 = time.monotonic()
        client.sent[1].set_result(no_room)
        await _until("answered again", lambda: "in 2 s" in rec.builds[0].message, 5.0)
        await _until("sent a third time", lambda: len(client.sent) == 3, 5.0)
        assert time.monotonic() - t0 > 1.5  # the backoff doubled
        client.sent[2].set_result(TemplateReady(template_id=tid, ok=True,
                                                bytes_by_tier={"dram": 10}))  # fmt: skip
        await _until("ready", lambda: rec.state(reg.pool) == "ready", 5.0)
        await asyncio.sleep(2.5)  # nothing more is sent
        assert len(client.sent) == 3

    asyncio.run(scenario())


def test_a_draining_server_sends_no_build_again_and_a_zero_retry_after_still_waits() -> None:
    """retry_after_s 0 (answers' Retry-After) does not make the resend a busy loop (1 s at
    least), and once the server drains no build is sent again."""
    reg, (slot,) = _fake_registry(["n0"])
    reg.cfg = ServerConfig(retry_after_s=0)
    slot.handle.client = client = _Builds()
    slot.starts = 1
    rec = _template(1)
    why = "no room in this node's cache tiers now (dram: ...)"

    async def scenario() -> None:
        await reg.register(rec)
        client.sent[0].set_result(TemplateReady(template_id=rec.template_id, ok=False,
                                                retryable=True, message=why))  # fmt: skip
        await _until("answered", lambda: "sent again in 1 s" in rec.builds[0].message, 5.0)
        reg.draining = True
        await asyncio.sleep(1.5)
        assert len(client.sent) == 1 and rec.state(reg.pool) == "building"

    asyncio.run(scenario())
