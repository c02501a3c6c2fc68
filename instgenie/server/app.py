"""The FastAPI app: routes, error shapes, body caps, the drain gate and request metrics.

Middleware order, outermost first: metrics (sees every answer, 413 and 503 included), drain gate
(while draining, new work - any POST - gets 503 before its body is read), body caps (413).
"""

from __future__ import annotations

import contextlib
import json

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import instgenie
from instgenie.server import loras, native, openai_compat, ops
from instgenie.server.errors import ApiError, error_for_path, install_handlers
from instgenie.server.metrics import Metrics
from instgenie.server.runtime import Runtime
from instgenie.server.ui import mount_ui
from instgenie.server.uploads import BodyLimitMiddleware

DESCRIPTION = """Mask-based image editing with template activation caching.

Native API: `/v1/templates`, `/v1/loras`, `/v1/edits` (sync, or `?async=true` +
`/v1/jobs/{id}` and its Server-Sent Events). OpenAI-compatible: `POST /v1/images/edits`.
Native masks: white = edit; OpenAI masks: alpha = 0 = edit."""


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def create_app(runtime: Runtime) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(
        title="InstGenIE",
        version=getattr(instgenie, "__version__", "0.1.0"),
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    install_handlers(app)
    app.include_router(native.router)
    app.include_router(loras.router)
    app.include_router(openai_compat.router)
    app.include_router(ops.router)
    cfg = runtime.cfg
    if cfg.ui:
        mount_ui(app)
    app.add_middleware(
        BodyLimitMiddleware, max_body_bytes=cfg.max_body_bytes, max_parts=cfg.max_parts
    )
    app.add_middleware(DrainGate, runtime=runtime)
    app.add_middleware(RequestMetrics, metrics=runtime.metrics)
    return app


class DrainGate:
    def __init__(self, app: ASGIApp, runtime: Runtime) -> None:
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self.runtime.draining:
            err = ApiError(
                503,
                "shutting_down",
                "the server is shutting down (draining); send the request to another instance",
                retry_after_s=self.runtime.cfg.retry_after_s,
            )
            status, body, headers = error_for_path(scope["path"], err)
            data = json.dumps(body).encode()
            raw = [
                (b"content-type", b"application/json"),
                (b"connection", b"close"),
                (b"content-length", str(len(data)).encode()),
            ]
            raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
            await send({"type": "http.response.start", "status": status, "headers": raw})
            await send({"type": "http.response.body", "body": data})
            return
        await self.app(scope, receive, send)


class RequestMetrics:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in _METHODS else "OTHER"  # bounded labels
            self.metrics.http.labels(method, path, str(status)).inc()
