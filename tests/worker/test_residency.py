"""Where a worker's template caches live, as its Stats say (Stats.residency), with real processes on
CPU (tiny SD2) and a host cache whose DRAM and disk tiers hold one template each: a build shows
up in DRAM, the next build demotes it to disk, a third evicts it from the node altogether, and a
dropped template disappears. The counters carry the DRAM tier's capacity and bytes held."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from instgenie.messages import RegisterTemplate
from instgenie.tensorshm import SHM_DIR
from instgenie.worker.client import WorkerClient
from tests.conftest import make_image, png_bytes
from tests.worker.test_worker import SIZE, STEP_DEADLINE_S, _config, _worker

#: one tier holds one template of SIZE x SIZE pixels at 2 steps (tiny SD2: 542,720 bytes), not two
TIER_BYTES = 800_000


def _residency(c: WorkerClient, want: dict[str, set[str]]) -> dict[str, dict[str, int]]:
    """Stats.residency once its templates and their tiers are `want` (the loop reports a change
    right after it, never blocking a step: the answer may trail it by one report)."""
    deadline = time.monotonic() + STEP_DEADLINE_S
    while True:
        got = c.report().residency
        if {t: set(tiers) for t, tiers in got.items()} == want:
            return got
        assert time.monotonic() < deadline, f"residency {got}, expected the tiers {want}"
        time.sleep(0.05)


def test_residency_follows_builds_demotions_evictions_and_drops(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    config = _config(cache_root=str(cache), cache_dram_bytes=TIER_BYTES,
                     cache_disk_bytes=TIER_BYTES)  # fmt: skip
    a, b, c3 = "a1" * 32, "b2" * 32, "c3" * 32
    try:
        with _worker(config) as (handle, _):
            c = handle.client
            assert c.report().residency == {}

            def register(tid: str, seed: int) -> int:
                spec = dict(image=png_bytes(make_image(SIZE, SIZE, seed=seed)), prompt="",
                            seed=seed, num_inference_steps=2)  # fmt: skip
                ready = c.register_template(RegisterTemplate(template_id=tid, **spec))
                assert ready.ok and list(ready.bytes_by_tier) == ["dram"], ready
                size = ready.bytes_by_tier["dram"]
                assert TIER_BYTES / 2 < size <= TIER_BYTES, f"re-size TIER_BYTES for {size}"
                return size

            size = register(a, 1)
            assert _residency(c, {a: {"dram"}}) == {a: {"dram": size}}
            s = c.stats()  # the node's DRAM tier: its capacity and what it holds (placement)
            assert s["cache_budget_dram_bytes"] == TIER_BYTES and s["cache_bytes_dram"] == size
            assert s["cache_budget_disk_bytes"] == TIER_BYTES

            register(b, 2)  # DRAM holds one: a is demoted to disk
            assert _residency(c, {a: {"disk"}, b: {"dram"}}) == {a: {"disk": size},
                                                               b: {"dram": size}}  # fmt: skip
            register(c3, 3)  # b is demoted, which evicts a from disk: a leaves the node
            _residency(c, {b: {"disk"}, c3: {"dram"}})
            assert c.stats()["cache_evictions_disk"] == 1

            c.drop_template(c3)
            _residency(c, {b: {"disk"}})
    finally:
        namespace = hashlib.sha256(str(cache.resolve()).encode()).hexdigest()[:12]
        for seg in SHM_DIR.glob(f"igc_{namespace}_*"):
            seg.unlink()
