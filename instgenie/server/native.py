"""Native API: templates, edits (sync and async), jobs and their progress as Server-Sent Events.

Bodies are JSON (images as base64) or multipart (images as file parts); the routes read them
themselves (uploads.parse_body, after the body-size middleware) and document both content types
in the OpenAPI schema (openapi_extra). A sync edit whose client disconnects is cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from instgenie.messages import Progress, RegisterTemplate
from instgenie.server.errors import CANCELLED, CLIENT_DISCONNECTED, ApiError, printable
from instgenie.server.jobs import Job, JobState
from instgenie.server.metrics import fastest_tier
from instgenie.server.pool import WorkerSlot
from instgenie.server.runtime import EditSpec, Runtime
from instgenie.server.schemas import (
    ERRORS,
    DeletedResponse,
    EditJSON,
    EditParams,
    EditResponse,
    JobResponse,
    TemplateJSON,
    TemplateList,
    TemplateParams,
    TemplateResponse,
    request_body,
)
from instgenie.server.templates import TemplateRecord, lora_refs, template_id_of
from instgenie.server.uploads import parse_body, url_refused

log = logging.getLogger("instgenie.server")
router = APIRouter(tags=["native"])

CLIENT_CLOSED = 499  # nginx's "client closed request": logged and counted, never received
KEEPALIVE_S = 15.0  # SSE comment line interval while a job makes no progress, seconds

_EDIT_FILES = {
    "image": "image (PNG/JPEG/WebP); or give template_id",
    "mask": "mask, white = edit, black = keep; the image's size",
}
_TEMPLATE_FILES = {
    "image": "template image (PNG/JPEG/WebP)",
    "mask": "optional mask of the region edits will change",
}


def _rt(request: Request) -> Runtime:
    return request.app.state.runtime


# ---- templates ---------------------------------------------------------------------------------
def _template_view(rt: Runtime, rec: TemplateRecord) -> dict:
    """A template as the API shows it. Its texts pass through `printable`: a record stored
    before its text was validated (or with a worker's message quoting it) still renders."""
    workers, tiers = [], {}
    slots, tid = rt.pool.slots, rec.template_id

    def tier(s: WorkerSlot) -> str | None:  # the fastest tier holding it for `s` now
        return s.template_tiers.get(tid, "unknown") if tid in s.templates_ready else None

    by_index = {s.index: s for s in slots}  # slot indices are ids (cluster slots come and go)
    for index, b in sorted(rec.builds.items()):
        slot = by_index.get(index)
        workers.append(
            {
                "worker": index,
                "node": slot.node if slot is not None else None,
                "status": b.state,
                "tier": tier(slot) if slot is not None else None,
                "build_ms": b.build_ms,
                "bytes_by_tier": b.bytes_by_tier,
                "message": printable(b.message) if b.message else None,
            }
        )
        for t, n in b.bytes_by_tier.items():
            tiers[t] = tiers.get(t, 0) + n
    nodes = []
    for node, node_state in rec.node_states(rt.pool).items():
        held = {t: 1 for s in slots if s.node == node and (t := tier(s)) is not None}
        nodes.append({"node": node, "status": node_state,
                      "tier": fastest_tier(held) if held else None})  # fmt: skip
    state = rec.state(rt.pool)
    failed = [printable(b.message) for b in rec.builds.values() if b.state == "failed"]
    m = rec.msg
    return {
        "id": rec.template_id,
        "object": "template",
        "status": state,
        "created": int(rec.created),
        "width": rec.width,
        "height": rec.height,
        "prompt": printable(m.prompt),
        "seed": m.seed,
        "num_inference_steps": m.num_inference_steps,
        "guidance_scale": m.guidance_scale,
        "loras": lora_refs(m),
        "build_ms": max((b.build_ms for b in rec.builds.values()), default=0.0)
        if state == "ready"
        else None,
        "bytes_by_tier": tiers,
        "error": failed[0] if failed else None,
        "nodes": nodes,
        "workers": workers,
    }


@router.post(
    "/v1/templates",
    response_model=TemplateResponse,
    status_code=202,
    responses=ERRORS,
    openapi_extra=request_body(TemplateJSON, TemplateParams, _TEMPLATE_FILES, ["image"]),
    summary="Register a template; its cache builds asynchronously",
)
async def create_template(request: Request) -> JSONResponse:
    rt = _rt(request)
    params, blobs = await parse_body(
        request, rt.cfg, TemplateJSON, TemplateParams, set(_TEMPLATE_FILES)
    )
    if params.image_url is not None:
        raise url_refused("image_url")
    image = blobs.get("image")
    if image is None:
        raise ApiError.invalid("image", "the template image is required")
    rt.check_params(
        params.prompt, params.negative_prompt, params.num_inference_steps, params.guidance_scale
    )
    loras = [(r.id, r.scale) for r in params.loras or ()]
    refs = rt.loras.check(loras)  # 422 form or count, 404 lora_not_found
    info = rt.probe(image, "image")
    mask = blobs.get("mask")
    if mask is not None:
        minfo = rt.probe(mask, "mask")
        if minfo.size != info.size:
            raise ApiError.invalid(
                "mask",
                f"is {minfo.width}x{minfo.height} but the image is "
                f"{info.width}x{info.height}; the mask must have the image's "
                "size",
            )
    steps = (
        params.num_inference_steps if params.num_inference_steps is not None else rt.default_steps()
    )
    work = rt.work_size(info.width, info.height)
    rt.check_cost(work[0] * work[1], steps, params.guidance_scale, params.strength,
                  what="this template's capture run")  # fmt: skip
    msg = RegisterTemplate(
        template_id=template_id_of(image, refs),
        image=image,
        prompt=params.prompt,
        negative_prompt=params.negative_prompt,
        seed=params.seed,
        num_inference_steps=steps,
        guidance_scale=params.guidance_scale,
        strength=params.strength,
        mask=mask,
        loras=refs,
    )
    # its LoRAs checked again under the registration lock: none deleted meanwhile
    rec, created = await rt.templates.register(
        TemplateRecord(msg, info.width, info.height), check=lambda: rt.loras.check(loras)
    )
    return JSONResponse(_template_view(rt, rec), status_code=202 if created else 200)


@router.get("/v1/templates", response_model=TemplateList, summary="List templates")
async def list_templates(request: Request) -> dict:
    rt = _rt(request)
    return {
        "object": "list",
        "data": [_template_view(rt, r) for r in rt.templates.records.values()],
    }


@router.get(
    "/v1/templates/{template_id}",
    response_model=TemplateResponse,
    responses=ERRORS,
    summary="A template's state (building / ready / failed), bytes per tier, build time",
)
async def get_template(request: Request, template_id: str) -> dict:
    rt = _rt(request)
    return _template_view(rt, rt.templates.get(template_id))


@router.delete(
    "/v1/templates/{template_id}",
    response_model=DeletedResponse,
    responses=ERRORS,
    summary="Remove a template and its cache from every worker",
)
async def delete_template(request: Request, template_id: str) -> dict:
    rec = await _rt(request).templates.drop(template_id)
    return {"id": rec.template_id, "object": "template", "deleted": True}


# ---- edits and jobs ----------------------------------------------------------------------------
async def prepare_native_edit(request: Request) -> EditSpec:
    rt = _rt(request)
    params, blobs = await parse_body(request, rt.cfg, EditJSON, EditParams, set(_EDIT_FILES))
    for name in ("image_url", "mask_url"):
        if getattr(params, name) is not None:
            raise url_refused(name)
    mask = blobs.get("mask")
    if mask is None:
        raise ApiError.invalid("mask", "is required (white = edit, black = keep)")
    spec = rt.prepare_edit(
        image=blobs.get("image"),
        mask=mask,
        template_id=params.template_id,
        prompt=params.prompt,
        negative_prompt=params.negative_prompt,
        seed=params.seed,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        strength=params.strength,
        output_format=params.output_format,
        paste_back=params.paste_back,
        retry=params.retry,
        loras=[(r.id, r.scale) for r in params.loras or ()],
    )
    await rt.measure_mask([spec])
    return spec


async def until_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_unless_disconnected(request: Request, coro):
    """The result of `coro`, or None if the client went away first (then `coro` is cancelled,
    which cancels its request on the worker)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping this handler
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel(CLIENT_DISCONNECTED)
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: it finished (or failed) as the client left
    return None


@router.post(
    "/v1/edits",
    response_model=EditResponse,
    responses={**ERRORS, 202: {"model": JobResponse}},
    openapi_extra=request_body(EditJSON, EditParams, _EDIT_FILES, ["mask"]),
    summary="Edit a template (template_id) or an image under a mask",
)
async def create_edit(
    request: Request,
    is_async: bool = Query(False, alias="async", description="return a job id at once"),
) -> Response:
    rt = _rt(request)
    spec = await prepare_native_edit(request)
    if is_async:
        job = rt.jobs.new()
        try:
            ticket = rt.admit(spec)
        except ApiError:
            rt.jobs.forget(job.id)
            raise
        ahead = rt.dispatcher.waiting.index(ticket) if ticket.waiter is not None else 0
        job.push(JobState.QUEUED.value, {"position": ahead})
        if ticket.waiter is not None:  # each move of the server queue: a new "queued" event
            ticket.on_position = lambda ahead: job.push(JobState.QUEUED.value, {"position": ahead})
        job.task = asyncio.create_task(_run_job(rt, job, ticket, spec))
        await rt.jobs.save(job)  # stored (queued) before the answer
        return JSONResponse(job.view(), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})
    ticket = rt.admit(spec)
    result = await run_unless_disconnected(request, rt.execute(ticket, spec))
    if result is None:
        log.info("edit %s: client disconnected; cancelled", ticket.uid)
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(result)


async def _run_job(rt: Runtime, job: Job, ticket, spec: EditSpec) -> None:
    def on_progress(p: Progress) -> None:
        if p.stage is not None:
            job.enter(p.stage)
        else:
            job.progress(p.step, p.num_steps)

    # the end is committed to the state database before it is visible (JobTable.finish)
    try:
        result = await rt.execute(ticket, spec, on_progress)
    except asyncio.CancelledError:  # DELETE /v1/jobs/{id}, or the server stopping (then the
        # job is already failed "interrupted" and this finish is a no-op)
        error = {"code": "cancelled", "message": "cancelled by DELETE /v1/jobs/{id}"}
        await rt.jobs.finish(job, JobState.CANCELLED, error=error)
        return
    except ApiError as exc:
        error = {"code": exc.code, "message": exc.message, "field": exc.field}
        await rt.jobs.finish(job, JobState.FAILED, error=error)
        return
    except Exception as exc:  # a bug: the job fails, the server goes on
        log.exception("job %s failed", job.id)
        error = {"code": "internal_error", "message": f"internal error ({type(exc).__name__})"}
        await rt.jobs.finish(job, JobState.FAILED, error=error)
        return
    await rt.jobs.finish(job, JobState.DONE, result=result)


@router.get(
    "/v1/jobs/{job_id}",
    response_model=JobResponse,
    responses=ERRORS,
    summary="An async edit's status, progress and result",
)
async def get_job(request: Request, job_id: str) -> dict:
    return _rt(request).jobs.get(job_id).view()


@router.delete(
    "/v1/jobs/{job_id}",
    response_model=JobResponse,
    responses=ERRORS,
    summary="Cancel a queued or running job (a finished one is forgotten)",
)
async def cancel_job(request: Request, job_id: str) -> dict:
    rt = _rt(request)
    job = rt.jobs.get(job_id)
    if job.is_finished:
        rt.jobs.forget(job_id)
        return job.view()
    if job.task is not None:
        job.task.cancel(CANCELLED)
        await asyncio.wait({job.task}, timeout=10)
    return job.view()


@router.get(
    "/v1/jobs/{job_id}/events",
    response_class=StreamingResponse,
    responses=ERRORS,
    summary="Progress as Server-Sent Events: queued, running, step k/N, done/failed",
)
async def job_events(request: Request, job_id: str) -> StreamingResponse:
    job = _rt(request).jobs.get(job_id)

    async def stream():
        sent = 0
        while True:
            while sent < len(job.events):
                event, data = job.events[sent]
                sent += 1
                yield f"event: {event}\ndata: {json.dumps(data)}\n\n"
            if job.is_finished:
                return
            before = len(job.events)
            await job.wait_change(KEEPALIVE_S)
            if len(job.events) == before:
                yield ": keep-alive\n\n"

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
