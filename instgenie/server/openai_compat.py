"""OpenAI-compatible `POST /v1/images/edits` (multipart), as the OpenAI Python client sends it.

Polarity: an OpenAI mask is a PNG whose fully transparent pixels (alpha = 0) mark the region to
edit; without a mask, the image's own transparent pixels do. It is converted here to the native
mask (white = edit) - the only image decoding done in the API process, after the header checks.
The image bytes are hashed to find a registered template (same bytes: the cache is used).
Errors have OpenAI's shape (errors.py); validation errors are 400, as OpenAI answers them.
"""

from __future__ import annotations

import asyncio
import io
import re
import secrets
import time
import typing
import warnings
from typing import Annotated

import numpy as np
import pydantic
from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response
from PIL import Image, ImageOps
from pydantic.fields import FieldInfo

from instgenie.config import LimitsConfig
from instgenie.server.errors import SIBLING_FAILED, ApiError, cancel_code
from instgenie.server.native import CLIENT_CLOSED, run_unless_disconnected
from instgenie.server.runtime import Runtime
from instgenie.server.schemas import OPENAI_ERRORS, ImagesResponse, LoraRefs, Text

router = APIRouter(tags=["openai"])
_LORA_REFS = pydantic.TypeAdapter(LoraRefs)
_SIZE = re.compile(r"^([1-9][0-9]{0,5})x([1-9][0-9]{0,5})$")


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{param}: {message}", param)


