"""The runtime every pre/loop/post process shares, and their entry point.

    python -m instgenie.worker.lifeline child '<json spec>'

spec = {"role": "pre"|"loop"|"post", "index": int, "inbox": addr, "outbox": addr,
        "shm_base": str, "config": Config as to_dict}. The supervisor binds `inbox` (a PUSH per
child incarnation) and `outbox` (one PULL for all children); the child connects to both, loads
its model parts, sends ChildReady and runs its role. No pickle crosses: the spec is JSON, every
message msgpack (messages.py), tensors shared memory (tensorshm.py).

Invariants:
- The child dies with the supervisor (PR_SET_PDEATHSIG = SIGKILL), so a killed supervisor
  leaves no orphans; the supervisor cleans up the child's shm prefix when the child dies.
- A heartbeat thread (its own socket) sends Heartbeat every interval with `iterations` and
  `in_flight` as the role's main thread last published them: a main thread stuck inside one
  iteration keeps beating but stops counting, which the supervisor's stall watchdog detects.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from instgenie.cache.budgets import cache_namespace, is_resolved
from instgenie.config import Config, from_dict
from instgenie.engine.imageio import codec_allowed
from instgenie.errors import EXIT_MODEL_LOAD, ModelLoadError
from instgenie.ipc import Channel
from instgenie.logs import quiet_libraries, setup_process
from instgenie.messages import (
    Abort,
    ChildReady,
    CostSpec,
    Heartbeat,
    Ping,
    Pong,
    StopProcess,
    TensorBundle,
)
from instgenie.tensorshm import process_prefix, release
from instgenie.wire import Message

log = logging.getLogger("instgenie.worker")

ROLES = ("pre", "loop", "post")
SEND_TIMEOUT_MS = 30_000  # a supervisor that takes no message for this long is gone


class ChildRuntime:
    def __init__(self, spec: dict) -> None:
        self.role: str = spec["role"]
        self.index: int = int(spec["index"])
        self.config: Config = from_dict(Config, spec["config"])
        self.wcfg = self.config.worker
        self.shm_prefix = process_prefix(spec["shm_base"])  # this process packs under it
        self.outbox_address: str = spec["outbox"]
        self.inbox = Channel.pull(spec["inbox"], bind=False, name=f"{self.role}{self.index} in")
        self.outbox = Channel.push(self.outbox_address, name=f"{self.role}{self.index} out")
        #: published by the main thread (replaced, never mutated: the beat thread reads them)
        self.iterations = 0
        self.in_flight: tuple[str, ...] = ()
        self.busy: tuple[str, float] = ("", 0.0)  # (stage, monotonic start): `doing`
        #: ready() was called: the model parts loaded (a failure before that ends the process)
        self.started = False
        self._stop = threading.Event()
        self._closers: list = []
        #: work messages received but not yet handled (pre/post), in arrival order
        self.pending: deque[Message] = deque()
        self.stopping = False  # a StopProcess arrived
        self._beat = threading.Thread(target=self._beats, name="heartbeat", daemon=True)

    # ---- messaging ------------------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        if not self.outbox.send(msg, timeout_ms=SEND_TIMEOUT_MS):
            raise RuntimeError(f"supervisor took no message for {SEND_TIMEOUT_MS} ms")

    def recv(self, timeout_ms: float | None) -> Message | None:
        return self.inbox.recv(timeout_ms)

    def next_work(self) -> Message | None:
        """The next work message (pre/post), in arrival order; None when the process should exit.
        Control messages are applied as they arrive, so an Abort overtakes queued work:
        Abort drops its uid from `pending`, Ping is answered, StopProcess(drain) lets `pending`
        finish first."""
        while True:
            block = not self.pending and not self.stopping
            msg = self.recv(None if block else 0)
            while msg is not None:
                self._control(msg)
                msg = self.recv(0)
            if self.pending:
                return self.pending.popleft()
            if self.stopping:
                return None

    def _control(self, msg: Message) -> None:
        if isinstance(msg, Abort):
            for m in [m for m in self.pending if getattr(m, "uid", None) == msg.uid]:
                self.pending.remove(m)
                release_bundles(m)
        elif isinstance(msg, Ping):
            self.send(Pong(nonce=msg.nonce, time=msg.time, pid=os.getpid()))
        elif isinstance(msg, StopProcess):
            self.stopping = True
            if not msg.drain:
                for m in self.pending:
                    release_bundles(m)
                self.pending.clear()
        else:
            self.pending.append(msg)

    def publish(self, in_flight: tuple[str, ...] | list[str]) -> None:
        """End of one main-loop iteration: progress for the stall watchdog."""
        self.in_flight = tuple(in_flight)
        self.iterations += 1

    @contextmanager
    def doing(self, stage: str) -> Iterator[None]:
        """Mark a long model call of the main thread (heartbeats carry it: the watchdogs count
        it as progress for `stage_timeout_s`, not as a stalled loop)."""
        self.busy = (stage, time.monotonic())
        try:
            yield
        finally:
            self.busy = ("", 0.0)

    def ready(self, cost: CostSpec | None = None) -> None:
        self.started = True
        self._beat.start()
        self.send(ChildReady(role=self.role, index=self.index, pid=os.getpid(),
                             codec=codec_allowed(), cost=cost))  # fmt: skip

    def _beats(self) -> None:
        chan = Channel.push(self.outbox_address, name=f"{self.role}{self.index} beat")
        try:
            while not self._stop.wait(self.wcfg.heartbeat_interval_s):
                busy, since = self.busy
                beat = Heartbeat(pid=os.getpid(), loop_iterations=self.iterations,
                                 in_flight=list(self.in_flight), time=time.monotonic(),
                                 busy=busy, busy_since=since)  # fmt: skip
                chan.send(beat, timeout_ms=1000)
        finally:
            chan.close()

    def close(self) -> None:
        self._stop.set()
        if self._beat.is_alive():
            self._beat.join(timeout=5)
        for close in self._closers:
            close()
        self.inbox.close()
        self.outbox.close()

    # ---- model ----------------------------------------------------------------------------------
    def pipeline(self, parts: str, device: str, *, store: bool = True, device_tier: bool = False):
        """The role's EditPipeline: only `parts` of the model are materialised; `store`: use the
        worker's activation store (else an empty in-memory one); `device_tier`: with a device
        tier above it (the loop's)."""
        from instgenie.engine.family import family_options, load_family
        from instgenie.engine.pipeline import EditPipeline
        from instgenie.engine.profiling import check_profile
        from instgenie.scheduler.fits import Profile

        m = self.config.model
        family = load_family(m.model, device=device, dtype=m.dtype, parts=parts,
                             **family_options(m))  # fmt: skip
        if family.text_graphs:  # before ready: the first request must not pay for the capture
            log.info("text encoder graphs captured in %.0f ms", family.warm_up_text_graphs())
        profile = Profile.load_file(self.wcfg.profile) if self.wcfg.profile else None
        if profile is not None and parts == "stages":
            profile = None  # the planner is the loop's business
        if profile is not None:
            check_profile(profile, family, f"profile {self.wcfg.profile}")
        cache = None
        if store:
            cache = make_store(self.config, family.device, family.dtype, device_tier=device_tier)
        if cache is not None:
            self._closers.append(getattr(cache, "close", None) or cache.tiered.close)
        pipe = EditPipeline(family, self.config.limits, cache, profile)
        lcfg = self.wcfg.lora
        if lcfg.lora_dir and parts != "none":
            from instgenie.lora.store import open_store

            store = open_store(family, Path(lcfg.lora_dir), lcfg)
            self._closers.append(store.close)
            pipe.attach_loras(store, lcfg.lora_async_steps)
        return pipe


def release_bundles(msg: Message) -> None:
    """Release the shm bundles a received message handed to this process (it is being dropped)."""
    for value in (getattr(msg, "state", None), getattr(msg, "latents", None)):
        if isinstance(value, TensorBundle):
            release(value)


def make_store(config: Config, device=None, dtype=None, *, device_tier: bool = False):
    """The activation store of a worker process: the loop's device memory, or the host's shared
    DRAM + disk tiers under worker.cache_root (shared by every process and worker using it);
    with `device_tier` (the loop) and cache_gpu_bytes != 0, under a device tier on `device`
    keeping stacks in `dtype` (the activations'). Its auto budget (-1) starts at 0 and is set
    by the loop once the model is loaded (resolve_device_budget); on a CPU device auto is off."""
    w = config.worker
    if not is_resolved(w):  # the Supervisor resolves before any child starts
        raise ValueError("make_store: the cache settings are not resolved (resolve_cache)")
    if not w.cache_root:
        return None  # EditPipeline's default: an InMemoryStore on the family's device
    import torch

    from instgenie.cache.device_tier import DeviceTierStore
    from instgenie.cache.host_store import HostActivationStore
    from instgenie.cache.tiered import TieredStore

    root = Path(w.cache_root).resolve()
    namespace = cache_namespace(w.cache_root)
    tiered = TieredStore(root, namespace, w.cache_dram_bytes, w.cache_disk_bytes,
                         disk_enabled=w.cache_disk_bytes > 0)  # fmt: skip
    host = HostActivationStore(tiered, root)
    host.capture_copies = w.cache_capture_copies
    staged = w.cache_capture_copies == "staged" or (w.cache_capture_copies == "auto"
                                                   and host.pin_memory)  # fmt: skip
    if device_tier and staged:
        from instgenie.cache import capture_stage

        capture_stage.shared().warm()  # the loop captures: its staging slots pinned before ready
    budget = w.cache_gpu_bytes
    if not device_tier or budget == 0 or device is None:
        return host
    if budget < 0 and torch.device(device).type != "cuda":
        return host  # auto on a CPU device: off (cache.device_tier.auto_budget)
    return DeviceTierStore(host, device, dtype, budget_bytes=max(budget, 0))


def resolve_device_budget(config: Config, store: object) -> None:
    """cache_gpu_bytes = -1 (auto): size the loop's device tier from the free device memory now
    (call it once the model is loaded and warmed), and log it."""
    from instgenie.cache.device_tier import DeviceTierStore, auto_budget

    if not isinstance(store, DeviceTierStore):
        return
    if config.worker.cache_gpu_bytes < 0:
        store.set_budget(auto_budget(store.device))
    log.info("device cache tier (%s): budget %.2f GB%s", store.tier_name, store.budget_bytes / 1e9,
             " (auto)" if config.worker.cache_gpu_bytes < 0 else "")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])  # PR_SET_PDEATHSIG is armed by worker.lifeline, before imports
    if spec.get("role") not in ROLES:
        raise SystemExit(f"unknown role {spec.get('role')!r}; expected one of {ROLES}")
    setup_process(f"{spec['role']}{spec['index']}")
    quiet_libraries()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides (Ctrl-C hits the group)
    rt = ChildRuntime(spec)
    try:
        if rt.role == "loop":
            from instgenie.worker.loop import run
        elif rt.role == "pre":
            from instgenie.worker.pre import run
        else:
            from instgenie.worker.post import run
        run(rt)
    except Exception as exc:
        if rt.started:
            raise
        # a model (device, dtype, profile) that cannot be loaded will not load on a restart
        # either: say why in one line and exit EXIT_MODEL_LOAD; a supervisor that was never
        # ready gives up on it (child_processes.py, watchdog.py)
        expected = isinstance(exc, (ModelLoadError, ValueError, OSError))
        log.error("could not start: %s: %s", type(exc).__name__, exc, exc_info=not expected)
        return EXIT_MODEL_LOAD
    finally:
        rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
