"""Operational endpoints: /health (progress of the workers), /ready, /metrics, /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from instgenie.server.runtime import Runtime
from instgenie.server.schemas import HealthResponse, ModelList, ReadyResponse

router = APIRouter(tags=["operations"])


def _rt(request: Request) -> Runtime:
    return request.app.state.runtime


@router.get(
    "/health",
    response_model=HealthResponse,
    responses={503: {"model": HealthResponse}},
    summary="200 while some worker can make progress (status ok, or degraded when a worker "
    "overruns a stage); 503 otherwise",
)
async def health(request: Request) -> JSONResponse:
    rt = _rt(request)
    ok, workers = rt.health.report()
    status = "unhealthy" if not ok else "ok"
    if ok and any(w["status"] == "degraded" for w in workers):
        status = "degraded"
    body = {"status": status, "draining": rt.draining, "cache": rt.health.cache_report(),
            "workers": workers, "nodes": rt.nodes_report()}  # fmt: skip
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get(
    "/ready",
    response_model=ReadyResponse,
    responses={503: {"model": ReadyResponse}},
    summary="200 while the server accepts new requests",
)
async def ready(request: Request) -> JSONResponse:
    rt = _rt(request)
    ok, workers = rt.health.report()
    reason = None
    if rt.draining:
        reason = "draining"
    elif not ok:
        reason = "; ".join(f"worker {w['index']}: {w['reason']}" for w in workers)
    return JSONResponse(
        {"ready": reason is None, "reason": reason}, status_code=200 if reason is None else 503
    )


@router.get("/metrics", response_class=Response, summary="Prometheus metrics (text format)")
async def metrics(request: Request) -> Response:
    return Response(_rt(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=ModelList, summary="The served model (OpenAI shape)")
async def models(request: Request) -> dict:
    rt = _rt(request)
    card = {
        "id": rt.model_id,
        "object": "model",
        "created": int(rt.started),
        "owned_by": "instgenie",
    }
    return {"object": "list", "data": [card]}
