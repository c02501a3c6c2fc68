"""The step-split editing pipeline: pre-process -> denoise_step(batch) x N -> post-process.

`EditPipeline` owns validation, image I/O, templates and path selection, and delegates model work
to a family adapter. The three stages are separate calls so that a serving loop can run
pre/post-processing elsewhere and step a batch whose members joined at different times.

Path selection: an edit on a registered template whose cache is ready and matches the edit's step
schedule, resolution and CFG rows runs "masked" (computes its masked tokens, the rest from the
cache); otherwise it runs "full". A full run of a template's capture spec records the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from PIL import Image

from instgenie.cache.disk import CacheMiss
from instgenie.cache.store import ActivationStore, InMemoryStore, TemplateMeta, tier_of
from instgenie.config import LimitsConfig
from instgenie.engine.costspec import cost_spec
from instgenie.engine.family import ModelFamily, load_family
from instgenie.engine.imageio import (
    OUTPUT_FORMATS,
    decode_image,
    decode_mask,
    encode_image,
    mask_ratio,
    paste_back,
)
from instgenie.engine.masked.tokens import dilate, pixel_mask_tensor
from instgenie.engine.request import DecodedInputs, EditRequest, EditResult, RequestState
from instgenie.engine.sizing import pixel_hint, resolve_limits, working_size
from instgenie.engine.step_pricing import StepPricer
from instgenie.engine.templates import TemplateRecord, TemplateSpec, mismatch, template_key
from instgenie.errors import TooManyPixelsError, ValidationError
from instgenie.lora.apply import LoraBatch, use_lora
from instgenie.lora.store import AdapterStore, check_request
from instgenie.messages import CacheOutcome, Path, Tier
from instgenie.scheduler.fits import Profile
from instgenie.scheduler.step import GraphUse, StepPlan, members_of

MAX_SEED = 2**63 - 1


class EditPipeline:
    def __init__(
        self,
        family: ModelFamily,
        limits: LimitsConfig | None = None,
        store: ActivationStore | None = None,
        profile: Profile | None = None,
        compute_margin: int | None = None,
    ) -> None:
        self.family = family
        #: pixels around an edit's mask its masked path computes too: the family's
        #: (ModelConfig.compute_margin) unless given (benchmarks compare margins on one model)
        self.compute_margin = family.compute_margin if compute_margin is None else compute_margin
        if self.compute_margin < 0:
            raise ValueError(f"compute_margin is a pixel count >= 0, got {compute_margin}")
        #: max_image_pixels = 0 (the default) resolves to the family's native area x 4
        self.limits = resolve_limits(limits or LimitsConfig(), family.default_size)
        self.store = store if store is not None else InMemoryStore(family.device)
        self.templates: dict[str, TemplateRecord] = {}
        #: the fitted latency profile (engine.costspec.cost_spec prices with it), or None
        self.profile = profile
        #: the adapters of edits that name LoRAs (attach_loras); None = LoRAs are refused
        self.loras: AdapterStore | None = None
        #: bounded asynchronous loading: steps an edit may run before its adapters arrive
        self.lora_async_steps = 0
        #: with a fitted profile, the load planner picks the blocks that compute all tokens in
        #: each step's plan, priced with this worker's own CostSpec (the one its loop sends to
        #: the router)
        self.cost_model: StepPricer | None = None
        if profile is not None:
            self.cost_model = StepPricer(cost_spec(self), family.device)

    @classmethod
    def load(
        cls,
        model: str,
        device: str = "cpu",
        dtype: str = "auto",
        limits: LimitsConfig | None = None,
        **options: Any,
    ) -> EditPipeline:
        """`options`: load_family's keywords (engine.family.family_options)."""
        return cls(load_family(model, device=device, dtype=dtype, **options), limits)

    # ---- validation ----------------------------------------------------------------------------
    def _check_fields(self, req: EditRequest | TemplateSpec) -> None:
        lim = self.limits
        _check_text("prompt", req.prompt, lim.max_prompt_chars, required=True)
        _check_text("negative_prompt", req.negative_prompt, lim.max_prompt_chars, required=False)
        seed = req.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise ValidationError("seed", f"must be an integer in [0, {MAX_SEED}], got {seed!r}")
        steps = req.num_inference_steps
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= lim.max_steps
        ):
            raise ValidationError(
                "num_inference_steps", f"must be an integer in [1, {lim.max_steps}], got {steps!r}"
            )
        g = req.guidance_scale
        if g is not None and not (0.0 <= float(g) <= lim.max_guidance_scale):
            raise ValidationError(
                "guidance_scale", f"must be in [0, {lim.max_guidance_scale}], got {g!r}"
            )
        if not 0.0 < float(req.strength) <= 1.0:
            raise ValidationError("strength", f"must be in (0, 1], got {req.strength!r}")
        check_request(getattr(req, "loras", ()), self.loras)

    def validate(self, req: EditRequest) -> tuple[Image.Image, Image.Image, int, int]:
        """Check every field; decode image and mask. Returns (image, mask, height, width)."""
        self._check_fields(req)
        if req.output_format.lower() not in OUTPUT_FORMATS:
            raise ValidationError(
                "output_format", f"{req.output_format!r} is not one of png, jpeg, webp"
            )
        if req.template_id is not None:
            record = self.templates.get(req.template_id)
            if record is None:
                raise ValidationError(
                    "template_id", f"no template {req.template_id!r} is registered"
                )
            image = record.image if req.image is None else decode_image(req.image, self.limits)
        elif req.image is None:
            raise ValidationError("image", "is required when no template_id is given")
        else:
            image = decode_image(req.image, self.limits)
        mask = decode_mask(req.mask, image.size, self.limits, "mask")
        height, width = self._working_size(req, image)
        return image, mask, height, width

    def _working_size(self, req: EditRequest | TemplateSpec, image: Image.Image) -> tuple[int, int]:
        """(height, width) the model works at: the request's, or the image's rounded down to
        the granule (scaled to the native area when over max_image_pixels under
        oversize="resize"; engine/sizing.py)."""
        g = self.family.granule
        w, h = image.size
        auto_w, auto_h = working_size(w, h, g, self.family.default_size, self.limits)
        height = req.height if req.height is not None else auto_h
        width = req.width if req.width is not None else auto_w
        for name, value in (("height", height), ("width", width)):
            if getattr(req, name) is None and value < g:  # derived from a too-small image
                raise ValidationError(
                    "image", f"is {w}x{h}; this model needs at least {g}x{g} pixels"
                )
            if value < g or value % g:
                raise ValidationError(
                    name, f"{value} must be a positive multiple of {g} pixels for this model"
                )
        if height * width > self.limits.max_image_pixels:
            raise TooManyPixelsError(
                "width" if req.width is not None else "image",
                f"works at {width}x{height} = {width * height} pixels; the limit is "
                f"{self.limits.max_image_pixels} pixels ({pixel_hint(self.limits)})",
            )
        return height, width

    # ---- templates -----------------------------------------------------------------------------
    def register_template(self, spec: TemplateSpec) -> str:
        """Validate and record a template; returns its key. The cache is built by running
        `capture_state(key)` (alone or batched with other requests) or `build_template`."""
        self._check_fields(spec)
        image = decode_image(spec.image, self.limits, "image")
        mask = None if spec.mask is None else decode_mask(spec.mask, image.size, self.limits)
        height, width = self._working_size(spec, image)
        fam = self.family
        steps, guidance = fam.resolve_steps_guidance(spec.num_inference_steps, spec.guidance_scale)
        cfg = fam.uses_cfg(guidance)
        key = template_key(
            str(fam.spec), fam.pipe.scheduler.config, image, mask, spec,
            height=height, width=width, num_steps=steps, cfg=cfg,
            cache_dtype=str(self.store_dtype()),
            layout=fam.masked.cache_layout,
        )  # fmt: skip
        self.templates.setdefault(key, TemplateRecord(key, spec, image, height, width))
        return key

    def store_dtype(self) -> torch.dtype:
        return getattr(self.store, "dtype", None) or self.family.dtype

    def capture_state(self, key: str) -> RequestState | None:
        """A full run of the template's spec that records its cache; None if the cache is
        already ready or being built."""
        if self.store.status(key) != "absent":
            return None
        state = self.prepare_capture(key)
        self.attach_writer(state, key)
        return state

    def prepare_capture(self, key: str) -> RequestState:
        """Pre-process the capture run of a registered template (no store access: in a worker
        this runs in the pre-processing process, the writer is attached in the loop)."""
        state = self.encode_inputs(self.capture_inputs(key))
        state.notes = replace(state.notes, capture_key=key)
        return state

    def capture_inputs(self, key: str) -> DecodedInputs:
        """The decoded inputs of a registered template's capture run."""
        rec = self.templates[key]
        spec = rec.spec
        image = rec.image
        if spec.mask is None:
            mask = Image.new("L", image.size, 0)
        else:
            mask = decode_mask(spec.mask, image.size, self.limits)
        req = EditRequest(
            uid=f"capture:{key[:16]}", image=None, mask=mask, prompt=spec.prompt,
            negative_prompt=spec.negative_prompt, seed=spec.seed,
            num_inference_steps=spec.num_inference_steps, guidance_scale=spec.guidance_scale,
            strength=spec.strength, height=rec.height, width=rec.width, loras=spec.loras,
        )  # fmt: skip
        return self._resize(req, image, mask, rec.height, rec.width)

    def attach_writer(self, state: RequestState, key: str) -> None:
        """Make `state` (a prepared capture run) record template `key`'s cache."""
        meta = TemplateMeta(
            num_steps=state.num_steps,
            num_rows=state.num_rows,
            timesteps=tuple(state.timesteps.tolist()),
            latent_shape=tuple(state.latents.shape),
        )
        state.writer = self.store.writer(key, meta)

    def build_template(self, spec: TemplateSpec) -> str:
        """Register and capture synchronously (a convenience for scripts and tests)."""
        key = self.register_template(spec)
        state = self.capture_state(key)
        while state is not None and not state.is_done:
            self.denoise_step([state])
        return key

    def prefetch(self, template_id: str):
        """Start moving a template's cache from disk into host DRAM now, in the background.
        Call it when a request is queued: the queueing time then hides the disk read (paper
        §4.2). Returns the store's future, or None when there is nothing to do."""
        fn = getattr(self.store, "prefetch", None)
        if fn is None or template_id not in self.templates:
            return None
        return fn(template_id)

    # ---- pre-process ---------------------------------------------------------------------------
    @staticmethod
    def _resize(
        req: EditRequest, image: Image.Image, mask: Image.Image, height: int, width: int
    ) -> DecodedInputs:
        work_image, work_mask = image, mask
        if image.size != (width, height):
            work_image = image.resize((width, height), Image.Resampling.LANCZOS)
            work_mask = mask.resize((width, height), Image.Resampling.NEAREST)
        return DecodedInputs(req, image, mask, work_image, work_mask, height, width)

    def decode_inputs(self, req: EditRequest) -> DecodedInputs:
        """Pre-processing's CPU half: validate every field, decode, resize. No model work."""
        image, mask, height, width = self.validate(req)
        inputs = self._resize(req, image, mask, height, width)
        if not inputs.work_mask.getbbox():  # binary: empty = all zero
            raise ValidationError(
                "mask", f"becomes empty at the working resolution {width}x{height}"
            )
        return inputs

    def encode_inputs(self, inputs: DecodedInputs) -> RequestState:
        """Pre-processing's model half: prompt encoding (with the request's text-encoder
        LoRAs), VAE encoding, initial noise. Starts loading its backbone LoRAs."""
        refs = inputs.request.loras
        if refs and self.loras is None:
            raise ValidationError("loras", "this model process serves no LoRAs")
        use = self.loras.use_for(refs) if refs else None
        text = None
        if use is not None and use.text:
            text = LoraBatch.uniform_for(use.text, self.family.device, self.family.dtype)
        with torch.inference_mode(), use_lora(text):
            state = self.family.prepare(
                inputs.request, inputs.work_image, inputs.work_mask, inputs.height, inputs.width
            )
        state.original_image, state.original_mask = inputs.image, inputs.mask
        state.lora = use
        return state

    # ---- LoRA ----------------------------------------------------------------------------------
    def attach_loras(self, store: AdapterStore, async_steps: int = 0) -> None:
        self.loras, self.lora_async_steps = store, async_steps

    def resolve_loras(self, state: RequestState, wait: bool) -> bool:
        """Give `state` its backbone adapters if they are loaded (wait: block until they are);
        True once it has them or names none (AdapterStore.resolve)."""
        return state.lora is None or self.loras.resolve(state.lora, wait)

    def preprocess(self, req: EditRequest, select_path: bool = True) -> RequestState:
        """Validate and prepare. With `select_path` (one process), an edit on a template picks
        the masked path here; a worker's pre-processing process passes False and its loop calls
        `select_path` against the loop's own store."""
        state = self.encode_inputs(self.decode_inputs(req))
        if select_path and req.template_id is not None:
            self.select_path(state, req.template_id)
        return state

    def select_path(self, state: RequestState, key: str) -> None:
        """Masked path if the template's cache is ready and structurally matches the edit;
        otherwise the full path, with why in `notes.fallback_reason` (see `mismatch`)."""
        state.notes = replace(state.notes, cache=CacheOutcome.MISS)
        status = self.store.status(key)
        if status != "ready":
            why = f"the template's cache is not ready ({status})"
            state.notes = replace(state.notes, fallback_reason=why)
            return
        try:
            meta = self.store.meta(key)
        except CacheMiss:  # deleted since the status check
            state.notes = replace(state.notes, fallback_reason="the template's cache was dropped")
            return
        pixels = dilate(pixel_mask_tensor(state.mask), self.compute_margin)
        masks = self.family.token_masks(pixels)
        why = mismatch(meta, state, masks)
        if why is not None:
            state.notes = replace(state.notes, fallback_reason=why)
            return
        tier = tier_of(self.store, key)  # before open: which tier served it (open may promote)
        try:
            handle = self.store.open(key)
        except CacheMiss:  # evicted, or a corrupt/missing disk entry: recompute in full
            why = "the template's cache was evicted or is unreadable"
            state.notes = replace(state.notes, fallback_reason=why)
            return
        # a handle that knows its tier says it (a device-tier copy that finished meanwhile)
        tier = getattr(handle, "tier", tier)
        state.path, state.cache_key, state.cache_meta = Path.MASKED, key, meta
        state.cache_handle = handle
        state.token_index = {L: m.nonzero().squeeze(1) for L, m in masks.items()}
        state.edit_mask = self.family.edit_mask(masks, state)
        state.notes = replace(state.notes, cache=CacheOutcome.HIT, cache_tier=Tier.named(tier))

    # ---- denoise -------------------------------------------------------------------------------
    def prepare_reads(self, batch: Sequence[RequestState]) -> None:
        """Make every cache-reading request's rows of its coming step readable (a host-tier
        cache gets its device step window, decided once); raises CacheReadFailed naming the one
        request whose cache cannot be read, before anything is computed. Call it before the
        step is planned: the load planner prices a windowed host cache as device-resident."""
        with torch.inference_mode():
            self.family.masked.prepare_reads(list(batch))

    def compute_all(self, batch: Sequence[RequestState]) -> frozenset[int]:
        """The load planner's decision for one step of `batch`: the blocks that compute every
        token. Empty without a fitted profile or when no request reads a cache."""
        if self.cost_model is None or not any(s.cache_handle is not None for s in batch):
            return frozenset()
        return self.cost_model.compute_all(list(batch))

    def plan_step(
        self,
        batch: Sequence[RequestState],
        *,
        index: int = 0,
        horizon: int | None = None,
        graph: GraphUse = GraphUse.AUTO,
        timed: bool = False,
    ) -> StepPlan:
        """The plan of one step of `batch` outside a serving loop (scripts, benchmarks, the
        profiler; the worker's batcher builds its own): members at their step indices and the
        load planner's compute-all set. Call after prepare_reads."""
        return StepPlan(index=index, members=members_of(batch), horizon=horizon,
                        compute_all=self.compute_all(batch), graph=graph, timed=timed)  # fmt: skip

    def denoise_step(self, batch: Sequence[RequestState], plan: StepPlan | None = None) -> None:
        """One step for every unfinished request in `batch`, each at its own step index, as
        `plan` says (its members must be exactly those requests; the caller ran prepare_reads
        before planning). Without a plan: prepare_reads, then plan_step with defaults."""
        active = [s for s in batch if not s.is_done]
        if not active:
            return
        if plan is None:
            for s in active:  # outside a serving loop adapters load synchronously (K = 0)
                self.resolve_loras(s, wait=True)
            self.prepare_reads(active)
            plan = self.plan_step(active)
        with torch.inference_mode():
            self.family.denoise_step(active, plan)
        for s in active:
            if s.is_done:
                self.release(s)

    def release(self, state: RequestState) -> None:
        """Finish a request's cache use: commit its capture, close its cache handle. Called when
        it completes; call it for a request dropped before completion (its capture aborts)."""
        if state.lora is not None and state.lora.adapters and self.loras is not None:
            self.loras.unpin(state.lora.refs, "backbone")
            state.lora.adapters = ()
        if state.writer is not None:
            # a capture whose latents went non-finite is never committed: a ready entry would
            # serve NaN rows to every edit of the template (and outlive it on disk)
            if state.is_done and bool(torch.isfinite(state.latents).all()):
                state.writer.commit()
            else:
                state.writer.abort()
            if getattr(state.writer, "lost", False):  # another process captures this key
                state.notes = replace(state.notes, capture_lost_race=True)
            if getattr(state.writer, "no_room", ""):  # the node's tiers are full of entries in use
                state.notes = replace(state.notes, capture_no_room=state.writer.no_room,
                                      capture_too_large=state.writer.never)  # fmt: skip
            state.writer = None
        if state.cache_handle is not None:
            cropped = self.family.cropped
            if state.is_done and state.request.paste_back and cropped and cropped.is_on:
                # the template's final latents, for the cropped VAE decode: copied, the
                # handle's views die with it (a host tier's segment, a device window)
                final = state.cache_handle.latents(state.num_steps - 1)
                state.template_latents = final.to(
                    state.latents.device, state.latents.dtype, copy=True
                )
            state.cache_handle.close()
            state.cache_handle = None

    # ---- post-process --------------------------------------------------------------------------
    def postprocess(self, batch: Sequence[RequestState]) -> list[EditResult]:
        images = self.decode_latents(batch)
        return [self.finish(state, img) for state, img in zip(batch, images, strict=True)]

    def decode_latents(self, batch: Sequence[RequestState]) -> list[Image.Image]:
        """Post-processing's model half: VAE decode (working resolution)."""
        with torch.inference_mode():
            return self.family.decode(list(batch))

    def finish(self, state: RequestState, img: Image.Image) -> EditResult:
        """Post-processing's CPU half: back to the input size, paste-back, encode."""
        original, mask = state.original_image or state.image, state.original_mask or state.mask
        if img.size != original.size:
            img = img.resize(original.size, Image.Resampling.LANCZOS)
        if state.request.paste_back:
            img = paste_back(img, original, mask)
        return EditResult(
            uid=state.uid,
            data=encode_image(
                img,
                state.request.output_format,
                png_compression=self.family.execution.png_compression,
            ),
            output_format=state.request.output_format.lower(),
            image=img,
            mask_ratio=mask_ratio(mask),
            num_steps=state.num_steps,
            path=state.path,
            cache=state.notes.cache,
            cache_tier=state.notes.cache_tier,
            fallback_reason=state.notes.fallback_reason,
        )

    # ---- convenience ---------------------------------------------------------------------------
    def run(self, requests: Sequence[EditRequest]) -> list[EditResult]:
        """Run requests to completion together (every step batches all unfinished requests).
        A referenced template whose cache is absent is captured in the same batch."""
        states = [self.preprocess(r) for r in requests]
        captures = []
        for key in dict.fromkeys(r.template_id for r in requests if r.template_id):
            cap = self.capture_state(key)
            if cap is not None:
                captures.append(cap)
        everything = states + captures
        while not all(s.is_done for s in everything):
            self.denoise_step(everything)
        return self.postprocess(states)


def _check_text(field: str, value: object, limit: int, *, required: bool) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str):
        raise ValidationError(field, f"must be a string, got {type(value).__name__}")
    if len(value) > limit:
        raise ValidationError(field, f"is {len(value)} characters; the limit is {limit}")
