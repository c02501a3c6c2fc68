"""Request bodies and uploaded images, checked before any parsing or decoding.

- BodyLimitMiddleware: 413 when Content-Length exceeds the cap (nothing is read), when the bytes
  received exceed it (chunked bodies without a length), or when a multipart body has more parts
  than allowed (delimiters are counted as bytes arrive, before the parser sees them).
- probe_image: format allow-list, frame count, pixel cap and EXIF-oriented size from the header
  alone; pixels are never decoded here (the workers' pre-processes decode).
- parse_body: a JSON body (images as base64) or a multipart one (images as file parts) into
  the route's pydantic model plus the image bytes; 400/415/422 naming what is wrong.
- base64 fields and URL fields: URLs are never fetched (RELIABILITY #15: no allow-list exists).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

import numpy as np
import pydantic
from PIL import Image
from starlette.datastructures import Headers, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from instgenie.config import LimitsConfig
from instgenie.engine.imageio import decode_mask, mask_ratio, open_header
from instgenie.errors import ValidationError
from instgenie.scheduler.estimate import token_ratios
from instgenie.server.config import ServerConfig
from instgenie.server.errors import ApiError, code_of, error_for_path, printable

_EXIF_ORIENTATION = 0x0112
_SWAPS_AXES = {5, 6, 7, 8}  # EXIF orientations that rotate by 90 degrees


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, max_parts: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_parts = max_parts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limit = self.max_body_bytes
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                err = ApiError(
                    400, "bad_request", f"content-length: {length[:40]!r} is not a number"
                )
                await _respond(scope, send, err)
                return
            if int(length) > limit:
                await _respond(scope, send, _too_large(int(length), limit))
                return
        parts = _PartCounter.for_headers(headers)
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > limit:
                    raise _too_large(None, limit)
                if parts is not None and parts.feed(chunk) > self.max_parts:
                    await self._discard(receive, message, received)
                    raise ApiError(
                        413,
                        "too_many_parts",
                        f"multipart body has more than {self.max_parts} parts",
                    )
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except ApiError as err:  # raised by limited_receive outside any exception handler
            if started:
                raise
            await _respond(scope, send, err)

    async def _discard(self, receive: Receive, message: Message, received: int) -> None:
        """Read and drop the rest of a body that is within the byte cap, so that the client,
        still sending, reads the 413 instead of a connection reset."""
        while message.get("more_body") and received <= self.max_body_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            received += len(message.get("body", b""))


def _too_large(length: int | None, limit: int) -> ApiError:
    got = f" ({length} bytes)" if length is not None else ""
    return ApiError(413, "body_too_large", f"request body{got} exceeds the limit of {limit} bytes")


async def _respond(scope: Scope, send: Send, err: ApiError) -> None:
    status, body, headers = error_for_path(scope.get("path", ""), err)
    data = json.dumps(body).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"connection", b"close"),
    ]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


class _PartCounter:
    """Counts multipart delimiters (`--boundary`) in a byte stream split into arbitrary chunks."""

    def __init__(self, boundary: bytes) -> None:
        self.delimiter = b"--" + boundary
        self.tail = b""  # last len(delimiter) - 1 bytes: a delimiter may straddle two chunks
        self.seen = 0

    @classmethod
    def for_headers(cls, headers: Headers) -> _PartCounter | None:
        ctype = headers.get("content-type", "")
        if not ctype.lower().startswith("multipart/"):
            return None
        for param in ctype.split(";")[1:]:
            key, _, value = param.strip().partition("=")
            if key.lower() == "boundary" and value.strip('"'):
                return cls(value.strip('"').encode("latin-1", "replace"))
        return None

    def feed(self, chunk: bytes) -> int:
        """Parts begun so far (the closing delimiter is not a part)."""
        data = self.tail + chunk
        self.seen += data.count(self.delimiter)
        self.tail = data[-(len(self.delimiter) - 1) :]
        return max(0, self.seen - 1)


async def read_form(request: Request, cfg: ServerConfig):
    """The multipart form, with the part caps; 400 for a malformed body."""
    try:
        return await request.form(
            max_files=cfg.max_parts, max_fields=cfg.max_parts, max_part_size=cfg.max_field_bytes
        )
    except ApiError:
        raise
    except StarletteHTTPException as exc:
        if "exceeded maximum size" in str(exc.detail):  # a text part over max_part_size
            raise ApiError(
                413,
                "body_too_large",
                f"multipart body: a text field is over the {cfg.max_field_bytes}-byte limit "
                "for text fields (--max-field-bytes); send images as file parts",
            ) from None
        raise ApiError(400, "bad_multipart", f"multipart body: {exc.detail}") from None


async def upload_bytes(value: object, field: str) -> bytes:
    """A form value holding an image: a file part (raw bytes) or a text part (base64)."""
    if isinstance(value, UploadFile):
        return await value.read()
    if isinstance(value, str):
        return decode_b64(value, field)
    raise ApiError.invalid(field, "expected a file part or a base64 string")


def decode_b64(value: str, field: str) -> bytes:
    """Standard base64 (a `data:<type>;base64,` prefix is allowed); URLs are refused."""
    text = value.strip()
    if text[:8].lower().startswith(("http://", "https://", "ftp://", "file:")):
        raise url_refused(field)
    if text.startswith("data:"):
        header, _, text = text.partition(",")
        if not header.endswith(";base64"):
            raise ApiError.invalid(field, "a data URL must be base64 (data:<type>;base64,...)")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError.invalid(field, "is not valid base64 (standard alphabet, padded)") from None


async def parse_body(
    request: Request,
    cfg: ServerConfig,
    json_model: type[pydantic.BaseModel],
    params_model: type[pydantic.BaseModel],
    files: set[str],
):
    """(validated params, {file field: bytes}) from a JSON or multipart body."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/json":
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            raise ApiError(400, "bad_json", f"body: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ApiError.invalid("body", "expected a JSON object")
        for key in data:  # a member name is text too (its value: schemas.Text)
            if printable(key) != key:
                raise ApiError.invalid(
                    printable(key), "is not a valid member name: UTF-8 cannot encode it",
                    "invalid_text",
                )  # fmt: skip
        model = validate_model(json_model, data, strict=True)
        blobs = {}
        for name in files:
            value = getattr(model, name, None)
            if value is not None:
                blobs[name] = decode_b64(value, name)
        return model, blobs
    if ctype != "multipart/form-data":  # urlencoded forms cannot carry the image/mask files
        raise ApiError(
            415,
            "unsupported_media_type",
            f"content-type: {ctype or 'none'!r}; send application/json or multipart/form-data",
        )
    form = await read_form(request, cfg)
    text: dict[str, str] = {}
    blobs: dict[str, bytes] = {}
    for key, value in form.multi_items():
        if key in text or key in blobs:
            raise ApiError.invalid(key, "is given more than once")
        if key in files:
            blobs[key] = await upload_bytes(value, key)
        elif isinstance(value, UploadFile):
            raise ApiError.invalid(key, "must be a text field, not a file")
        else:
            text[key] = value
    return validate_model(params_model, text), blobs


def validate_model(model: type[pydantic.BaseModel], data: dict, strict: bool = False):
    """`model` from `data`; 422 naming the first invalid field. JSON is validated strictly (no
    `true` or "2" for an integer); form fields are text, so they are converted."""
    try:
        return model.model_validate(data, strict=strict)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ApiError.invalid(field, f"{first['msg']}{more}", code_of(first)) from None


def url_refused(field: str) -> ApiError:
    return ApiError.invalid(
        field,
        "this server does not fetch URLs (no allow-list is configured); "
        "send the image bytes as a file part or base64",
    )


@dataclass(frozen=True)
class ImageInfo:
    format: str  # Pillow format name, e.g. "PNG"
    width: int  # pixels, as displayed (EXIF orientation applied)
    height: int  # pixels, as displayed
    mode: str  # Pillow mode, e.g. "RGBA"

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height


def probe_image(data: bytes, field: str, limits: LimitsConfig) -> ImageInfo:
    """Validate an encoded image from its header (no pixel decoded: imageio.open_header);
    ValidationError naming `field` otherwise."""
    with open_header(data, field, limits) as img:
        w, h = img.size
        try:
            # PngImageFile.getexif() decodes the whole image when no eXIf chunk precedes the
            # data; a PNG's orientation is only honoured from a header eXIf chunk
            header_exif = img.format != "PNG" or "exif" in img.info
            if header_exif and img.getexif().get(_EXIF_ORIENTATION) in _SWAPS_AXES:
                w, h = h, w
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise ValidationError(field, f"has a corrupt header: {exc}") from None
        return ImageInfo(str(img.format), w, h, img.mode)


def mask_facts(
    mask: bytes,
    image_size: tuple[int, int],
    working_size: tuple[int, int],
    limits: LimitsConfig,
    strides: list[int],
    margin: int = 0,
) -> tuple[float, dict[int, float]]:
    """(fraction of pixels edited, token_ratios at `strides`) of an encoded native mask, at
    the working size (resized nearest-neighbour, as the worker's pre-processing does); the
    token ratios of the mask dilated by the workers' compute `margin`, pixels."""
    img = decode_mask(mask, image_size, limits, "mask")
    if img.size != working_size:
        img = img.resize(working_size, Image.Resampling.NEAREST)
    return mask_ratio(img), token_ratios(np.asarray(img) >= 128, strides, margin)
