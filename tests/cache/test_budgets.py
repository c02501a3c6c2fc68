"""The host cache's defaults derived from the machine (cache/budgets.py), with fake probes: the
root from INSTGENIE_CACHE_ROOT / XDG_CACHE_HOME / home, the DRAM budget from MemAvailable capped
by /dev/shm, the disk budget from the root's free space; given values win; a resolved config
resolves to itself; the `serve`/`worker` commands resolve before starting anything."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from instgenie.cache import budgets
from instgenie.cache.budgets import GIB, MIB, Machine, cache_namespace, human_bytes, resolve_cache
from instgenie.config import Config, WorkerConfig, from_dict, to_dict

MEMINFO = """MemTotal:       131072000 kB
MemFree:         1000000 kB
MemAvailable:   100000000 kB
Buffers:          123456 kB
HugePages_Total:       0
"""
MEM_AVAILABLE = 100_000_000 * 1024  # bytes
SHM = "/fake/shm"


def machine(**probes) -> tuple[Machine, list[str]]:
    """A fake machine: 125 GiB RAM (95.4 GiB available), a 64 GiB /dev/shm with 60 GiB free,
    a 1 TiB disk with 400 GiB free, home /home/u; and the list of directories it was asked to
    create."""
    made: list[str] = []

    def make_writable(path: str) -> str:
        made.append(path)
        return ""

    def disk_usage(path: str) -> tuple[int, int]:
        return (64 * GIB, 60 * GIB) if path == SHM else (1 << 40, 400 * GIB)

    base = dict(
        env_root=lambda: None,
        xdg_cache_home=lambda: "",
        home=lambda: "/home/u",
        meminfo=lambda: MEMINFO,
        disk_usage=disk_usage,
        tree_bytes=lambda path: 0,
        segments_bytes=lambda shm_dir, prefix: 0,
        make_writable=make_writable,
        shm_dir=SHM,
    )
    return Machine(**(base | probes)), made


def floor_mib(n: float) -> int:
    return int(n) // MIB * MIB


def test_defaults_come_from_the_machine() -> None:
    m, made = machine()
    w, cache = resolve_cache(WorkerConfig(), m)
    assert w.cache_root == "/home/u/.cache/instgenie/activations" == cache.root
    assert made == [w.cache_root]  # created (and checked writable) up front
    assert cache.root_source == "auto: ~/.cache/instgenie/activations"
    assert w.cache_dram_bytes == floor_mib(0.5 * MEM_AVAILABLE) == cache.dram.nbytes
    assert cache.dram.source == "auto: 50% of MemAvailable"
    assert w.cache_disk_bytes == 200 * GIB == cache.disk.nbytes
    assert cache.disk.source == "auto: 50% of the free space on its filesystem"
    assert w.cache_dram_bytes % MIB == 0 and w.cache_disk_bytes % MIB == 0
    line = cache.describe()
    assert line.startswith("activation cache in /home/u/.cache/instgenie/activations (auto: ")
    assert "DRAM 47.7 GiB of 125 GiB RAM (auto: 50% of MemAvailable)" in line
    assert "disk 200 GiB of 400 GiB free (auto: 50% of the free space" in line
    # the other fields are untouched, and the result is a valid config that survives JSON
    assert dataclasses.replace(w, cache_root="auto", cache_dram_bytes=-1,
                               cache_disk_bytes=-1) == WorkerConfig()  # fmt: skip
    assert from_dict(Config, to_dict(Config(worker=w))).worker == w


def test_the_root_follows_the_environment() -> None:
    m, made = machine(xdg_cache_home=lambda: "/xdg")
    w, cache = resolve_cache(WorkerConfig(), m)
    assert w.cache_root == "/xdg/instgenie/activations" and made == [w.cache_root]
    assert cache.root_source == "auto: $XDG_CACHE_HOME/instgenie/activations"
    # a relative XDG_CACHE_HOME is ignored (the XDG spec)
    w, _ = resolve_cache(WorkerConfig(), machine(xdg_cache_home=lambda: "rel")[0])
    assert w.cache_root == "/home/u/.cache/instgenie/activations"
    # INSTGENIE_CACHE_ROOT wins over both, used as given (not created here)
    m, made = machine(env_root=lambda: "/srv/cache", xdg_cache_home=lambda: "/xdg")
    w, cache = resolve_cache(WorkerConfig(), m)
    assert (w.cache_root, cache.root_source, made) == ("/srv/cache", "INSTGENIE_CACHE_ROOT", [])
    # ... and set but empty, it means no host cache: templates in the loop's device memory
    w, cache = resolve_cache(WorkerConfig(), machine(env_root=lambda: "")[0])
    assert w.cache_root == "" and cache.to_dict()["root"] is None
    assert cache.root_source == "INSTGENIE_CACHE_ROOT is empty"
    assert cache.dram.nbytes is None and cache.disk.nbytes is None
    assert "device memory" in cache.describe()


def test_an_auto_root_that_cannot_be_written_means_no_host_cache() -> None:
    m, _ = machine(make_writable=lambda path: "PermissionError: Permission denied")
    w, cache = resolve_cache(WorkerConfig(), m)
    assert w.cache_root == "" and cache.dram.nbytes is None
    assert cache.root_source == ("auto: /home/u/.cache/instgenie/activations cannot be used "
                                 "(PermissionError: Permission denied): no host cache")  # fmt: skip


def test_dram_is_capped_by_the_shared_memory_filesystem() -> None:
    # a container's 64 MiB /dev/shm: a quarter of it is kept free, not 1 GiB
    m, _ = machine(disk_usage=lambda p: (64 * MIB, 60 * MIB) if p == SHM else (1 << 40, 1 << 39))
    _, cache = resolve_cache(WorkerConfig(), m)
    assert cache.dram.nbytes == 60 * MIB - 16 * MIB
    assert cache.dram.source == f"auto: free space of {SHM} (60 MiB) less a 16 MiB reserve"
    # a large /dev/shm with little free: its free space less 1 GiB
    m, _ = machine(disk_usage=lambda p: (64 * GIB, 10 * GIB) if p == SHM else (1 << 40, 1 << 39))
    assert resolve_cache(WorkerConfig(), m)[1].dram.nbytes == 9 * GIB
    # no room at all: the least budget (templates go to the disk tier), said so
    m, _ = machine(disk_usage=lambda p: (64 * MIB, 0) if p == SHM else (1 << 40, 1 << 39))
    _, cache = resolve_cache(WorkerConfig(), m)
    assert cache.dram.nbytes == budgets.DRAM_MIN_BYTES and "under the minimum" in cache.dram.source

    # no shared-memory filesystem to measure: no cap
    def no_shm(path: str) -> tuple[int, int]:
        if path == SHM:
            raise FileNotFoundError(path)
        return 1 << 40, 1 << 39

    _, cache = resolve_cache(WorkerConfig(), machine(disk_usage=no_shm)[0])
    assert cache.dram.nbytes == floor_mib(0.5 * MEM_AVAILABLE)
    # no /proc/meminfo: a fixed budget, still capped
    _, cache = resolve_cache(WorkerConfig(), machine(meminfo=lambda: "")[0])
    assert cache.dram.nbytes == budgets.DRAM_FALLBACK_BYTES and "fixed" in cache.dram.source
    assert "DRAM 8 GiB (auto: fixed" in cache.describe()  # no total RAM to show


def test_what_the_cache_already_holds_counts_as_available() -> None:
    """A restart on a full cache derives the budgets of the start that filled it: its shared
    memory segments are not MemAvailable (nor free /dev/shm), its files not free disk."""
    root = "/home/u/.cache/instgenie/activations"
    prefix = f"igc_{cache_namespace(root)}_"
    seen = []

    def segments(shm_dir: str, p: str) -> int:
        seen.append((shm_dir, p))
        return 20 * GIB

    m, _ = machine(segments_bytes=segments,
                   tree_bytes=lambda path: 100 * GIB if path == root else 0)  # fmt: skip
    _, cache = resolve_cache(WorkerConfig(), m)
    assert seen == [(SHM, prefix)]
    assert cache.dram.nbytes == floor_mib(0.5 * (MEM_AVAILABLE + 20 * GIB))
    assert cache.disk.nbytes == floor_mib(0.5 * (400 + 100) * GIB)
    assert "+ the 100 GiB the cache holds" in cache.disk.source


def test_given_values_win_and_a_resolved_config_resolves_to_itself() -> None:
    def unprobed(*args):
        raise AssertionError("probed the machine for a value that was given")

    m, made = machine(tree_bytes=unprobed, segments_bytes=lambda *a: 0)
    given = WorkerConfig(cache_root="/data/c", cache_dram_bytes=3 * GIB, cache_disk_bytes=0)
    w, cache = resolve_cache(given, m)
    assert w == given and made == []
    assert (cache.root_source, cache.dram.source) == ("flag", "flag")
    assert cache.disk.source == "flag: 0 = no disk tier"
    assert "disk off" in cache.describe() and "DRAM 3 GiB of 125 GiB RAM (flag)" in cache.describe()
    # one budget given, the other derived
    w, cache = resolve_cache(WorkerConfig(cache_dram_bytes=5 * GIB), machine()[0])
    assert w.cache_dram_bytes == 5 * GIB and w.cache_disk_bytes == 200 * GIB
    # resolving twice changes nothing
    once, _ = resolve_cache(WorkerConfig(), machine()[0])
    assert budgets.is_resolved(once) and not budgets.is_resolved(WorkerConfig())
    assert resolve_cache(once, machine(meminfo=lambda: "MemAvailable: 1 kB\n")[0])[0] == once
    # --cache-root "": the pure device-memory mode, whatever the budgets say
    w, cache = resolve_cache(WorkerConfig(cache_root=""), machine()[0])
    assert w.cache_root == "" and cache.root_source == 'flag: --cache-root ""'


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536 * MIB, 64 << 30, 1000 * GIB, 3 << 40)] == [
        "0 B", "1023 B", "1 KiB", "1.5 GiB", "64 GiB", "1000 GiB", "3 TiB"]  # fmt: skip


def test_the_module_imports_no_torch() -> None:
    import subprocess

    code = "import sys, instgenie.cache.budgets; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_serve_and_worker_commands_resolve_before_starting(monkeypatch, capsys, tmp_path):
    """Without flags, `instgenie serve` hands the launcher's workers concrete values and prints
    them; `--cache-root ""` keeps the device-memory mode; `instgenie worker` resolves too."""
    import instgenie.server.launcher as launcher
    import instgenie.worker.supervisor
    from instgenie.cli import main

    monkeypatch.setenv("INSTGENIE_CACHE_ROOT", str(tmp_path / "root"))
    seen = {}

    def fake_serve(model, devices, server, configs, sock, state, cache):  # noqa: ANN001
        sock.close()
        seen.update(configs=configs, state=state and state.path, cache=cache)
        return 0

    monkeypatch.setattr(launcher, "_serve", fake_serve)
    assert main(["serve", "--model", "sd2-inpaint:tiny", "--port", "0",
                 "--devices", "cpu,cpu", "--cache-disk-bytes", "123"]) == 0  # fmt: skip
    root = str(tmp_path / "root")
    workers = [c.worker for c in seen["configs"]]
    assert {w.cache_root for w in workers} == {root} and workers[0] == workers[1]
    assert workers[0].cache_dram_bytes > 0 and workers[0].cache_disk_bytes == 123
    assert seen["cache"].root_source == "INSTGENIE_CACHE_ROOT"
    assert str(seen["state"]) == f"{root}/server.sqlite3"  # the state file under the root
    err = capsys.readouterr().err
    assert f"instgenie: activation cache in {root} (INSTGENIE_CACHE_ROOT): DRAM " in err
    assert "disk 123 B of " in err and "(flag)" in err

    assert main(["serve", "--model", "sd2-inpaint:tiny", "--port", "0", "--cache-root", ""]) == 0
    assert seen["configs"][0].worker.cache_root == "" and seen["state"] is None
    assert seen["cache"].to_dict()["root"] is None
    assert "device memory" in capsys.readouterr().err

    class Started(Exception):
        pass

    def supervisor(config, *args, **kwargs):  # noqa: ANN001
        seen["worker"] = config.worker
        raise Started

    monkeypatch.setattr(instgenie.worker.supervisor, "Supervisor", supervisor)
    with pytest.raises(Started):
        main(["worker", "--model", "sd2-inpaint:tiny"])
    assert seen["worker"].cache_root == root and seen["worker"].cache_disk_bytes > 0
    assert f"activation cache in {root}" in capsys.readouterr().err


def test_health_shows_the_gpu_budget_a_worker_reports() -> None:
    """The loop's cache stats may carry the GPU tier's budget ("budget_gpu_bytes", measured
    after the model loads): the worker's stats forward it and /health shows it per worker and
    summed in cache.tiers.gpu; until then the GPU tier's budget is null, saying why."""
    import time
    from types import SimpleNamespace

    from instgenie.messages import LoopSteps
    from instgenie.server.config import ServerConfig
    from instgenie.server.health import HealthMonitor
    from instgenie.server.metrics import Metrics
    from instgenie.server.pool import WorkerSlot
    from instgenie.worker.loop_reports import LoopReports
    from instgenie.worker.request_table import RequestTable
    from instgenie.worker.stats import worker_stats
    from instgenie.worker.template_registry import TemplateRegistry

    w = WorkerConfig(cache_root="/c")
    reports = LoopReports(w)
    reports.add(LoopSteps(entries=[], cache={"budget_gpu_bytes": 3.0 * GIB, "bytes_dram": 5.0}))
    sup = SimpleNamespace(
        requests=RequestTable(w), templates=TemplateRegistry(w, lambda i, m: None),
        children=SimpleNamespace(all=[], ready=True, deaths=0,
                                 inbox=SimpleNamespace(garbage_frames=0)),
        loop_reports=reports, started=time.monotonic(), config=Config(worker=w),
        clients=SimpleNamespace(server=SimpleNamespace(garbage_frames=0)),
    )  # fmt: skip
    stats = worker_stats(sup)
    assert stats["cache_budget_gpu_bytes"] == 3 * GIB and stats["cache_bytes_dram"] == 5

    w, cache = resolve_cache(WorkerConfig(), machine()[0])
    slots = [WorkerSlot(i, Config(worker=w), 4, state="up") for i in range(2)]
    monitor = HealthMonitor(SimpleNamespace(slots=slots), ServerConfig(), Metrics(),
                            lambda s, r: None, None, cache)  # fmt: skip
    report = monitor.cache_report()
    assert report["root"] == "/home/u/.cache/instgenie/activations"
    assert list(report["tiers"]) == ["gpu", "dram", "disk"]
    assert report["tiers"]["gpu"] == {"budget_bytes": None,
                                      "source": "not reported: no GPU tier above DRAM"}  # fmt: skip
    assert report["tiers"]["dram"] == {"budget_bytes": w.cache_dram_bytes,
                                       "source": "auto: 50% of MemAvailable"}  # fmt: skip
    slots[0].observe(stats, time.monotonic())
    slots[1].observe({**stats, "cache_budget_gpu_bytes": float(GIB)}, time.monotonic())
    gpu = monitor.cache_report()["tiers"]["gpu"]
    assert gpu["budget_bytes"] == 4 * GIB and gpu["source"].startswith("reported by the workers")
    rows = monitor.report()[1]
    assert [r["cache_gpu_budget_bytes"] for r in rows] == [3 * GIB, GIB]
