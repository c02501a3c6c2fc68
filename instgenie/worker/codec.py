"""RequestState <-> (CPU tensors, JSON-able meta): how a request crosses process boundaries.

Tensors go into a shared-memory bundle (instgenie.tensorshm); the meta dict travels in the
msgpack message. With `model_stages="loop"` a request crosses as decoded inputs (pre -> loop,
`inputs_to_parts`) and its finished state carries the VAE-decoded image (loop -> post,
`to_parts(decoded=...)`). Images travel as uint8 arrays (decoded once, in pre-processing). Only the
loop holds device tensors; `from_parts` moves the denoising tensors to the given device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from PIL import Image

from instgenie.engine.pipeline import DecodedInputs
from instgenie.engine.request import EditRequest, RequestState

#: tensors a finished request needs in post-processing (cond is dropped after the last step)
_POST_SKIP = ("cond.",)
_REQUEST_FIELDS = [
    f.name for f in dataclasses.fields(EditRequest) if f.name not in ("image", "mask")
]


def _img(img: Image.Image | None) -> torch.Tensor | None:
    return None if img is None else torch.from_numpy(np.asarray(img).copy())


def _pil(t: torch.Tensor, mode: str) -> Image.Image:
    return Image.fromarray(t.numpy(), mode=mode)


def inputs_to_parts(
    uid: str, inputs: DecodedInputs, extras: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict]:
    """Decoded, validated inputs (pre-processing's CPU half) as CPU tensors and meta."""
    tensors = {"image": _img(inputs.image), "mask": _img(inputs.mask)}
    if inputs.work_image is not inputs.image:
        tensors["work_image"] = _img(inputs.work_image)
        tensors["work_mask"] = _img(inputs.work_mask)
    meta = {
        "uid": uid, "inputs": True, "image_mode": inputs.image.mode,
        "request": {k: getattr(inputs.request, k) for k in _REQUEST_FIELDS},
        "height": inputs.height, "width": inputs.width, "extras": extras,
    }  # fmt: skip
    return tensors, meta


def inputs_from_parts(
    tensors: dict[str, torch.Tensor], meta: dict
) -> tuple[str, DecodedInputs, dict[str, Any]]:
    """The inverse of `inputs_to_parts`: (uid, inputs, extras)."""
    req = EditRequest(image=None, mask=b"", **meta["request"])
    image, mask = _pil(tensors["image"], meta["image_mode"]), _pil(tensors["mask"], "L")
    work_image, work_mask = image, mask
    if "work_image" in tensors:
        work_image = _pil(tensors["work_image"], meta["image_mode"])
        work_mask = _pil(tensors["work_mask"], "L")
    inputs = DecodedInputs(req, image, mask, work_image, work_mask, meta["height"], meta["width"])
    return meta["uid"], inputs, dict(meta["extras"])


def to_parts(
    state: RequestState, *, for_post: bool = False, decoded: Image.Image | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """Split a state (before or after denoising) into CPU tensors and meta; `decoded`: its
    VAE-decoded image (then post-processing needs no model)."""
    tensors: dict[str, torch.Tensor] = {
        "latents": state.latents,
        "timesteps": state.timesteps,
        "sigmas": state.sigmas,
        "latent_mask": state.latent_mask,
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
    extras: dict[str, Any] = {}
    for k, v in state.extras.items():
        if isinstance(v, torch.Tensor):
            tensors[f"extra.{k}"] = v
        else:
            extras[k] = list(v) if isinstance(v, tuple) else v
    tensors = {k: v.detach().to("cpu") for k, v in tensors.items() if v is not None}
    meta = {
        "uid": state.uid,
        "request": {k: getattr(state.request, k) for k in _REQUEST_FIELDS},
        "guidance_scale": state.guidance_scale,
        "num_rows": state.num_rows,
        "step_index": state.step_index,
        "path": state.path,
        "extras": extras,
        "image_mode": state.image.mode,
    }
    if decoded is not None:
        meta["decoded_mode"] = decoded.mode
    return tensors, meta


def from_parts(tensors: dict[str, torch.Tensor], meta: dict, device: torch.device) -> RequestState:
    """Rebuild a state; denoising tensors go to `device`, tables and images stay on the CPU."""
    req = EditRequest(image=None, mask=b"", **meta["request"])
    dev = {k: v.to(device) for k, v in tensors.items() if k in ("latents", "latent_mask")}
    extras = dict(meta["extras"])
    if "size" in extras:
        extras["size"] = tuple(extras["size"])
    for k, v in tensors.items():
        if k.startswith("extra."):
            extras[k.removeprefix("extra.")] = v.to(device)
    state = RequestState(
        uid=meta["uid"],
        request=req,
        latents=dev["latents"],
        cond={
            k.removeprefix("cond."): v.to(device)
            for k, v in tensors.items()
            if k.startswith("cond.")
        },  # fmt: skip
        timesteps=tensors["timesteps"],
        sigmas=tensors["sigmas"],
        guidance_scale=float(meta["guidance_scale"]),
        num_rows=int(meta["num_rows"]),
        image=_pil(tensors["image"], meta["image_mode"]),
        mask=_pil(tensors["mask"], "L"),
        latent_mask=dev["latent_mask"],
        step_index=int(meta["step_index"]),
        extras=extras,
        path=meta["path"],
    )
    if "original_image" in tensors:
        state.original_image = _pil(tensors["original_image"], meta["image_mode"])
        state.original_mask = _pil(tensors["original_mask"], "L")
    return state


def decoded_image(tensors: dict[str, torch.Tensor], meta: dict) -> Image.Image | None:
    """The VAE-decoded image a finished state carries (`to_parts(decoded=...)`), else None."""
    return _pil(tensors["decoded"], meta["decoded_mode"]) if "decoded" in tensors else None