def native_mask(data: bytes, field: str, limits: LimitsConfig, is_mask: bool) -> bytes:
    """PNG, white where `data` is fully transparent (alpha = 0), black elsewhere."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=list(limits.allowed_formats)) as img:
                img.load()
                has_alpha = "A" in img.getbands() or "transparency" in img.info
                rgba = ImageOps.exif_transpose(img).convert("RGBA") if has_alpha else None
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as exc:
            raise _invalid(field, f"cannot be decoded: {exc}") from None
    if rgba is None:
        if is_mask:
            raise _invalid(
                "mask",
                "has no alpha channel; a mask is a PNG whose fully transparent "
                "pixels (alpha = 0) mark the region to edit",
            )
        raise _invalid(
            "mask",
            "is required when the image has no transparent pixels (alpha = 0 "
            "marks the region to edit)",
        )
    edit = np.asarray(rgba.getchannel("A")) == 0
    if not edit.any():
        raise _invalid(field, "has no fully transparent pixel (alpha = 0): nothing to edit")
    buf = io.BytesIO()
    Image.fromarray(edit.astype(np.uint8) * 255, "L").save(buf, format="PNG")
    return buf.getvalue()


@router.post(
    "/v1/images/edits",
    response_model=ImagesResponse,
    responses=OPENAI_ERRORS,
    summary="OpenAI-compatible image edit (alpha = 0 in the mask marks the edit region)",
)
async def images_edits(
    request: Request,
    prompt: Annotated[Text, Form(description="what to draw in the transparent region")],
    image: Annotated[
        list[UploadFile] | None, File(description="the image to edit (PNG/JPEG/WebP)")
    ] = None,
    image_list: Annotated[
        list[UploadFile] | None, File(alias="image[]", description="the same, as the array form")
    ] = None,
    mask: Annotated[
        UploadFile | None,
        File(
            description="PNG of the image's size; fully transparent pixels (alpha = 0) mark "
            "where to edit"
        ),
    ] = None,
    model: Annotated[Text | None, Form(description="the served model id (GET /v1/models)")] = None,
    n: Annotated[int, Form(ge=1, le=10, description="images, each with its own seed")] = 1,
    size: Annotated[
        Text | None, Form(description="WxH to generate at, or auto (output: the image's size)")
    ] = None,
    response_format: Annotated[
        Text | None, Form(description="b64_json (url is not served)")
    ] = None,
    output_format: Annotated[Text | None, Form(description="png | jpeg | webp")] = None,
    user: Annotated[Text | None, Form(description="end-user id (ignored)")] = None,
    stream: Annotated[bool | None, Form(description="not supported")] = None,
    seed: Annotated[
        int | None, Form(ge=0, le=(1 << 63) - 1, description="seed of the first image")
    ] = None,
    num_inference_steps: Annotated[
        int | None, Form(json_schema_extra={"minimum": 1}, description="1 to --max-steps")
    ] = None,
    guidance_scale: Annotated[
        float | None,
        Form(json_schema_extra={"minimum": 0}, description="0 to --max-guidance-scale"),
    ] = None,
    negative_prompt: Annotated[Text | None, Form()] = None,
    strength: Annotated[
        float,
        Form(gt=0, le=1, allow_inf_nan=False, description="fraction of the schedule, (0, 1]"),
    ] = 1.0,
    loras: Annotated[
        Text | None,
        Form(description='registered LoRAs as JSON: [{"id": "<64 hex>", "scale": 1.0}, ...]'),
    ] = None,
) -> Response:
    rt: Runtime = request.app.state.runtime
    await refuse_unknown_fields(request)
    files = (image or []) + (image_list or [])
    if len(files) != 1:
        raise _invalid("image", f"exactly one image is required, got {len(files)}")
    if model not in (None, "", rt.model_id):
        raise ApiError(
            404,
            "model_not_found",
            f"The model '{model}' does not exist; this server serves '{rt.model_id}'",
            "model",
        )
    if stream:
        raise _invalid("stream", "streaming responses are not supported")
    if response_format not in (None, "b64_json"):
        raise _invalid("response_format", f"{response_format!r} is not served; use b64_json")
    fmt = (output_format or "png").lower()
    if fmt not in ("png", "jpeg", "webp"):
        raise _invalid("output_format", f"{output_format!r} is not one of png, jpeg, webp")
    out_size = None
    if size not in (None, "", "auto"):
        m = _SIZE.fullmatch(size)
        if m is None:
            raise _invalid("size", f"{size!r} is not WIDTHxHEIGHT or auto")
        out_size = (int(m.group(1)), int(m.group(2)))
        if out_size[0] * out_size[1] > rt.limits.max_image_pixels:
            raise _invalid("size", f"{size} exceeds {rt.limits.max_image_pixels} pixels")
    refs = rt.loras.check(_lora_refs(loras))  # before any decoding
    image_bytes = await files[0].read()
    mask_bytes = await mask.read() if mask is not None else None
    info = rt.probe(image_bytes, "image")
    if mask_bytes is not None:
        minfo = rt.probe(mask_bytes, "mask")
        if minfo.size != info.size:
            raise _invalid(
                "mask",
                f"is {minfo.width}x{minfo.height} but the image is "
                f"{info.width}x{info.height}; they must have the same size",
            )
    src, field = (mask_bytes, "mask") if mask_bytes is not None else (image_bytes, "image")
    native = await asyncio.to_thread(native_mask, src, field, rt.limits, mask_bytes is not None)
    base_seed = seed if seed is not None else secrets.randbelow(1 << 31)
    specs = [
        rt.prepare_edit(
            image=image_bytes,
            mask=native,
            template_id=None,
            prompt=prompt,
            negative_prompt=negative_prompt,
            seed=base_seed + i,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            strength=strength,
            output_format=fmt,
            size=out_size,
            loras=refs,
        )
        for i in range(n)
    ]
    await rt.measure_mask(specs)
    tickets = []
    try:
        for spec in specs:
            tickets.append(rt.admit(spec))
    except ApiError:
        for t in tickets:
            rt.dispatcher.release(t)
        raise
    runs = _all([rt.execute(t, s) for t, s in zip(tickets, specs, strict=True)])
    results = await run_unless_disconnected(request, runs)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    first = results[0]
    return JSONResponse(
        {
            "created": int(time.time()),
            "data": [{"b64_json": r["image"], "revised_prompt": None} for r in results],
            "output_format": first["output_format"],
            "size": f"{first['width']}x{first['height']}",
        }
    )


def _lora_refs(text: str | None) -> list[tuple[str, float]]:
    """The `loras` form field (JSON text of schemas.LoraRef objects) as [(id, scale), ...]."""
    if text in (None, ""):
        return []
    try:
        refs = _LORA_REFS.validate_python(text)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise _invalid("loras", f"{where + ': ' if where else ''}{first['msg']}") from None
    return [(r.id, r.scale) for r in refs or ()]


def _form_names(handler) -> frozenset[str]:
    """The form and file field names a FastAPI handler declares (aliases included)."""
    names = set()
    hints = typing.get_type_hints(handler, include_extras=True)
    for name, hint in hints.items():
        for meta in getattr(hint, "__metadata__", ()):
            if isinstance(meta, FieldInfo):
                names.add(meta.alias or name)
    return frozenset(names)


#: every field POST /v1/images/edits reads; any other is refused, as the native routes refuse
#: theirs (a field the server would silently ignore, e.g. `template_id`, is a client's mistake)
IMAGES_EDITS_FIELDS = _form_names(images_edits)


async def refuse_unknown_fields(request: Request) -> None:
    """400 naming the first form field this route does not read."""
    form = await request.form()  # parsed already, for the declared fields: no second read
    for key in form.keys():
        if key not in IMAGES_EDITS_FIELDS:
            why = "Extra inputs are not permitted"
            if key == "template_id":
                why += (
                    "; this route finds a registered template by the image bytes "
                    "(POST /v1/edits takes template_id)"
                )
            raise _invalid(key, why)


async def _all(coros: list) -> list:
    """Every result; on the first failure the other edits are cancelled (on their workers too)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException as exc:
        # a cancel of this request (client gone) keeps its reason; a failure cancels the rest
        why = cancel_code(exc) if isinstance(exc, asyncio.CancelledError) else SIBLING_FAILED
        for t in tasks:
            t.cancel(why)
        await asyncio.wait(tasks)
        raise
