"""Pre- and post-processing of worker requests: messages in, pipeline work, messages out.

Used by the pre/post processes and, under `naive-continuous`, inline by the loop process.
Pre: SubmitEdit -> validated, prepared RequestState (image decode, resize, prompt and VAE
encode, noise); RegisterTemplate -> a registered template; BuildTemplate -> the template's capture
run. Post: a finished RequestState -> EditDone (VAE decode, resize back, paste-back, encode).
With model_stages="loop" the pre/post processes do only the CPU halves (`decode`,
`build_inputs`, `finish(decoded=...)`) and the loop runs the model halves.

Template ids: clients name a template by `template_id` (64 hex); the pipeline keys it by a hash of
the model, scheduler, image and capture spec. Each pre process maps one to the other; the loop
only ever sees pipeline keys.
"""

from __future__ import annotations

import dataclasses
import time

from PIL import Image

from instgenie import faults
from instgenie.engine.pipeline import DecodedInputs, EditPipeline
from instgenie.engine.request import EditRequest, RequestState
from instgenie.engine.templates import TemplateSpec
from instgenie.errors import InstGenIEError, ValidationError
from instgenie.messages import EditDone, EditFailed, RegisterTemplate, RequestNotes, SubmitEdit
from instgenie.worker.names import CAPTURE_PREFIX, capture_uid  # noqa: F401 (re-exported)


def failure(uid: str, exc: BaseException) -> EditFailed:
    """The EditFailed for an exception raised while handling request `uid`: typed errors keep
    their code and message; anything else is an internal error named by its type."""
    if isinstance(exc, InstGenIEError):
        return EditFailed(uid=uid, code=exc.code, message=exc.message, retryable=False)
    return EditFailed(
        uid=uid,
        code="internal_error",
        message=f"{type(exc).__name__}: {str(exc)[:500]}",
        retryable=False,
    )


class Stages:
    """The request-facing side of one pipeline (pre and post processing)."""

    def __init__(self, pipe: EditPipeline) -> None:
        self.pipe = pipe
        #: client template id -> pipeline template key
        self.keys: dict[str, str] = {}
        #: client template id -> why its registration failed
        self.rejected: dict[str, str] = {}

    # ---- pre ------------------------------------------------------------------------------------
    def register(self, msg: RegisterTemplate) -> None:
        """Validate and record a template (idempotent); a failure is kept for `build`."""
        spec = TemplateSpec(
            image=msg.image, prompt=msg.prompt, negative_prompt=msg.negative_prompt,
            seed=msg.seed, num_inference_steps=msg.num_inference_steps,
            guidance_scale=msg.guidance_scale, strength=msg.strength, mask=msg.mask,
            loras=tuple((str(i), float(s)) for i, s in msg.loras),
        )  # fmt: skip
        try:
            self.keys[msg.template_id] = self.pipe.register_template(spec)
            self.rejected.pop(msg.template_id, None)
        except InstGenIEError as e:
            self.keys.pop(msg.template_id, None)
            self.rejected[msg.template_id] = e.message

    def drop(self, template_id: str) -> str | None:
        """Forget a template; returns its pipeline key (None if it had none)."""
        self.rejected.pop(template_id, None)
        key = self.keys.pop(template_id, None)
        if key is not None and key not in self.keys.values():
            self.pipe.templates.pop(key, None)
        return key

    def _key(self, template_id: str) -> str:
        key = self.keys.get(template_id)
        if key is None:
            why = self.rejected.get(template_id, "it was never registered")
            raise ValidationError("template_id", f"template {template_id} is unusable: {why}")
        return key

    def build(self, template_id: str) -> RequestState:
        """The capture run of a registered template (notes: capture_key, template_id)."""
        state = self.pipe.prepare_capture(self._key(template_id))
        state.uid = capture_uid(template_id)
        state.notes = dataclasses.replace(state.notes, template_id=template_id)
        return state

    def build_inputs(self, template_id: str) -> tuple[DecodedInputs, RequestNotes]:
        """The decoded inputs of a capture run and its notes (model_stages="loop")."""
        key = self._key(template_id)
        notes = RequestNotes(capture_key=key, template_id=template_id)
        return self.pipe.capture_inputs(key), notes

    def edit_request(self, msg: SubmitEdit) -> EditRequest:
        template = msg.template_id
        if template is not None:
            if template in self.rejected:
                raise ValidationError(
                    "template_id", f"template {template} failed: {self.rejected[template]}"
                )
            if template not in self.keys:
                raise ValidationError("template_id", f"no template {template!r} is registered")
            template = self.keys[template]
        return EditRequest(
            uid=msg.uid, image=msg.image, mask=msg.mask, prompt=msg.prompt,
            negative_prompt=msg.negative_prompt, seed=msg.seed,
            num_inference_steps=msg.num_inference_steps, guidance_scale=msg.guidance_scale,
            strength=msg.strength, height=msg.height, width=msg.width,
            paste_back=msg.paste_back, output_format=msg.output_format, template_id=template,
            loras=tuple((str(i), float(s)) for i, s in msg.loras),
        )  # fmt: skip

    def prepare(self, msg: SubmitEdit) -> RequestState:
        """Validate and prepare an edit (no path selection: the loop does it against its store).
        Raises ValidationError for bad input."""
        return self.pipe.encode_inputs(self.decode(msg))

    def decode(self, msg: SubmitEdit) -> DecodedInputs:
        """Validate, decode and resize an edit's inputs (no model work)."""
        faults.check("pre", msg.prompt)
        inputs = self.pipe.decode_inputs(self.edit_request(msg))
        if msg.template_id is not None:
            self.pipe.prefetch(inputs.request.template_id)  # disk -> DRAM while it queues
        return inputs

    # ---- post -----------------------------------------------------------------------------------
    def finish(self, state: RequestState, decoded: Image.Image | None = None) -> EditDone:
        """Decode (unless `decoded` is its VAE output already), restore size, paste back and
        encode a finished request."""
        t0 = time.perf_counter()
        faults.check("post", state.request.prompt)
        if decoded is None:
            result = self.pipe.postprocess([state])[0]
        else:
            result = self.pipe.finish(state, decoded)
        width, height = result.image.size
        return EditDone(
            uid=state.uid, data=result.data, output_format=result.output_format,
            width=width, height=height, mask_ratio=result.mask_ratio,
            num_steps=result.num_steps, path=result.path, cache=result.cache,
            cache_tier=result.cache_tier, fallback_reason=result.fallback_reason,
            postprocess_ms=1e3 * (time.perf_counter() - t0),
        )  # fmt: skip
