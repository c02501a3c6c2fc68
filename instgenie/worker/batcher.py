"""The denoise loop's state machine: waiting -> running -> retired, one step at a time.

    receive (caller) -> admit (policy) -> StepPlan -> one denoising step (pipeline) -> retire

No sockets and no processes here: the loop process feeds it prepared requests and aborts, and
drains what it retires; tests drive it directly. Each iteration builds one `StepPlan` (members at
their step indices, who joined, the horizon, the load planner's compute-all set) and passes it
to the pipeline; every step appends its `StepEntry` (the step log's wire type).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from instgenie.engine.graphs import costliest_mode
from instgenie.engine.masked.executor import CacheReadFailed
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import RequestState
from instgenie.errors import LoraError
from instgenie.lora.gate import Use, decide
from instgenie.messages import StepEntry
from instgenie.scheduler.batching import Policy
from instgenie.scheduler.step import StepPlan, horizon_of, members_of


@dataclass
class Retired:
    state: RequestState
    #: None on success, else (code, message)
    error: tuple[str, str] | None = None


@dataclass
class Batcher:
    pipe: EditPipeline
    policy: Policy
    max_batch: int
    #: called after each step with the members' states (progress reporting)
    on_step: Callable[[list[RequestState]], None] | None = None
    waiting: deque[RequestState] = field(default_factory=deque)
    running: list[RequestState] = field(default_factory=list)
    records: deque[StepEntry] = field(default_factory=lambda: deque(maxlen=10_000))
    steps: int = 0
    _aborted: set[str] = field(default_factory=set)
    _submitted: dict[str, float] = field(default_factory=dict)  # uid -> perf_counter()

    @property
    def in_flight(self) -> list[str]:
        return [s.uid for s in self.running] + [s.uid for s in self.waiting]

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def submit(self, state: RequestState) -> None:
        self._submitted[state.uid] = time.perf_counter()
        self.waiting.append(state)

    def abort(self, uid: str) -> None:
        """Remove `uid` before the next step (it is retired with code "cancelled"); a uid that is
        not held here is ignored (an abort never waits for a future request)."""
        if uid in self.in_flight:
            self._aborted.add(uid)

    def iterate(self) -> list[Retired]:
        """One loop iteration: drop aborted requests, admit, plan and run one step, retire.
        Returns retirees."""
        retired = self._drop_aborted()
        joined = self.policy.admit(self.running, self.waiting, self.max_batch)
        self.running.extend(joined)
        if self.running:
            retired += self._step(joined)
        return retired

    def _step(self, joined: list[RequestState]) -> list[Retired]:
        """Plan and run one step of the running batch; record it; retire finished requests (or
        the ones a failure hit)."""
        stepping, without, held, retired = self._lora_members()
        if not stepping:
            return retired
        stepped = list(stepping)
        graphs = self.pipe.family.masked.graphs
        before = dict(graphs.counters)
        t0, wall0 = time.perf_counter(), time.time()
        waited = [1e3 * (t0 - self._submitted.pop(s.uid, t0)) for s in joined]
        try:
            plan = self.plan([s.uid for s in joined if s in stepping], stepping, without)
            # no device sync: the host enqueues step n + 1 while the GPU runs step n, so the
            # recorded duration is host time between step starts (≈ GPU step time when busy)
            self.pipe.denoise_step(stepping, plan)
        except CacheReadFailed as exc:  # before anything ran: only that request fails
            bad = [s for s in self.running if s.uid == exc.uid]
            self.running = [s for s in self.running if s.uid != exc.uid]
            for s in bad:
                self.pipe.release(s)
            message = f"the template's cache could not be read ({exc}); it is captured again"
            return retired + [Retired(s, ("cache_unreadable", message)) for s in bad]
        except Exception as exc:  # the whole batch shares the failed step
            failed = [Retired(s, ("internal_error", f"denoising step failed: {exc}"))
                      for s in self.running]  # fmt: skip
            for r in failed:
                self.pipe.release(r.state)
            self.running = []
            return retired + failed
        ms = 1e3 * (time.perf_counter() - t0)
        for s in without:
            s.lora.steps_without += 1
            s.notes = replace(s.notes, lora_steps_without=s.lora.steps_without)
        for s in held:
            s.lora.held_ms += ms
            s.notes = replace(s.notes, lora_held_ms=s.lora.held_ms)
        # a capture run whose cache found no room records nothing more: it leaves now, and its
        # loop answers the build (retryable, or failed for good when the cache can never fit)
        gave_up = [s for s in self.running if not s.is_done and _no_room(s)]
        done = [s for s in self.running if s.is_done]
        self.running = [s for s in self.running if not s.is_done and not _no_room(s)]
        for s in gave_up:
            self.pipe.release(s)  # (drops its writer)
        ex = self.pipe.family.masked
        ctx = ex.last_context
        loaded = ctx.loader.bytes_loaded if ctx is not None and ctx.loader is not None else 0
        self.records.append(
            StepEntry(
                step=plan.index,
                t_start=wall0,
                duration_ms=ms,
                members=[(m.uid, m.step) for m in plan.members],
                joined=list(plan.joined),
                waited_ms=waited,
                left=[s.uid for s in done + gave_up],
                bytes_loaded=loaded + ex.last_window_bytes,
                compute_all_blocks=len(plan.compute_all),
                policy=self.policy.name,
                graph=costliest_mode(graphs.counters, before),
                tiers=dict(
                    Counter(s.notes.cache_tier.value for s in stepped if s.notes.cache_tier)
                ),  # fmt: skip
                lora_without=[s.uid for s in without],
                lora_held=[s.uid for s in held],
            )
        )
        self.steps += 1
        if self.on_step is not None:
            self.on_step([s for s in self.running] + done)
        return (
            retired
            + [Retired(s, _check_finite(s)) for s in done]
            + [Retired(s, None) for s in gave_up]
        )

    def _lora_members(self) -> tuple[list, list, list, list[Retired]]:
        """(this step's members, those running without their LoRAs, those held, retired): a
        request whose backbone LoRAs are loading runs without them for at most
        pipe.lora_async_steps steps, then is held until they arrive (lora/gate.py); a request
        whose LoRA fails to load fails alone with the typed error."""
        if self.pipe.loras is None:
            return list(self.running), [], [], []
        for attempt in range(2):
            stepping, without, held, failed = [], [], [], []
            for s in self.running:
                try:
                    self.pipe.resolve_loras(s, wait=False)
                except LoraError as exc:
                    failed.append(Retired(s, (exc.code, exc.message)))
                    continue
                use = decide(s.lora, self.pipe.lora_async_steps)
                (held if use is Use.HOLD else stepping).append(s)
                if use is Use.WITHOUT:
                    without.append(s)
            bad = {id(r.state) for r in failed}
            for r in failed:
                self.pipe.release(r.state)
            self.running = [s for s in self.running if id(s) not in bad]
            if stepping or not held or attempt:
                return stepping, without, held, failed
            self.pipe.loras.wait_any()  # everyone waits for a load: block until one lands
        raise AssertionError("unreachable")

    def plan(
        self,
        joined: list[str],
        members: list[RequestState] | None = None,
        without: Sequence[RequestState] = (),
    ) -> StepPlan:
        """This iteration's StepPlan for the running batch. Reads are prepared first (a host
        cache gets its device window before the load planner prices it; a cache that cannot be
        read raises CacheReadFailed for its request alone). `without`: members running without
        their loading LoRAs; the composition lasts at most until their bound (then they step
        with them, or are held), so a CUDA graph is captured for it only where that pays."""
        batch = self.running if members is None else members
        self.pipe.prepare_reads(batch)
        members = members_of(batch)
        horizon = horizon_of(members)
        if without and horizon is not None:
            bound = self.pipe.lora_async_steps
            horizon = min(horizon, *(bound - s.lora.steps_without for s in without))
        return StepPlan(
            index=self.steps,
            members=members,
            joined=tuple(joined),
            horizon=horizon,
            compute_all=self.pipe.compute_all(batch),
        )

    def _drop_aborted(self) -> list[Retired]:
        if not self._aborted:
            return []
        out = []
        for group in (self.running, self.waiting):
            for s in [s for s in group if s.uid in self._aborted]:
                group.remove(s)
                self._submitted.pop(s.uid, None)
                self.pipe.release(s)
                out.append(Retired(s, ("cancelled", "cancelled by the client")))
        self._aborted -= {r.state.uid for r in out}
        return out

    def fail_all(self, code: str, message: str) -> list[Retired]:
        out = [Retired(s, (code, message)) for s in [*self.running, *self.waiting]]
        for r in out:
            self.pipe.release(r.state)
        self.running, self.waiting = [], deque()
        self._submitted.clear()
        return out


def _check_finite(state: RequestState) -> tuple[str, str] | None:
    """A request whose latents went non-finite fails alone (its batch mates are unaffected)."""
    if bool(torch.isfinite(state.latents).all()):
        return None
    return ("internal_error", "non-finite latents (NaN/inf) after denoising")


def _no_room(state: RequestState) -> bool:
    """A capture run whose cache writer found no room in the node's tiers (it records nothing;
    running it on would only spend steps)."""
    return bool(state.writer is not None and getattr(state.writer, "no_room", ""))
