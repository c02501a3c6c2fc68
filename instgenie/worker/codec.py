"""RequestState <-> (CPU tensors, JSON-able meta): how a request crosses process boundaries.

Tensors go into a shared-memory bundle (instgenie.tensorshm); the meta dict travels in the
msgpack message. Images travel as uint8 arrays (decoded once, in pre-processing). Only the
loop holds device tensors; `from_parts` moves the denoising tensors to the given device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from PIL import Image

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


def to_parts(
    state: RequestState, *, for_post: bool = False
) -> tuple[dict[str, torch.Tensor], dict]:
    """Split a state (before or after denoising) into CPU tensors and meta."""
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
