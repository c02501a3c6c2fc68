"""HTTP errors of the API: one typed exception, two wire shapes.

- native routes: `{"error": {"code", "message", "field"?}}`
- OpenAI routes (`/v1/images/...`): `{"error": {"message", "type", "param", "code"}}`
Invariant: 5xx only for faults of the server or its workers; anything the client can fix is 4xx
with a message naming the field. Retryable answers (429, 503) carry Retry-After (seconds).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from instgenie.errors import LoraError, LoraNotFound, TooManyPixelsError, ValidationError
from instgenie.server.schemas import INVALID_TEXT

if TYPE_CHECKING:  # the worker client imports torch; this module is also used without it
    from instgenie.worker.client import WorkerError

log = logging.getLogger("instgenie.server")

OPENAI_PREFIX = "/v1/images/"


class ApiError(StarletteHTTPException):
    """An HTTP error answer. Subclasses Starlette's HTTPException so that FastAPI re-raises it
    unchanged from inside body parsing (the body-size cap raises it from `receive`)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
        super().__init__(status_code=status, detail=message, headers=headers)
        self.code = code
        self.message = message
        self.field = field

    @classmethod
    def invalid(cls, field: str, reason: str, code: str = "invalid_request") -> ApiError:
        return cls(422, code, f"{field}: {reason}", field)

    @classmethod
    def from_validation(cls, exc: ValidationError) -> ApiError:
        if isinstance(exc, TooManyPixelsError):  # more pixels than the deployment accepts
            return cls(413, exc.code, exc.message, exc.field)
        if isinstance(exc, LoraError):  # its own code; an unknown LoRA is a 404
            return cls(404 if isinstance(exc, LoraNotFound) else 422, exc.code, exc.message,
                       exc.field)  # fmt: skip
        return cls(422, "invalid_request", exc.message, exc.field)


#: worker error code -> (HTTP status, retryable answer with Retry-After)
_WORKER_STATUS = {
    "invalid_request": (422, False),
    "image_too_large": (413, False),
    "overloaded": (429, True),
    "worker_died": (503, True),
    "shutting_down": (503, True),
    "client_closed": (503, True),
    "cancelled": (409, False),
    "template_failed": (422, False),
    # a template cache failed verification mid-edit (quarantined, captured again): retry
    "cache_unreadable": (503, True),
    # a LoRA the worker could not load (deleted since the edit was admitted, or unreadable)
    "lora_not_found": (404, False),
    "lora_invalid_file": (422, False),
    "lora_wrong_base": (422, False),
    "lora_unknown_keys": (422, False),
    "lora_rank_too_large": (422, False),
}


def from_worker(exc: WorkerError, retry_after_s: int) -> ApiError:
    """The HTTP answer for a request the worker failed."""
    status, retryable = _WORKER_STATUS.get(exc.code, (500, False))
    field = None
    if (exc.code == "invalid_request" or exc.code.startswith("lora_")) and ": " in exc.reason:
        field = exc.reason.split(": ", 1)[0]
        if not field.replace("_", "").replace(".", "").isalnum():
            field = None
    message = exc.reason
    if status >= 500 or retryable:
        message = f"{exc.reason} (retryable: {'yes' if exc.retryable else 'no'})"
    return ApiError(status, exc.code, message, field, retry_after_s if retryable else None)


def code_of(error: dict) -> str:
    """The API error code of one pydantic error: `invalid_text` for a text field that is not
    valid Unicode (schemas.check_text), else `invalid_request`."""
    return INVALID_TEXT if error.get("type") == INVALID_TEXT else "invalid_request"


def printable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (a lone surrogate) as a backslash escape: what a
    response may carry of a client's text (a field name, an echoed value, a stored prompt)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _openai_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_for_path(path: str, err: ApiError) -> tuple[int, dict, dict[str, str]]:
    """(status, JSON body, headers) of `err` answering a request to `path`. OpenAI routes answer
    validation errors with 400, as OpenAI does; native routes with 422."""
    status = err.status_code
    message = printable(err.message)
    field = printable(err.field) if err.field is not None else None
    if path.startswith(OPENAI_PREFIX):
        status = 400 if status == 422 else status
        body = {
            "message": message,
            "type": _openai_type(status),
            "param": field,
            "code": err.code,
        }
    else:
        body = {"code": err.code, "message": message}
        if field is not None:
            body["field"] = field
    return status, {"error": body}, dict(err.headers or {})


def error_response(request: Request, err: ApiError) -> JSONResponse:
    status, body, headers = error_for_path(request.url.path, err)
    return JSONResponse(body, status_code=status, headers=headers)


def _loc_field(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header", "form")]
    return ".".join(parts) or "body"


def install_handlers(app: FastAPI) -> None:
    """Every error leaves the app in one of the two shapes above."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if not isinstance(exc, ApiError):
            code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(
                exc.status_code, "bad_request" if exc.status_code < 500 else "internal_error"
            )
            exc = ApiError(exc.status_code, code, str(exc.detail))
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if request.url.path.startswith(OPENAI_PREFIX) and ctype != "multipart/form-data":
            # its fields are form parts: any other body reads as "every field missing". 400, as
            # OpenAI answers every malformed request (its clients raise BadRequestError)
            why = f"content-type {ctype or 'none'!r}; this route takes multipart/form-data"
            return error_response(request, ApiError(400, "unsupported_media_type", why, "body"))
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
        field = _loc_field(tuple(first.get("loc", ())))
        message = f"{field}: {first.get('msg', 'invalid')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
        return error_response(request, ApiError(422, code_of(first), message, field))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        err = ApiError(500, "internal_error", f"internal server error ({type(exc).__name__})")
        return error_response(request, err)


#: why an admitted edit's task was cancelled: the message passed to `Task.cancel`, which
#: reaches the CancelledError raised inside it; the code it is counted under in
#: instgenie_edit_failures_total. A cancel without one of these (server stopping) is "cancelled".
CANCELLED = "cancelled"  # DELETE /v1/jobs/{id}
CLIENT_DISCONNECTED = "client_disconnected"  # a sync edit's client closed the connection
SIBLING_FAILED = "sibling_failed"  # another edit of the same OpenAI request (n > 1) failed
CANCEL_CODES = (CANCELLED, CLIENT_DISCONNECTED, SIBLING_FAILED)


def cancel_code(exc: BaseException) -> str:
    """The failure code of a cancelled edit (one of CANCEL_CODES)."""
    why = exc.args[0] if exc.args else None
    return why if why in CANCEL_CODES else CANCELLED
