"""The denoise loop process: one GPU, one running batch, one step per iteration.

    while running:
        receive()                      # Prepared -> waiting, Abort -> marked, ...
        retired = batcher.iterate()    # admit (policy) -> plan + one step -> retire
        log_steps()                    # step log to the supervisor
        retire(retired)                # Finished -> post at once (or EditFailed / TemplateReady)
        publish()                      # progress for the supervisor's stall watchdog

It blocks on its inbox only when it holds no request. Under `continuous` and `static` it never
runs image codec work (enforced: imageio raises in this process); with model_stages="loop" (the
default) it also holds the prompt encoders and the VAE and runs their work between steps (encode
on receipt, decode on retire), with "process" only the backbone (UNet / transformer). Under
`naive-continuous` it runs all of pre- and post-processing itself, between steps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque

import torch
from PIL import Image

from instgenie import faults
from instgenie.cache.index import EntryInUse
from instgenie.cache.store import tier_of
from instgenie.engine.costspec import cost_spec
from instgenie.engine.imageio import forbid_codec_in_this_process
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import RequestState
from instgenie.messages import (
    Abort,
    BuildTemplate,
    DropTemplate,
    EditFailed,
    Finished,
    InputsMeta,
    LoopSteps,
    Ping,
    Pong,
    Prepared,
    Progress,
    RegisterTemplate,
    Stage,
    StopProcess,
    SubmitEdit,
    TemplateReady,
)
from instgenie.scheduler.batching import get_policy
from instgenie.tensorshm import pack, release, unpack
from instgenie.wire import Message
from instgenie.worker import warmup
from instgenie.worker.batcher import Batcher, Retired
from instgenie.worker.child_runtime import ChildRuntime, release_bundles, resolve_device_budget
from instgenie.worker.names import CAPTURE_PREFIX
from instgenie.worker.stages import Stages, capture_uid, failure
from instgenie.worker.state_wire import from_parts, inputs_from_parts, to_parts

log = logging.getLogger(__name__)

#: how often, ms, a loop checks on captures another process of the host is running
AWAIT_POLL_MS = 100
#: how often, s, a loop re-reads the host cache's counters and where its templates' caches live
#: (the node's tiers change under it: another worker's capture evicts or demotes); an idle loop
#: that knows templates wakes this often to do so
CACHE_REPORT_S = 1.0


class Loop:
    def __init__(self, rt: ChildRuntime, pipe: EditPipeline, inline: Stages | None) -> None:
        self.rt = rt
        self.pipe = pipe
        self.device = pipe.family.device
        #: pre/post stages run in this process (naive-continuous), else None
        self.inline = inline
        policy = get_policy(rt.wcfg.policy)
        self.batcher = Batcher(pipe, policy, rt.wcfg.max_batch, on_step=self._progress)
        self.joined_at: dict[str, float] = {}  # uid -> unix time of its first step
        self.pre_ms: dict[str, float] = {}  # uid -> inline pre-processing ms (naive only)
        self.reported = 0  # step records sent to the supervisor
        self.cache_read_at = 0.0  # monotonic time the host cache's counters were last read
        self.cache_changed = False  # an entry was added or deleted since
        #: the store has host tiers shared with other processes (they change under this loop)
        self.host_tiers = getattr(pipe.store, "tiered", None) is not None
        #: template id -> {tier: bytes} as last reported (LoopSteps.residency); None: not yet
        self.residency: dict[str, dict[str, int]] | None = None
        self.stop: StopProcess | None = None
        #: model_stages="loop": VAE decode here (post-processing then needs no model)
        self.decode_here = inline is None and rt.wcfg.model_stages == "loop"
        #: client template id -> cache key, for every capture this loop ran (DropTemplate)
        self.template_keys: dict[str, str] = {}
        #: cache keys of dropped templates still referenced by running edits; deleted on retire
        self.drops: set[str] = set()
        #: captures another process of the host is running (shared cache_root): cache key ->
        #: (template id, this loop's capture run to start if that one fails, or None)
        self.awaiting: dict[str, tuple[str, RequestState | None]] = {}
        self.awaiting_polled = 0.0  # monotonic time of the last poll_awaiting
        #: messages read and not yet handled, in arrival order (Aborts never wait here)
        self.inbox: deque[Message] = deque()

    def run(self) -> None:
        while True:
            self.receive()
            if self.stop is not None and self.batcher.idle:
                return
            faults.stall(self.batcher.running)
            faults.hold(self.batcher.running)
            self.poll_awaiting()
            retired = self.batcher.iterate()
            self.log_steps()  # first: it records join times that retire() reads
            self.retire(retired)
            self.report_cache()
            self.rt.publish(self.batcher.in_flight)

    # ---- receive --------------------------------------------------------------------------------
    def receive(self) -> None:
        """Handle every waiting message; block for the first only when holding no request.
        Aborts overtake the work read with them (`drain`), and each message is handled only
        after the inbox is read again: a request cancelled while the loop encodes another is
        dropped before its own encode (a stage boundary), not after it."""
        block = self.batcher.idle and self.stop is None and not self.inbox
        wait = None  # ms; None: until a message comes
        if self.awaiting:
            wait = AWAIT_POLL_MS
        elif self.host_tiers and self.template_keys:  # residency may change under it
            wait = 1e3 * CACHE_REPORT_S
        msg = self.rt.recv(0 if not block else wait)
        if msg is not None:
            self.inbox.append(msg)
        self.drain()
        while self.inbox:
            self.handle(self.inbox.popleft())
            self.drain()

    def drain(self) -> set[str]:
        """Read every waiting message into `inbox`, applying Aborts at once: an aborted request
        leaves the batch, or, not yet handled, the inbox (its bundle released). Returns the
        uids aborted."""
        aborted = set()
        while (msg := self.rt.recv(0)) is not None:
            if not isinstance(msg, Abort):
                self.inbox.append(msg)
                continue
            aborted.add(msg.uid)
            self.batcher.abort(msg.uid)
            for m in [m for m in self.inbox if getattr(m, "uid", None) == msg.uid]:
                self.inbox.remove(m)
                release_bundles(m)
        return aborted

    def handle(self, msg: Message) -> None:
        if isinstance(msg, Prepared):
            if self.stop is not None and not self.stop.drain:
                release_bundles(msg)
                return
            try:
                tensors = unpack(msg.state, unlink=True)
                if isinstance(msg.meta, InputsMeta):  # model_stages="loop": encode here
                    self._stage(msg.uid, Stage.ENCODE)
                    with self.rt.doing("encode"):
                        state = self.encode(tensors, msg.meta)
                else:
                    state = from_parts(tensors, msg.meta, self.device)
            except Exception as e:
                release(msg.state)
                self._refuse(msg.uid, msg.meta.notes.template_id, e)
                return
            try:
                self.admit(state)
            except Exception as e:  # e.g. its cache could not be opened: it fails alone
                self.pipe.release(state)
                self._refuse(state.uid, state.notes.template_id, e)
        elif isinstance(msg, Abort):
            self.batcher.abort(msg.uid)
        elif isinstance(msg, DropTemplate):
            self.drop_template(msg.template_id)
        elif isinstance(msg, Ping):
            self.rt.send(Pong(nonce=msg.nonce, time=msg.time, pid=os.getpid()))
        elif isinstance(msg, StopProcess):
            self.stop = msg
            if not msg.drain:
                self.retire(self.batcher.fail_all("shutting_down", "the worker is shutting down"))
        elif self.inline is not None:
            self.handle_inline(msg)

    def encode(self, tensors: dict[str, torch.Tensor], meta: InputsMeta) -> RequestState:
        """Pre-processing's model half for decoded inputs (prompt and VAE encode, noise)."""
        t0 = time.perf_counter()
        uid, inputs, notes = inputs_from_parts(tensors, meta)
        faults.slow_encode(inputs.request.prompt)
        state = self.pipe.encode_inputs(inputs)
        state.uid = uid
        state.notes = dataclasses.replace(notes, encode_ms=1e3 * (time.perf_counter() - t0))
        return state

    def handle_inline(self, msg: Message) -> None:
        """naive-continuous: pre-processing here, between steps."""
        assert self.inline is not None
        if isinstance(msg, RegisterTemplate):
            self.inline.register(msg)
            return
        uid = msg.uid if isinstance(msg, SubmitEdit) else None
        template = msg.template_id if isinstance(msg, BuildTemplate) else None
        t0 = time.perf_counter()
        try:
            if isinstance(msg, SubmitEdit):
                state = self.inline.prepare(msg)
            elif isinstance(msg, BuildTemplate):
                state = self.inline.build(msg.template_id)
            else:
                return
        except Exception as e:
            self._refuse(uid, template, e)
            return
        self.pre_ms[state.uid] = 1e3 * (time.perf_counter() - t0)
        self.admit(state)

    def admit(self, state: RequestState) -> None:
        """Into the waiting queue: edits on a template pick their path against this process's
        store; a capture run gets its cache writer (or is answered at once if the cache exists)."""
        key = state.notes.capture_key
        if key is not None:
            template = state.notes.template_id
            assert template is not None  # a capture run names its template (Stages.build)
            status = self.pipe.store.status(key)
            # every template this loop answers for is recorded, also one whose cache it finds
            # ready (built by another worker of the host, or by a previous run on the same cache
            # root): DropTemplate deletes the cache whoever built it
            self.template_keys[template] = key
            if status == "building":  # another process of the host captures it: wait for it
                self.awaiting[key] = (template, state)
                return
            if status != "absent":
                self.template_ready(template, key, "" if status == "ready" else status)
                return
            self.pipe.attach_writer(state, key)
        elif state.request.template_id is not None:
            self.pipe.select_path(state, state.request.template_id)
        faults.poison(state)
        self.batcher.submit(state)

    def _refuse(self, uid: str | None, template: str | None, exc: Exception) -> None:
        if template is not None:
            why = failure(template, exc).message
            self.rt.send(TemplateReady(template_id=template, ok=False, message=why))
        elif uid is not None:
            self.rt.send(failure(uid, exc))

    # ---- retire ---------------------------------------------------------------------------------
    def retire(self, retired: list[Retired]) -> None:
        now = time.time()
        finished: list[tuple[RequestState, float]] = []  # (state, denoise_ms) -> post
        for r in retired:
            s = r.state
            joined = self.joined_at.pop(s.uid, None)
            denoise_ms = 0.0 if joined is None else 1e3 * (now - joined)
            pre_ms = self.pre_ms.pop(s.uid, 0.0)
            if s.notes.capture_key is not None:
                key, template = s.notes.capture_key, s.notes.template_id
                assert template is not None  # a capture run names its template (Stages.build)
                status = self.pipe.store.status(key)
                if r.error is None and s.notes.capture_lost_race and status == "building":
                    self.awaiting[key] = (template, None)
                    continue
                # (no room for this run, but ready: another process of the host committed it)
                no_room = s.notes.capture_no_room if not r.error and status != "ready" else ""
                why = r.error[1] if r.error else "" if status == "ready" else "not committed"
                retry = bool(no_room) and not s.notes.capture_too_large
                if retry:  # the server sends it again later (server/templates.py)
                    why = f"no room in this node's cache tiers now ({no_room})"
                elif no_room:
                    why = no_room
                self.template_ready(template, key, why, retryable=retry)
            elif r.error is not None:
                code, message = r.error
                self.rt.send(EditFailed(uid=s.uid, code=code, message=message, retryable=False))
            elif self.inline is not None:
                self.finish_inline(s, pre_ms, denoise_ms)
            else:
                finished.append((s, denoise_ms))
        if finished:
            self.send_finished(finished)

        if retired and self.drops:
            for key in list(self.drops):
                self._delete(key)

    # ---- template caches ------------------------------------------------------------------------
    def poll_awaiting(self, force: bool = False) -> None:
        """Settle captures another process was running: ready -> answered ok; gone (that
        capture failed or its process died) -> this loop's own capture run starts, or, when
        it has none (it lost the race mid-run), the build fails and may be retried."""
        now = time.monotonic()
        if not self.awaiting or (not force and now - self.awaiting_polled < AWAIT_POLL_MS / 1e3):
            return
        self.awaiting_polled = now
        for key, (template, state) in list(self.awaiting.items()):
            status = self.pipe.store.status(key)
            if status == "building":
                continue
            del self.awaiting[key]
            if status == "ready":
                if state is not None:
                    self.pipe.release(state)
                self.template_ready(template, key, "")
            elif state is not None:
                self.admit(state)  # absent: capture it here
            else:
                self.template_ready(template, key, "the capture by another worker failed")

    def template_ready(self, template_id: str, key: str, why: str, retryable: bool = False) -> None:
        """TemplateReady for a capture (why == "": ok) with the cache's bytes per tier;
        `retryable`: it failed for a reason that may pass (no room in the tiers now)."""
        tiers = {}
        if not why:
            store = self.pipe.store
            by_tier = getattr(store, "bytes_by_tier", None)  # a device tier: every tier holding it
            tiers = by_tier(key) if by_tier else {tier_of(store, key): store.meta(key).nbytes}
        msg = TemplateReady(template_id=template_id, ok=not why, message=why, bytes_by_tier=tiers,
                            retryable=retryable)  # fmt: skip
        self.cache_changed = True
        self.rt.send(msg)

    def drop_template(self, template_id: str) -> None:
        """Forget a template: abort its capture if running, delete its cache (now, or when the
        last running edit on it retires: entries in use are never deleted)."""
        key = self.template_keys.pop(template_id, None)
        if self.inline is not None:
            key = self.inline.drop(template_id) or key
        waited = self.awaiting.pop(key, None) if key is not None else None
        if waited is not None and waited[1] is not None:
            self.pipe.release(waited[1])
        self.batcher.abort(capture_uid(template_id))
        if key is not None and key not in self.template_keys.values():
            self._delete(key)

    def _delete(self, key: str) -> None:
        if any(s.cache_key == key for s in [*self.batcher.running, *self.batcher.waiting]):
            self.drops.add(key)
            return
        try:
            self.pipe.store.delete(key)
            self.drops.discard(key)
            self.cache_changed = True
        except EntryInUse:  # another worker of the host reads it: retried on the next retire
            self.drops.add(key)

    def send_finished(self, finished: list[tuple[RequestState, float]]) -> None:
        """To post-processing; with model_stages="loop" VAE-decoded here first, in one batch
        (one request whose decode fails fails alone)."""
        if self.decode_here:  # a stage boundary: requests cancelled by now are not decoded
            aborted = self.drain()
            finished = [f for f in finished if f[0].uid not in aborted]
            if not finished:
                return
            for state, _ in finished:
                self._stage(state.uid, Stage.DECODE)
        images: list[Image.Image | None] = [None] * len(finished)
        if self.decode_here:
            t0 = time.perf_counter()
            with self.rt.doing("decode"):
                try:
                    images = list(self.pipe.decode_latents([s for s, _ in finished]))
                except Exception:
                    images = [self._decode_one(s) for s, _ in finished]
            ms = 1e3 * (time.perf_counter() - t0) / len(finished)
        for (state, denoise_ms), img in zip(finished, images, strict=True):
            if self.decode_here and img is None:
                continue  # failed alone (_decode_one answered)
            if img is not None:
                state.notes = dataclasses.replace(state.notes, decode_ms=ms)
            try:
                tensors, meta = to_parts(state, for_post=True, decoded=img)
                bundle = pack(tensors, self.rt.shm_prefix)  # OSError when /dev/shm is full
            except Exception as e:
                self.rt.send(failure(state.uid, e))
                continue
            try:
                msg = Finished(uid=state.uid, latents=bundle, meta=meta, denoise_ms=denoise_ms)
                self.rt.send(msg)
            except BaseException:
                release(bundle)
                raise

    def _decode_one(self, state: RequestState) -> Image.Image | None:
        try:
            return self.pipe.decode_latents([state])[0]
        except Exception as e:
            self.rt.send(failure(state.uid, e))
            return None

    def finish_inline(self, state: RequestState, pre_ms: float, denoise_ms: float) -> None:
        assert self.inline is not None
        try:
            done = self.inline.finish(state)
        except Exception as e:
            self.rt.send(failure(state.uid, e))
            return
        self.rt.send(dataclasses.replace(done, preprocess_ms=pre_ms, denoise_ms=denoise_ms))

    # ---- report ---------------------------------------------------------------------------------
    def _stage(self, uid: str, stage: Stage) -> None:
        """Tell the client (through the supervisor) that request `uid` entered `stage`."""
        if not uid.startswith(CAPTURE_PREFIX):
            self.rt.send(Progress(uid=uid, step=0, num_steps=0, stage=stage))

    def _progress(self, states: list[RequestState]) -> None:
        for s in states:
            if s.notes.capture_key is None:
                self.rt.send(Progress(uid=s.uid, step=s.step_index, num_steps=s.num_steps))

    def log_steps(self) -> None:
        new = self.batcher.steps - self.reported
        if new > 0:
            records = list(self.batcher.records)[-new:]
            for rec in records:
                for uid in rec.joined:
                    self.joined_at.setdefault(uid, rec.t_start)
            counters, residency = self._cache_report()
            msg = LoopSteps(entries=records, cache=counters, residency=residency)
            self.rt.send(msg)
            self.reported = self.batcher.steps

    def report_cache(self) -> None:
        """Between steps, when no step carried them: the cache's counters and residency once
        the residency changed (a capture answered or a template dropped by an idle loop, or,
        read at most every CACHE_REPORT_S, an eviction by another process of the node)."""
        if not self._cache_due(time.monotonic()):
            return
        counters, residency = self._cache_report()
        if residency is not None:
            self.rt.send(LoopSteps(entries=[], cache=counters, residency=residency))

    def _cache_due(self, now: float) -> bool:
        """Whether the host counters and the residency are to be read again: at once after this
        loop added or deleted an entry, else at most every CACHE_REPORT_S (reading them takes
        the host lock) where other processes share the tiers."""
        return self.cache_changed or (
            self.host_tiers and now - self.cache_read_at >= CACHE_REPORT_S
        )

    def _cache_report(self) -> tuple[dict[str, float], dict[str, dict[str, int]] | None]:
        """(counters, residency): the prompt cache's counters (`prompt_*`) and the device
        tier's (this process's, when there is one), and, when due (`_cache_due`), the host
        cache's; the residency of the templates this loop answers for when due and changed
        since it was last reported, else None."""
        out = self.pipe.family.prompts.stats()
        tier_stats = getattr(self.pipe.store, "tier_stats", None)
        if tier_stats is not None:
            out.update((k, float(v)) for k, v in tier_stats().items())
        now = time.monotonic()
        if not self._cache_due(now):
            return out, None
        self.cache_read_at, self.cache_changed = now, False
        tiered = getattr(self.pipe.store, "tiered", None)
        if tiered is not None:
            stats = tiered.stats().items()
            out.update((k, float(v)) for k, v in stats if isinstance(v, (int, float)))
        residency = self._residency()
        if residency == self.residency:
            return out, None
        self.residency = residency
        return out, residency

    def _residency(self) -> dict[str, dict[str, int]]:
        """template id -> {tier: bytes} for every template this loop answers for whose cache is
        resident now (one store query; building, evicted and deleted ones are left out)."""
        query = getattr(self.pipe.store, "residency", None)
        if query is None or not self.template_keys:
            return {}
        by_key = query(set(self.template_keys.values()))
        return {t: dict(by_key[k]) for t, k in self.template_keys.items() if k in by_key}


def run(rt: ChildRuntime) -> None:
    inline = get_policy(rt.wcfg.policy).inline_stages
    stages_here = inline or rt.wcfg.model_stages == "loop"
    pipe = rt.pipeline("all" if stages_here else "backbone", rt.config.model.device,
                       device_tier=True)  # fmt: skip
    if stages_here and warmup.wanted(rt.wcfg.warmup, rt.config.model.device):
        report = warmup.warm_up(pipe, rt.wcfg.max_batch)  # None: failed, logged
        if report is not None:
            log.info("warmed up before ready: %s", report)
    resolve_device_budget(rt.config, pipe.store)  # after the model's load and warm-up
    if not inline:
        forbid_codec_in_this_process()
    loop = Loop(rt, pipe, Stages(pipe) if inline else None)
    rt.ready(cost_spec(pipe, rt.wcfg.profile, loop_stages=stages_here))
    with torch.inference_mode():
        loop.run()
