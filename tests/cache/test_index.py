"""CacheIndex: eviction order, capacities, refcounts under pressure, demotion, disabled tiers."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from instgenie.cache.index import (
    CacheFull,
    CacheIndex,
    EntryInUse,
    Eviction,
    TierDisabled,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float = 1.0) -> None:
        self.t += dt


def make(dram: int = 100, disk: int = 0) -> tuple[CacheIndex, FakeClock]:
    clock = FakeClock()
    return CacheIndex({"dram": dram, "disk": disk}, clock=clock), clock


def put(idx: CacheIndex, clock: FakeClock, key: str, n: int, tier: str = "dram") -> list[Eviction]:
    clock.tick()
    evs = idx.reserve(key, tier, n)
    assert idx.commit(key, tier)
    idx.check_invariants()
    return evs


def test_reserve_commit_abort_states() -> None:
    idx, clock = make()
    assert idx.state("a", "dram") == "absent"
    assert idx.reserve("a", "dram", 40) == []
    assert idx.state("a", "dram") == "building" and idx.used("dram") == 40
    with pytest.raises(KeyError):
        idx.acquire("a")  # readers only see ready entries
    with pytest.raises(ValueError):
        idx.reserve("a", "dram", 1)
    assert idx.abort("a", "dram") and idx.state("a", "dram") == "absent"
    assert not idx.abort("a", "dram") and not idx.commit("a", "dram")
    assert idx.used("dram") == 0
    put(idx, clock, "a", 40)
    assert idx.state("a", "dram") == "ready"
    with pytest.raises(ValueError):
        idx.commit("a", "dram")


def test_lru_eviction_order_and_touch() -> None:
    idx, clock = make(dram=100)
    for k in "abcd":
        put(idx, clock, k, 25)
    clock.tick()
    idx.touch("a")  # b is now the least recently used
    clock.tick()
    idx.acquire("c")
    idx.release("c")
    evs = put(idx, clock, "e", 50)
    assert evs == [Eviction("b", "dram", 25), Eviction("d", "dram", 25)]
    assert [e.key for e in idx.entries("dram")] == ["a", "c", "e"]


def test_ties_broken_by_operation_order() -> None:
    idx, clock = make(dram=30)
    for k in "xyz":
        idx.reserve(k, "dram", 10)  # same clock value for all
        idx.commit(k, "dram")
    assert [e.key for e in idx.reserve("w", "dram", 10)] == ["x"]


def test_capacity_limits_and_atomic_cache_full() -> None:
    idx, clock = make(dram=100)
    with pytest.raises(CacheFull):
        idx.reserve("big", "dram", 101)
    put(idx, clock, "a", 60)
    put(idx, clock, "b", 30)
    idx.acquire("a")
    # only b (30) is evictable: 60 + 50 > 100 even after evicting it -> nothing changes
    with pytest.raises(CacheFull):
        idx.reserve("c", "dram", 50)
    assert idx.state("b", "dram") == "ready" and idx.used("dram") == 90
    assert idx.reserve("c", "dram", 40) == [Eviction("b", "dram", 30)]
    assert idx.used("dram") == 100
    idx.check_invariants()


def test_acquired_and_building_entries_are_never_evicted() -> None:
    idx, clock = make(dram=100)
    put(idx, clock, "old", 50)
    idx.acquire("old")
    idx.reserve("wip", "dram", 50)  # building
    with pytest.raises(CacheFull):
        idx.reserve("new", "dram", 10)
    idx.acquire("old")
    idx.release("old")
    with pytest.raises(CacheFull):  # still one reference
        idx.reserve("new", "dram", 10)
    assert idx.release("old") == 0
    assert idx.reserve("new", "dram", 10) == [Eviction("old", "dram", 50)]


def test_refcount_errors_and_owners() -> None:
    idx, clock = make()
    put(idx, clock, "a", 10)
    with pytest.raises(ValueError):
        idx.release("a")
    assert idx.acquire("a", owner="p1") == 1
    assert idx.acquire("a", owner="p2") == 2
    with pytest.raises(ValueError):
        idx.release("a", owner="p3")
    with pytest.raises(EntryInUse):
        idx.remove("a")
    assert idx.owners() == {"p1", "p2"}
    assert idx.drop_owner("p1") == []
    assert idx.get("a", "dram").refs == {"p2": 1}
    idx.release("a", owner="p2")
    assert idx.remove("a") == [Eviction("a", "dram", 10)]


def test_drop_owner_aborts_its_building_entries() -> None:
    idx, _ = make()
    idx.reserve("a", "dram", 10, owner="dead")
    idx.reserve("b", "dram", 10, owner="alive")
    assert idx.owners() == {"dead", "alive"}
    assert idx.drop_owner("dead") == [Eviction("a", "dram", 10)]
    assert idx.state("b", "dram") == "building"


def test_demotion_to_disk_reserves_disk_and_cascades() -> None:
    idx, clock = make(dram=100, disk=100)
    put(idx, clock, "d1", 60, tier="disk")
    put(idx, clock, "a", 50)
    put(idx, clock, "b", 50)
    evs = idx.reserve("c", "dram", 50)
    # a is demoted; disk makes room for it by dropping its LRU entry d1 first
    assert evs == [Eviction("d1", "disk", 60), Eviction("a", "dram", 50, demote_to="disk")]
    assert idx.state("a", "disk") == "building" and idx.state("a", "dram") == "absent"
    assert idx.commit("a", "disk")
    idx.check_invariants()


def test_no_demotion_when_already_on_disk_or_no_disk_room() -> None:
    idx, clock = make(dram=100, disk=60)
    put(idx, clock, "a", 50)
    put(idx, clock, "a", 50, tier="disk")
    put(idx, clock, "b", 50)
    assert idx.reserve("c", "dram", 50) == [Eviction("a", "dram", 50)]  # disk has a copy
    idx.acquire("a", "disk")  # the disk copy is in use: b cannot be demoted into 60 - 50
    idx.commit("c", "dram")
    assert idx.reserve("d", "dram", 50) == [Eviction("b", "dram", 50)]
    idx.check_invariants()


def test_drop_when_disk_disabled_and_reenable() -> None:
    idx, clock = make(dram=50, disk=100)
    put(idx, clock, "x", 30, tier="disk")
    assert idx.disable_tier("disk") == [Eviction("x", "disk", 30)]
    with pytest.raises(TierDisabled):
        idx.reserve("y", "disk", 1)
    put(idx, clock, "a", 50)
    assert idx.reserve("b", "dram", 50) == [Eviction("a", "dram", 50)]
    idx.enable_tier("disk")
    idx.commit("b", "dram")
    assert idx.reserve("c", "dram", 50) == [Eviction("b", "dram", 50, demote_to="disk")]
    # a tier configured with capacity 0 is off for good
    idx0, _ = make(dram=10, disk=0)
    idx0.enable_tier("disk")
    assert not idx0.is_enabled("disk")


def test_loading_a_disk_entry_never_evicts_its_file() -> None:
    """Loading d (disk only, its LRU entry) into full DRAM demotes a, and making disk room for a
    must not pick d: its file is what the loader is about to read."""
    idx, clock = make(dram=50, disk=100)
    put(idx, clock, "d", 50, tier="disk")  # least recently used on disk
    put(idx, clock, "e", 50, tier="disk")
    put(idx, clock, "a", 50)
    evs = idx.reserve("d", "dram", 50)  # the load of d
    assert Eviction("d", "disk", 50) not in evs
    assert evs == [Eviction("e", "disk", 50), Eviction("a", "dram", 50, demote_to="disk")]
    assert idx.state("d", "disk") == "ready"
    # while d is building in DRAM, no other reservation takes its disk entry either
    assert idx.commit("a", "disk")
    with pytest.raises(CacheFull):
        idx.reserve("f", "disk", 60)  # only d's 50 bytes could make room: in use
    assert idx.evict_for("disk", 100) == [Eviction("a", "disk", 50)]
    assert idx.commit("d", "dram")
    assert idx.reserve("f", "disk", 60) == [Eviction("d", "disk", 50)]  # loaded: evictable
    idx.check_invariants()


def test_capacity_above_zero_switches_a_configured_off_tier_on() -> None:
    idx, clock = make(dram=50, disk=0)
    assert not idx.is_enabled("disk")
    idx.set_capacity("disk", 100)  # the operator turned the disk tier on
    assert idx.is_enabled("disk")
    put(idx, clock, "x", 30, tier="disk")
    # switched off by a failure (ENOSPC): a new capacity alone does not switch it on
    idx.disable_tier("disk")
    idx.set_capacity("disk", 200)
    assert not idx.is_enabled("disk")
    idx.enable_tier("disk")
    assert idx.is_enabled("disk")


def test_commit_after_tier_disabled_reports_false() -> None:
    idx, _ = make(dram=10, disk=10)
    idx.reserve("a", "disk", 5)
    idx.disable_tier("disk")
    assert idx.commit("a", "disk") is False


def test_rereservation_after_eviction() -> None:
    idx, clock = make(dram=50)
    put(idx, clock, "a", 50)
    put(idx, clock, "b", 50)
    assert idx.state("a", "dram") == "absent"
    assert put(idx, clock, "a", 50) == [Eviction("b", "dram", 50)]
    assert idx.state("a", "dram") == "ready"


def test_evict_for_and_set_capacity() -> None:
    idx, clock = make(dram=100, disk=100)
    for k in "abc":
        put(idx, clock, k, 30, tier="disk")
    idx.acquire("a", "disk")
    assert idx.evict_for("disk", 40, exclude="c") == [Eviction("b", "disk", 30)]
    # a (in use) stays even though a + c do not fit 35 bytes: c goes
    assert idx.set_capacity("disk", 35) == [Eviction("c", "disk", 30)]
    assert idx.set_capacity("disk", 20) == []  # over capacity while a is in use
    idx.release("a", "disk")
    assert idx.set_capacity("disk", 20) == [Eviction("a", "disk", 30)]
    idx.check_invariants()


def test_serialization_round_trip() -> None:
    idx, clock = make(dram=100, disk=100)
    put(idx, clock, "a", 10)
    idx.acquire("a", owner="p")
    idx.reserve("b", "disk", 20, owner="q")
    idx.disable_tier("disk")
    copy = CacheIndex.from_dict(idx.to_dict(), clock)
    assert copy.to_dict() == idx.to_dict()
    assert copy.get("a", "dram").refs == {"p": 1} and not copy.is_enabled("disk")


class IndexMachine(RuleBasedStateMachine):
    """Random operations; after each, the invariants hold and no acquired entry has vanished."""

    keys = Bundle("keys")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.idx = CacheIndex({"dram": 100, "disk": 150}, clock=self.clock)
        self.held: dict[tuple[str, str], int] = {}  # (key, tier) -> references we hold

    @rule(target=keys, k=st.sampled_from("abcdefgh"))
    def key(self, k: str) -> str:
        return k

    def _evictions(self, evs: list[Eviction]) -> None:
        for ev in evs:
            assert (ev.key, ev.tier) not in self.held, f"evicted acquired {ev}"
            if ev.demote_to:
                assert self.idx.state(ev.key, ev.demote_to) == "building"

    @rule(k=keys, tier=st.sampled_from(["dram", "disk"]), n=st.integers(0, 120))
    def reserve(self, k: str, tier: str, n: int) -> None:
        self.clock.tick()
        try:
            evs = self.idx.reserve(k, tier, n)
        except (CacheFull, ValueError):
            return
        self._evictions(evs)

    @rule(k=keys, tier=st.sampled_from(["dram", "disk"]), ok=st.booleans())
    def finish(self, k: str, tier: str, ok: bool) -> None:
        if self.idx.state(k, tier) == "building":
            assert (self.idx.commit if ok else self.idx.abort)(k, tier)

    @rule(k=keys, tier=st.sampled_from(["dram", "disk"]))
    def acquire(self, k: str, tier: str) -> None:
        self.clock.tick()
        if self.idx.state(k, tier) == "ready":
            self.idx.acquire(k, tier)
            self.held[(k, tier)] = self.held.get((k, tier), 0) + 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        k, tier = data.draw(st.sampled_from(sorted(self.held)))
        self.held[(k, tier)] -= 1
        if not self.held[(k, tier)]:
            del self.held[(k, tier)]
        assert self.idx.release(k, tier) == self.held.get((k, tier), 0)

    @rule(k=keys)
    def touch(self, k: str) -> None:
        self.clock.tick(0.5)
        self.idx.touch(k)

    @rule(k=consumes(keys), tier=st.sampled_from(["dram", "disk"]))
    def remove(self, k: str, tier: str) -> None:
        try:
            self._evictions(self.idx.remove(k, tier))
        except EntryInUse:
            assert (k, tier) in self.held or self.idx.state(k, tier) == "building"

    @rule(n=st.integers(0, 80))
    def enospc(self, n: int) -> None:
        self._evictions(self.idx.evict_for("disk", n))

    @rule()
    def toggle_disk(self) -> None:
        if self.idx.is_enabled("disk"):
            evs = self.idx.disable_tier("disk")
            self.held = {kt: n for kt, n in self.held.items() if kt[1] != "disk"}
            assert all(ev.tier == "disk" for ev in evs)
        else:
            self.idx.enable_tier("disk")

    @invariant()
    def invariants(self) -> None:
        self.idx.check_invariants()
        for (k, tier), n in self.held.items():
            e = self.idx.get(k, tier)
            assert e is not None and e.state == "ready" and e.refcount == n


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
