"""The server's state and the edit path shared by the native and OpenAI routes.

`Runtime` owns the dispatcher, templates, jobs, health monitor and metrics of one app; the worker
pool and the state database are owned by the launcher (started/opened before the app, closed
after it). Everything here runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from instgenie.cache.budgets import CacheDefaults, resolve_cache
from instgenie.config import LimitsConfig
from instgenie.engine.sizing import native_side, resolve_limits, working_size
from instgenie.errors import ValidationError
from instgenie.messages import Progress
from instgenie.scheduler.routing import make_policy
from instgenie.scheduler.views import RouteRequest
from instgenie.server.admission import CostAdmission
from instgenie.server.config import ServerConfig
from instgenie.server.dispatcher import Dispatcher, Outcome, Ticket
from instgenie.server.errors import ApiError, cancel_code
from instgenie.server.health import HealthMonitor
from instgenie.server.jobs import INTERRUPTED, JobTable
from instgenie.server.loras import LoraRegistry
from instgenie.server.metrics import Metrics, fastest_tier, live_families
from instgenie.server.pool import LOCAL_NODE, WorkerPool, WorkerSlot
from instgenie.server.state_db import StateDB
from instgenie.server.templates import TemplateRegistry, template_id_of
from instgenie.server.uploads import ImageInfo, mask_facts, probe_image

log = logging.getLogger("instgenie.server")


@dataclass
class EditSpec:
    """A validated edit, ready for admission."""

    fields: dict  # SubmitEdit fields except uid and submitted_at
    route: RouteRequest
    template_id: str | None  # the registered template it uses, if any
    seed: int
    image_size: tuple[int, int] = (0, 0)  # the image's (width, height), pixels
    #: the (width, height) the worker will work at (engine/sizing.working_size), pixels
    work_size: tuple[int, int] = (0, 0)
    #: run it once more on another worker if its worker dies (the request's `retry` field)
    retry: bool = True


class Runtime:
    def __init__(
        self,
        pool: WorkerPool,
        cfg: ServerConfig,
        limits: LimitsConfig,
        state: StateDB | None = None,
        cache: CacheDefaults | None = None,
        fleet=None,
    ) -> None:
        """`fleet`: a cluster.fleet.Fleet in cluster mode (nodes join and leave: membership)."""
        self.pool = pool
        self.cfg = cfg
        self.model_id = pool.slots[0].config.model.model
        self.native = native_side(self.model_id)
        self.limits = resolve_limits(limits, self.native)
        self.admission = CostAdmission(self.native, cfg.max_request_cost, cfg.max_request_seconds)
        self.started = time.time()
        self.metrics = Metrics()
        self.state = state  # templates and jobs survive a restart in it; None: in memory only
        self.templates = TemplateRegistry(pool, cfg, state)
        self.dispatcher = Dispatcher(pool, make_policy(cfg.routing), cfg, self.templates.ensure)
        self.jobs = JobTable(cfg.max_jobs, cfg.job_ttl_s, cfg.retry_after_s, state)
        # registered LoRAs, in the directory the workers read (the launcher resolves it)
        lcfg = pool.slots[0].config.worker.lora
        self.loras = LoraRegistry(Path(lcfg.lora_dir) if lcfg.lora_dir else None, self.model_id,
                                  lcfg, cfg.max_loras)  # fmt: skip
        # the host cache as the launcher resolved it (None: from the workers' configs)
        cache = cache or resolve_cache(pool.slots[0].config.worker)[1]
        self.health = HealthMonitor(
            pool,
            cfg,
            self.metrics,
            self.on_worker_death,
            lambda _slot: self.dispatcher.pump(),
            cache,
            self.templates.refresh,
        )
        self.metrics.add_live(self._live)
        self._restarts: set[asyncio.Future] = set()
        self.membership = None
        if fleet is not None:
            from instgenie.cluster.membership import Membership  # (imports Ray)

            self.membership = Membership(self, fleet, cfg.cluster_poll_s)

    @property
    def draining(self) -> bool:
        return self.dispatcher.draining

    async def start(self) -> None:
        if self.loras.load():
            log.info("%d LoRA(s) registered in %s", len(self.loras.records), self.loras.directory)
        if self.state is not None:
            templates, jobs = self.templates.load(), self.jobs.load()
            log.info("state %s: %d template(s) and %d async job(s) reloaded",
                        self.state.path, templates, jobs)  # fmt: skip
        self.health.start()
        if self.membership is not None:
            self.membership.start()

    async def stop(self) -> None:
        if self.membership is not None:
            await self.membership.stop()
        await self.health.stop()
        # jobs still unfinished (the drain timed out) end "interrupted", stored as such
        for job in list(self.jobs.jobs.values()):
            if not job.is_finished:
                self.jobs.finish(job, "failed", error=dict(INTERRUPTED))
                if job.task is not None:
                    job.task.cancel()
        await self.jobs.settle()

    # ---- worker lifecycle -----------------------------------------------------------------------
    def on_worker_death(self, slot: WorkerSlot, reason: str) -> None:
        if self.membership is not None and not self.membership.node_alive(slot.node):
            self.remove_worker(slot, f"{reason}; its node left the cluster")
            return
        slot.state = "restarting" if self.cfg.restart_workers and not self.draining else "failed"
        self.dispatcher.worker_down(slot, reason)
        if slot.state != "restarting":
            return
        fut = asyncio.wrap_future(self.pool.restart(slot))
        self._restarts.add(fut)
        fut.add_done_callback(lambda f: self._restarted(slot, f))

    def _restarted(self, slot: WorkerSlot, fut: asyncio.Future) -> None:
        self._restarts.discard(fut)
        if slot.state == "up" and slot in self.pool.slots:
            log.warning("worker %d restarted", slot.index)
            self.templates.resync(slot)
            self.dispatcher.pump()

    def nodes_report(self) -> list[dict]:
        """/health's "nodes": each node with its workers."""
        if self.membership is not None:
            return self.membership.report()
        workers = [s.index for s in self.pool.slots]
        return [{"node": LOCAL_NODE, "address": None, "alive": True, "workers": workers}]

    def add_worker(self, config, node: str, ip: str) -> WorkerSlot:
        """A new worker on `node` (cluster mode: a node joined), started in the background; it
        gets work once up."""
        slot, fut = self.pool.add(config, node, ip)
        self.health.watch(slot)
        done = asyncio.wrap_future(fut)
        self._restarts.add(done)

        def started(f: asyncio.Future) -> None:
            self._restarts.discard(f)
            if f.cancelled() or f.exception() is not None:
                why = "cancelled" if f.cancelled() else str(f.exception())
                slot.state, slot.last_error = "failed", f"start failed: {why}"
                log.error("worker %d on node %s: start failed: %s", slot.index, node[:12], why)
            elif slot.state == "up":
                self.templates.resync(slot)
                self.dispatcher.pump()

        done.add_done_callback(started)
        return slot

    def remove_worker(self, slot: WorkerSlot, reason: str) -> None:
        """Take a worker out for good (cluster mode: its node left): its requests fail with
        worker_died (each re-run once elsewhere, Runtime.execute), its worker is stopped."""
        log.warning("worker %d removed: %s", slot.index, reason)
        slot.last_error = reason
        self.health.unwatch(slot)
        self.pool.remove(slot)
        self.templates.forget_slot(slot)
        self.dispatcher.worker_down(slot, reason)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new work (503), wait for admitted edits to finish; True if all did."""
        self.dispatcher.draining = self.templates.draining = True
        deadline = time.monotonic() + timeout_s
        while not self.dispatcher.idle or self.jobs.running:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    # ---- validation -----------------------------------------------------------------------------
    def probe(self, data: bytes, field: str) -> ImageInfo:
        try:
            return probe_image(data, field, self.limits)
        except ValidationError as exc:
            raise ApiError.from_validation(exc) from None

    @property
    def granule(self) -> int:
        """Working sizes are multiples of this (the workers' CostSpec; 8 before any reported)."""
        specs = [s.cost for s in self.pool.slots if s.cost is not None]
        return specs[0].granule if specs else 8

    def work_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) a worker works at for a `width` x `height` input, as its
        pre-processing decides (oversize policy included); 413 past the limits."""
        g = self.granule
        try:
            w, h = working_size(width, height, g, self.native, self.limits)
        except ValidationError as exc:
            raise ApiError.from_validation(exc) from None
        return max(g, w), max(g, h)  # smaller: the worker refuses the image (422)

    def check_cost(
        self,
        pixels: int,
        steps: int | None,
        guidance: float | None,
        strength: float | None = None,
        what: str = "this edit",
    ) -> None:
        """422 too_costly for a request over the deployment's budget (server/admission.py)."""
        specs = [s.cost for s in self.pool.slots if s.cost is not None and s.accepting]
        self.admission.check(specs, pixels, steps, guidance, strength, what=what)

    def check_params(
        self, prompt: str, negative: str | None, steps: int | None, guidance: float | None
    ) -> None:
        lim = self.limits
        for name, text in (("prompt", prompt), ("negative_prompt", negative)):
            if text is not None and len(text) > lim.max_prompt_chars:
                raise ApiError.invalid(
                    name, f"is {len(text)} characters; the limit is {lim.max_prompt_chars}"
                )
        # one message per field for every out-of-range value (the schemas only document bounds)
        if steps is not None and not 1 <= steps <= lim.max_steps:
            raise ApiError.invalid(
                "num_inference_steps",
                f"must be an integer between 1 and {lim.max_steps}, got {steps}",
            )
        if guidance is not None and not 0 <= guidance <= lim.max_guidance_scale:
            raise ApiError.invalid(
                "guidance_scale",
                f"must be a number between 0 and {lim.max_guidance_scale:g}, got {guidance}",
            )

    def default_steps(self) -> int | None:
        """Steps of a template, or of an edit of no template, that names none: the configured
        default (capped by the limit); None = the model's own default. A template registered
        without steps is stored with these, so its edits (which default to the template's
        steps) run the steps its cache was captured at."""
        if self.cfg.default_steps:
            return min(self.cfg.default_steps, self.limits.max_steps)
        return None

    def prepare_edit(
        self,
        *,
        image: bytes | None,
        mask: bytes,
        template_id: str | None,
        prompt: str,
        negative_prompt: str | None = None,
        seed: int = 0,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        strength: float = 1.0,
        output_format: str = "png",
        paste_back: bool = True,
        size: tuple[int, int] | None = None,
        retry: bool = True,
        loras: list[tuple[str, float]] | None = None,
    ) -> EditSpec:
        """Validate an edit from its header-level facts; 4xx naming the field otherwise.
        `loras`: [(registered LoRA id, scale), ...] (404 lora_not_found for an unknown id)."""
        self.check_params(prompt, negative_prompt, num_inference_steps, guidance_scale)
        refs = self.loras.check(loras)
        if template_id is not None and image is not None:
            raise ApiError.invalid("template_id", "give either template_id or image, not both")
        rec = None
        if template_id is not None:
            rec = self.templates.records.get(template_id)
            if rec is None:
                raise ApiError.invalid(
                    "template_id",
                    f"no template {template_id} is registered (POST /v1/templates first)",
                )
            width, height = rec.width, rec.height
        elif image is not None:
            info = self.probe(image, "image")
            width, height = info.size
            found = self.templates.records.get(template_id_of(image))
            if found is not None and found.state(self.pool) != "failed":
                rec, image = found, None  # the same bytes: edit the registered template
        else:
            raise ApiError.invalid("image", "an image (or a template_id) is required")
        minfo = self.probe(mask, "mask")
        if minfo.size != (width, height):
            raise ApiError.invalid(
                "mask",
                f"is {minfo.width}x{minfo.height} but the image is "
                f"{width}x{height}; the mask must have the image's size",
            )
        steps = num_inference_steps
        if steps is None and rec is not None:
            steps = rec.msg.num_inference_steps
        if steps is None:
            steps = self.default_steps()
        if guidance_scale is None and rec is not None:
            guidance_scale = rec.msg.guidance_scale
        out_w, out_h = size if size is not None else (None, None)
        work = (out_w, out_h) if size is not None else self.work_size(width, height)
        if work[0] * work[1] > self.limits.max_image_pixels:
            raise ApiError(
                413,
                "image_too_large",
                f"size: {work[0]}x{work[1]} = {work[0] * work[1]} pixels; the limit is "
                f"{self.limits.max_image_pixels} pixels (raise it with --max-image-pixels)",
                "size",
            )
        self.check_cost(work[0] * work[1], steps, guidance_scale, strength)
        fields = dict(
            image=image,
            mask=mask,
            prompt=prompt,
            negative_prompt=negative_prompt,
            seed=seed,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            strength=strength,
            width=out_w,
            height=out_h,
            paste_back=paste_back,
            output_format=output_format,
            template_id=rec.template_id if rec is not None else None,
            loras=refs,
        )
        tid = rec.template_id if rec is not None else None
        route = RouteRequest(template_id=tid, num_steps=steps, pixels=work[0] * work[1],
                             guidance=guidance_scale, strength=strength)  # fmt: skip
        return EditSpec(fields, route, tid, seed, (width, height), work, retry)

    async def measure_mask(self, specs: list[EditSpec]) -> None:
        """Fill the routing facts a mask-aware policy prices (RouteRequest.mask_ratio, pixels
        and token_ratios at the workers' token strides) from each spec's mask at the working
        size the worker will use, decoded off the event loop; a mask that does not decode is a
        422 here, before it takes a place."""
        if not getattr(self.dispatcher.policy, "needs_mask", False):
            return
        specs_of = [s.cost for s in self.pool.slots if s.cost is not None]
        if not specs_of:
            return
        strides = sorted({b.stride for c in specs_of for b in c.blocks})
        # the workers of one server share one model config, so one margin
        margin = max(c.compute_margin for c in specs_of)
        measured: dict[tuple, tuple[float, dict[int, float]]] = {}
        for spec in specs:
            mask = spec.fields["mask"]
            work = spec.work_size
            key = (id(mask), work)  # the n edits of one OpenAI request share their mask
            if key not in measured:
                try:
                    measured[key] = await asyncio.to_thread(
                        mask_facts, mask, spec.image_size, work, self.limits, strides, margin
                    )
                except ValidationError as exc:
                    raise ApiError.from_validation(exc) from None
            ratio, ratios = measured[key]
            spec.route = dataclasses.replace(
                spec.route, mask_ratio=ratio, pixels=work[0] * work[1],
                token_ratios=tuple(sorted(ratios.items())),
            )  # fmt: skip

    # ---- running --------------------------------------------------------------------------------
    def admit(self, spec: EditSpec) -> Ticket:
        return self.dispatcher.admit(spec.route)

    async def execute(
        self, ticket: Ticket, spec: EditSpec, on_progress: Callable[[Progress], None] | None = None
    ) -> dict:
        """Run an admitted edit; the native edit response as a dict. If its worker dies (the
        worker's process, or its whole node) and the request allows it (`spec.retry`), it is
        admitted and run once more while another worker is accepting (`_may_retry`): an edit is
        deterministic under its seed, so the image is the one the first worker would have
        made. The response keeps the first ticket's id."""
        first, retried = ticket, False
        while True:
            try:
                outcome = await self.dispatcher.run(ticket, spec.fields, on_progress)
                break
            except ApiError as exc:
                if exc.code == "worker_died" and self._may_retry(spec, ticket, retried):
                    retried = True
                    self.metrics.retries.inc()
                    log.warning("edit %s: %s; running it again on another worker", first.uid,
                                exc.message)  # fmt: skip
                    try:
                        ticket = self.dispatcher.admit(spec.route)
                        continue
                    except ApiError as again:
                        exc = again
                self.metrics.failures.labels(exc.code).inc()
                raise exc from None
            except asyncio.CancelledError as exc:  # DELETE of its job, client gone, stopping
                self.metrics.failures.labels(cancel_code(exc)).inc()
                raise
        return self._response(first, spec, outcome, retried)

    def _may_retry(self, spec: EditSpec, ticket: Ticket, retried: bool) -> bool:
        """An edit whose worker died runs again once, on another worker: only while one is
        accepting (a lone worker's death is answered worker_died, as a request that killed its
        worker must not kill it twice)."""
        if not spec.retry or retried or self.draining:
            return False
        return any(s.accepting and s is not ticket.slot for s in self.pool.slots)

    def _response(self, ticket: Ticket, spec: EditSpec, outcome: Outcome, retried: bool) -> dict:
        d = outcome.done
        tier = None
        if d.cache == "hit":
            tier = d.cache_tier  # the tier the worker read the cache from
            if tier is None and spec.template_id is not None:  # a worker that does not say
                rec = self.templates.records.get(spec.template_id)
                build = rec.builds.get(outcome.worker) if rec is not None else None
                tier = fastest_tier(build.bytes_by_tier if build is not None else {})
            self.metrics.cache_hits.labels(tier or "unknown").inc()
        if d.fallback_reason is not None:  # a slower edit than its template promised
            log.warning(
                "edit %s of template %s took the full path: %s",
                ticket.uid, (spec.template_id or "")[:12], d.fallback_reason,
            )  # fmt: skip
        self.metrics.edits.labels(d.path, d.cache or "none").inc()
        self.metrics.edit_seconds.observe(outcome.server_total_ms / 1e3)
        return {
            "id": ticket.uid,
            "object": "edit",
            "created": int(time.time()),
            "model": self.model_id,
            "image": base64.b64encode(d.data).decode(),
            "output_format": d.output_format,
            "width": d.width,
            "height": d.height,
            "mask_ratio": d.mask_ratio,
            "num_steps": d.num_steps,
            "path": d.path,
            "cache": d.cache,
            "cache_tier": tier,
            "fallback_reason": d.fallback_reason,
            "template_id": spec.template_id,
            "seed": spec.seed,
            "worker": outcome.worker,
            "node": outcome.node,
            "retried": retried,
            "timings": {
                "queue_ms": d.queue_ms,
                "preprocess_ms": d.preprocess_ms,
                "denoise_ms": d.denoise_ms,
                "postprocess_ms": d.postprocess_ms,
                "total_ms": d.total_ms,
                "server_queue_ms": outcome.server_queue_ms,
                "server_total_ms": outcome.server_total_ms,
            },
        }

    # ---- metrics --------------------------------------------------------------------------------
    def _live(self):
        ok_rows = self.health.report()[1]
        workers = [
            {
                "index": s.index,
                "node": s.node,
                "in_flight": s.in_flight,
                "up": row["healthy"],
                "restarts": s.restarts,
                "stats": s.stats,
            }
            for s, row in zip(self.pool.slots, ok_rows, strict=True)
        ]
        states: dict[str, int] = {}
        for rec in self.templates.records.values():
            st = rec.state(self.pool)
            states[st] = states.get(st, 0) + 1
        return live_families(len(self.dispatcher.waiting), workers, states)
