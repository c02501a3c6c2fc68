"""The worker's host cache tiers with real processes on CPU (tiny SD2): a template in the host
DRAM tier (shared memory) is reported by tier and survives a loop restart; a device tier above it
serves the second edit. The in-loop device store and template edits: tests/worker/test_worker.py."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

from instgenie.messages import RegisterTemplate
from instgenie.tensorshm import SHM_DIR
from instgenie.worker.stages import capture_uid
from tests.conftest import make_image, png_bytes
from tests.worker.test_worker import SIZE, STEP_DEADLINE_S, _config, _fields, _worker


def test_host_cache_tier_is_reported_and_survives_a_loop_restart(tmp_path: Path) -> None:
    """With cache_root the template lives in the host DRAM tier: edits say so, and the worker's
    stats carry the host cache's bytes and the bytes its steps loaded. The tier is shared memory:
    a loop killed and restarted finds the template's cache still ready (no capture run) and
    edits take the masked path from DRAM again."""
    namespace = hashlib.sha256(str((tmp_path / "cache").resolve()).encode()).hexdigest()[:12]

    def segments() -> list[str]:
        return sorted(p.name for p in SHM_DIR.glob(f"igc_{namespace}_*"))

    try:
        with _worker(_config(cache_root=str(tmp_path / "cache"))) as (handle, pids):
            c = handle.client
            tid = "9a" * 32
            spec = dict(image=png_bytes(make_image(SIZE, SIZE, seed=6)), prompt="", seed=2,
                        num_inference_steps=2)  # fmt: skip
            ready = c.register_template(RegisterTemplate(template_id=tid, **spec))
            assert list(ready.bytes_by_tier) == ["dram"] and ready.bytes_by_tier["dram"] > 0
            done = c.run_edit(**_fields("host", 2, template_id=tid, image=None))
            assert (done.path, done.cache, done.cache_tier) == ("masked", "hit", "dram")
            s = c.stats()
            # on a CUDA device the steps copy cached rows from DRAM; on the CPU they are read
            # in place
            assert s["cache_hits_dram"] == 1 and s["cache_bytes_loaded_dram"] == 0
            assert s["cache_bytes_dram"] >= ready.bytes_by_tier["dram"]
            assert s["cache_evictions_dram"] == 0

            # the loop dies (kill -9) and is restarted: the template's segment outlives it
            held = segments()
            assert len(held) == 1
            captures = [e for e in c.step_log() if capture_uid(tid) in dict(e.members)]
            assert len(captures) == 2  # one capture run of 2 steps
            loop = int(s["pid_loop_0"])
            os.kill(loop, signal.SIGKILL)
            pids.add(loop)
            deadline = time.monotonic() + 2 * STEP_DEADLINE_S
            while not ((s := c.stats())["pid_loop_0"] != loop and s["ready"] == 1
                       and s["templates_ready"] == 1 and s["templates_building"] == 0):  # fmt: skip
                assert time.monotonic() < deadline, f"the loop never came back: {s}"
                time.sleep(0.05)
            assert s["restarts_loop_0"] == 1 and s["templates_failed"] == 0
            assert segments() == held
            again = c.run_edit(**_fields("after", 2, template_id=tid, image=None))
            assert (again.path, again.cache, again.cache_tier) == ("masked", "hit", "dram")
            assert again.data == done.data  # the same request, the same cache: the same image
            captures = [e for e in c.step_log() if capture_uid(tid) in dict(e.members)]
            assert len(captures) == 2, "the template was captured again after the restart"
    finally:
        # the host tier outlives its workers by design; remove this test's segments
        for seg in SHM_DIR.glob(f"igc_{namespace}_*"):
            seg.unlink()


def test_device_tier_serves_the_second_edit(tmp_path: Path) -> None:
    """With a device tier (explicit budget: auto is off on a CPU device) the first edit of a
    template reads DRAM and promotes it, the second reads the loop's device copy; the stats
    carry the tier's bytes, budget and promotions, and hits by the tier that served."""
    cache = tmp_path / "cache"
    with _worker(_config(cache_root=str(cache), cache_gpu_bytes=64 << 20)) as (handle, _):
        c = handle.client
        tid = "9b" * 32
        spec = dict(image=png_bytes(make_image(SIZE, SIZE, seed=6)), prompt="", seed=2,
                    num_inference_steps=2)  # fmt: skip
        ready = c.register_template(RegisterTemplate(template_id=tid, **spec))
        assert list(ready.bytes_by_tier) == ["dram"]
        tiers = [c.run_edit(**_fields(f"t{i}", 2, template_id=tid, image=None)).cache_tier
                 for i in range(2)]  # fmt: skip
        assert tiers == ["dram", "cpu"]
        # the step log says which tier served each step's cache readers (two steps per edit)
        deadline = time.monotonic() + STEP_DEADLINE_S
        while len(served := [e.tiers for e in c.step_log() if e.tiers]) < 4:
            assert time.monotonic() < deadline, served
            time.sleep(0.1)
        assert served == [{"dram": 1}, {"dram": 1}, {"cpu": 1}, {"cpu": 1}]
        deadline = time.monotonic() + STEP_DEADLINE_S
        while not (s := c.stats()).get("cache_promotions_cpu") and time.monotonic() < deadline:
            time.sleep(0.1)  # the answer may overtake the loop's step log (its cache counters)
        assert s["cache_hits_dram"] == 1 and s["cache_hits_cpu"] == 1
        assert s["cache_promotions_cpu"] == 1 and s["cache_budget_cpu_bytes"] == 64 << 20
        assert 0 < s["cache_bytes_cpu"] <= 64 << 20
    namespace = hashlib.sha256(str(cache.resolve()).encode()).hexdigest()[:12]
    for seg in SHM_DIR.glob(f"igc_{namespace}_*"):
        seg.unlink()
