"""RequestState <-> (CPU tensors, typed meta): how a request crosses process boundaries.

Tensors go into a shared-memory bundle (instgenie.tensorshm); the meta (messages.InputsMeta,
messages.StateMeta) travels in the msgpack message. With `model_stages="loop"` a request crosses
as decoded inputs (pre -> loop, `inputs_to_parts`) and its finished state carries the VAE-decoded
image (loop -> post, `to_parts(decoded=...)`). Images travel as uint8 arrays (decoded once, in
pre-processing). Only the loop holds device tensors; `from_parts` moves the denoising tensors to
the given device.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from PIL import Image

from instgenie.engine.pipeline import DecodedInputs
from instgenie.engine.request import EditRequest, RequestState
from instgenie.lora.gate import LoraUse
from instgenie.messages import EditParams, InputsMeta, RequestNotes, StateMeta

#: tensors a finished request needs in post-processing (cond is dropped after the last step)
_POST_SKIP = ("cond.",)
#: tensors `from_parts` moves to the model's device
_DEVICE = ("latents", "latent_mask", "template_latents")
_PARAMS = [f.name for f in dataclasses.fields(EditParams)]  # = EditRequest's, less image, mask


def _params(req: EditRequest) -> EditParams:
    fields = {k: getattr(req, k) for k in _PARAMS}
    fields["loras"] = [(i, float(s)) for i, s in req.loras]
    return EditParams(**fields)


def _request(p: EditParams) -> EditRequest:
    fields = {k: getattr(p, k) for k in _PARAMS}
    fields["loras"] = tuple((str(i), float(s)) for i, s in p.loras)
    return EditRequest(image=None, mask=b"", **fields)


def _img(img: Image.Image | None) -> torch.Tensor | None:
    return None if img is None else torch.from_numpy(np.asarray(img).copy())


def _pil(t: torch.Tensor, mode: str) -> Image.Image:
    return Image.fromarray(t.numpy(), mode=mode)


def inputs_to_parts(
    uid: str, inputs: DecodedInputs, notes: RequestNotes
) -> tuple[dict[str, torch.Tensor], InputsMeta]:
    """Decoded, validated inputs (pre-processing's CPU half) as CPU tensors and meta."""
    tensors = {"image": _img(inputs.image), "mask": _img(inputs.mask)}
    if inputs.work_image is not inputs.image:
        tensors["work_image"] = _img(inputs.work_image)
        tensors["work_mask"] = _img(inputs.work_mask)
    meta = InputsMeta(
        uid=uid, request=_params(inputs.request), image_mode=inputs.image.mode,
        height=inputs.height, width=inputs.width, notes=notes,
    )  # fmt: skip
    return tensors, meta


def inputs_from_parts(
    tensors: dict[str, torch.Tensor], meta: InputsMeta
) -> tuple[str, DecodedInputs, RequestNotes]:
    """The inverse of `inputs_to_parts`: (uid, inputs, notes)."""
    req = _request(meta.request)
    image, mask = _pil(tensors["image"], meta.image_mode), _pil(tensors["mask"], "L")
    work_image, work_mask = image, mask
    if "work_image" in tensors:
        work_image = _pil(tensors["work_image"], meta.image_mode)
        work_mask = _pil(tensors["work_mask"], "L")
    inputs = DecodedInputs(req, image, mask, work_image, work_mask, meta.height, meta.width)
    return meta.uid, inputs, meta.notes


def to_parts(
    state: RequestState, *, for_post: bool = False, decoded: Image.Image | None = None
) -> tuple[dict[str, torch.Tensor], StateMeta]:
    """Split a state (before or after denoising) into CPU tensors and meta; `decoded`: its
    VAE-decoded image (then post-processing needs no model)."""
    tensors: dict[str, torch.Tensor | None] = {
        "latents": state.latents,
        "timesteps": state.timesteps,
        "sigmas": state.sigmas,
        "latent_mask": state.latent_mask,
        "template_latents": state.template_latents,  # None (dropped below) unless captured
        "image": _img(state.image),
        "mask": _img(state.mask),
    }
    if state.original_image is not None:
        tensors["original_image"] = _img(state.original_image)
        tensors["original_mask"] = _img(state.original_mask)
    if not for_post:
        tensors.update({f"cond.{k}": v for k, v in state.cond.items()})
    if decoded is not None:
        tensors["decoded"] = _img(decoded)
    tensors.update({f"ids.{k}": v for k, v in state.ids.items()})
    cpu = {k: v.detach().to("cpu") for k, v in tensors.items() if v is not None}
    meta = StateMeta(
        uid=state.uid,
        request=_params(state.request),
        guidance_scale=state.guidance_scale,
        num_rows=state.num_rows,
        step_index=state.step_index,
        path=state.path,
        image_mode=state.image.mode,
        notes=state.notes,
        size=state.size,
        decoded_mode=None if decoded is None else decoded.mode,
        cache_key=state.cache_key,
    )
    return cpu, meta


def from_parts(
    tensors: dict[str, torch.Tensor], meta: StateMeta, device: torch.device
) -> RequestState:
    """Rebuild a state; denoising tensors go to `device`, tables and images stay on the CPU."""
    dev = {k: v.to(device) for k, v in tensors.items() if k in _DEVICE}
    state = RequestState(
        uid=meta.uid,
        request=_request(meta.request),
        latents=dev["latents"],
        cond={
            k.removeprefix("cond."): v.to(device)
            for k, v in tensors.items()
            if k.startswith("cond.")
        },  # fmt: skip
        timesteps=tensors["timesteps"],
        sigmas=tensors["sigmas"],
        guidance_scale=meta.guidance_scale,
        num_rows=meta.num_rows,
        image=_pil(tensors["image"], meta.image_mode),
        mask=_pil(tensors["mask"], "L"),
        latent_mask=dev["latent_mask"],
        step_index=meta.step_index,
        notes=meta.notes,
        size=meta.size,
        ids={
            k.removeprefix("ids."): v.to(device) for k, v in tensors.items() if k.startswith("ids.")
        },
        path=meta.path,
        cache_key=meta.cache_key,
        template_latents=dev.get("template_latents"),
    )
    if state.request.loras:  # text LoRAs were applied where it was encoded; backbone ones load here
        state.lora = LoraUse(state.request.loras)
    if "original_image" in tensors:
        state.original_image = _pil(tensors["original_image"], meta.image_mode)
        state.original_mask = _pil(tensors["original_mask"], "L")
    return state


def decoded_image(tensors: dict[str, torch.Tensor], meta: StateMeta) -> Image.Image | None:
    """The VAE-decoded image a finished state carries (`to_parts(decoded=...)`), else None."""
    if "decoded" not in tensors or meta.decoded_mode is None:
        return None
    return _pil(tensors["decoded"], meta.decoded_mode)
