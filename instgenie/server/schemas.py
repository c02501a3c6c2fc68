"""Request and response schemas of the REST API (pydantic; only this package uses pydantic).

Bounds that depend on the configuration (steps, guidance, prompt length, pixels) are checked in
code against LimitsConfig (Runtime.check_params), with one message per field whatever the value;
their lower bounds are only documented here (json_schema_extra). The static bounds here keep the
OpenAPI schema honest about types and ranges that never change.

Every free-text field is `Text`: valid Unicode that UTF-8 can encode (no lone surrogate, which a
JSON body can carry as `"\\ud800"`) and no NUL character, else a 422 `invalid_text` naming the
field - checked before anything stores, logs or forwards the text.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from instgenie.config import ExecConfig

INVALID_TEXT = "invalid_text"  # pydantic error type and API error code of a bad text field


def check_text(value: object) -> object:
    """A text field's value, if UTF-8 can encode it and it holds no NUL; PydanticCustomError
    `invalid_text` otherwise. Non-strings pass through (the field's type check refuses them)."""
    if not isinstance(value, str):
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            INVALID_TEXT,
            "is not valid Unicode text: character {position} is a lone surrogate "
            "(U+{code}), which UTF-8 cannot encode",
            {"position": exc.start, "code": f"{ord(value[exc.start]):04X}"},
        ) from None
    if "\x00" in value:
        raise PydanticCustomError(
            INVALID_TEXT,
            "contains a NUL character (U+0000) at position {position}",
            {"position": value.index("\x00")},
        )
    return value


#: free text from a client (see the module docstring)
Text = Annotated[str, BeforeValidator(check_text)]

_Seed = Field(0, ge=0, le=(1 << 63) - 1, description="seed of the initial noise")
_Steps = Field(
    None,
    json_schema_extra={"minimum": 1},
    description="denoise steps, 1 to the server's --max-steps (200 by default); default: the "
    "template's, else the server's default",
)
_Guidance = Field(
    None,
    json_schema_extra={"minimum": 0},
    description="classifier-free guidance scale, 0 to the server's --max-guidance-scale",
)
_Strength = Field(1.0, gt=0, le=1, allow_inf_nan=False, description="fraction of the schedule")
_TemplateId = Field(
    None,
    pattern=r"^[0-9a-f]{64}$",
    description="id of a registered template (sha256 of its image bytes, hex; with its LoRAs "
    "when captured with some)",
)
_Url = Field(None, description="not supported: this server never fetches URLs (422)")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoraRef(_Strict):
    """One LoRA an edit applies: a registered id (POST /v1/loras) and its strength."""

    id: str = Field(pattern=r"^[0-9a-f]{64}$", description="a registered LoRA's id (sha256 hex)")
    scale: float = Field(1.0, ge=-8, le=8, allow_inf_nan=False, description="its strength")


def _json_text(value: object) -> object:
    """A multipart form field holding JSON (e.g. `loras`): its parsed value; other values
    (a JSON body's list) pass through."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise PydanticCustomError("json_invalid", "is not valid JSON") from None
    return value


#: `loras` of an edit: a JSON list of {"id", "scale"}; in a multipart form, that list as text
LoraRefs = Annotated[list[LoraRef] | None, BeforeValidator(_json_text)]
_Loras = Field(
    None,
    description='LoRAs to apply, in order: [{"id": "<64 hex>", "scale": 1.0}, ...] (a JSON '
    "string in a multipart form); at most the server's --lora-max-per-request",
)


class EditParams(_Strict):
    """Non-file fields of POST /v1/edits (multipart form fields, or JSON members)."""

    template_id: Text | None = _TemplateId
    prompt: Text = Field(description="what to draw in the masked region")
    negative_prompt: Text | None = None
    seed: int = _Seed
    num_inference_steps: int | None = _Steps
    guidance_scale: float | None = _Guidance
    strength: float = _Strength
    output_format: Literal["png", "jpeg", "webp"] = "png"
    paste_back: bool = Field(True, description="copy the unmasked input pixels into the output")
    retry: bool = Field(
        True,
        description="if the worker running the edit dies (its process, or its node), run it once "
        "more on another worker: an edit is deterministic under its seed, so the image is the "
        "same; false: fail with worker_died instead",
    )
    loras: LoraRefs = _Loras
    image_url: Text | None = _Url
    mask_url: Text | None = _Url


class EditJSON(EditParams):
    """POST /v1/edits as application/json: images as base64 (or data: URLs)."""

    image: Text | None = Field(None, description="base64 image (PNG/JPEG/WebP); or template_id")
    mask: Text | None = Field(None, description="base64 mask, white = edit, the image's size")


class TemplateParams(_Strict):
    """Non-file fields of POST /v1/templates."""

    prompt: Text = Field(
        "",
        description="the prompt the template's cache is captured under: every edit attends to "
        "rows painted under it, so describe what edits keep (the scene), not what they change",
    )
    negative_prompt: Text | None = None
    seed: int = _Seed
    num_inference_steps: int | None = _Steps
    guidance_scale: float | None = _Guidance
    strength: float = _Strength
    loras: LoraRefs = Field(
        None,
        description='LoRAs the capture runs with, in order: [{"id": "<64 hex>", "scale": 1.0}, '
        "...] (a JSON string in a multipart form); at most the server's --lora-max-per-request. "
        "Edits of the template that name the same LoRAs read activations made with them. The "
        "template's id then hashes the LoRAs too: another template than the image's without",
    )
    image_url: Text | None = _Url


class TemplateJSON(TemplateParams):
    image: Text = Field(description="base64 template image (PNG/JPEG/WebP)")
    mask: Text | None = Field(None, description="base64 mask of the region edits will change")


def multipart_schema(params: type[BaseModel], files: dict[str, str], required: list[str]) -> dict:
    """OpenAPI schema of a multipart body: `params` as text fields plus binary file fields."""
    schema = params.model_json_schema()
    props = dict(schema.get("properties", {}))
    for name, description in files.items():
        props[name] = {"type": "string", "format": "binary", "description": description}
    out = {"type": "object", "properties": props}
    req = sorted(set(schema.get("required", [])) | set(required))
    if req:
        out["required"] = req
    return out


def request_body(
    json_model: type[BaseModel],
    params: type[BaseModel],
    files: dict[str, str],
    required_files: list[str],
) -> dict:
    """`openapi_extra` of a route that reads JSON or multipart itself."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": json_model.model_json_schema()},
                "multipart/form-data": {"schema": multipart_schema(params, files, required_files)},
            },
        }
    }


# ---- responses -----------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    code: str
    message: str
    field: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


class Timings(BaseModel):
    queue_ms: float = Field(description="waiting inside the worker, ms")
    preprocess_ms: float
    denoise_ms: float
    postprocess_ms: float
    total_ms: float = Field(description="accepted by the worker -> done, ms")
    server_queue_ms: float = Field(description="waiting in the server queue, ms")
    server_total_ms: float = Field(description="admitted by the server -> answered, ms")


class EditResponse(BaseModel):
    id: str
    object: Literal["edit"] = "edit"
    created: int = Field(description="unix seconds")
    model: str
    image: str = Field(description="base64 of the output image")
    output_format: str
    width: int
    height: int
    mask_ratio: float = Field(description="fraction of latent tokens edited, [0, 1]")
    num_steps: int
    path: Literal["masked", "full"]
    cache: Literal["hit", "miss"] | None = Field(description="template cache use; null: none")
    cache_tier: str | None = Field(description="fastest tier holding the template on the worker")
    fallback_reason: str | None = Field(
        None, description="an edit of a template on the full path: why (e.g. other step count)"
    )
    template_id: str | None
    seed: int
    worker: int
    node: str = Field(
        "local",
        description="the node (host) of the worker that ran it: "
        '"local" on one host, the Ray node id in cluster mode',
    )
    retried: bool = Field(
        False,
        description="its first worker died and it ran again on "
        "another one (the request's retry field)",
    )
    timings: Timings


class JobProgress(BaseModel):
    step: int
    num_steps: int | None


class JobResponse(BaseModel):
    id: str
    object: Literal["edit.job"] = "edit.job"
    status: Literal["queued", "running", "done", "failed", "cancelled"]
    created: int = Field(description="unix seconds")
    finished: int | None = Field(description="unix seconds; null until finished")
    stage: Literal["preprocess", "encode", "denoise", "decode", "postprocess"] | None = Field(
        None, description="the stage it is in on its worker (null while queued or finished)"
    )
    progress: JobProgress
    result: EditResponse | None
    error: ErrorDetail | None


class TemplateWorker(BaseModel):
    worker: int
    node: str | None = Field(
        description='the node the worker runs on ("local" on one host); null: no longer in the pool'
    )
    status: Literal["building", "ready", "failed"]
    tier: str | None = Field(
        description="fastest tier holding the cache for this worker now (its own gpu/cpu, its "
        "node's dram/disk), from its last stats; null when not resident (evicted, building)"
    )
    build_ms: float
    bytes_by_tier: dict[str, int] = Field(description="where its build put the cache, bytes")
    message: str | None


class TemplateNode(BaseModel):
    node: str
    status: Literal["building", "ready", "failed"] = Field(
        description="ready once every accepting worker of the node that was sent it has it"
    )
    tier: str | None = Field(description="fastest tier holding it on the node now, or null")


class TemplateResponse(BaseModel):
    id: str
    object: Literal["template"] = "template"
    status: Literal["building", "ready", "failed"]
    created: int = Field(description="unix seconds")
    width: int
    height: int
    prompt: str
    seed: int
    num_inference_steps: int | None
    guidance_scale: float | None
    loras: list[LoraRef] = Field(
        default_factory=list, description="the LoRAs its cache was captured with, in order"
    )
    build_ms: float | None = Field(description="slowest worker's build, ms; null until ready")
    bytes_by_tier: dict[str, int] = Field(description="cache bytes per tier, all workers")
    error: str | None
    nodes: list[TemplateNode] = Field(
        description="the nodes it was sent to: built where placement put it, then where edits ran"
    )
    workers: list[TemplateWorker]


class TemplateList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TemplateResponse]


class DeletedResponse(BaseModel):
    id: str
    object: str
    deleted: bool


class LoraResponse(BaseModel):
    id: str = Field(description="sha256 of the file's bytes, hex")
    object: Literal["lora"] = "lora"
    name: str | None = Field(description="the name given at registration (else the file name)")
    bytes: int = Field(description="size of the safetensors file")
    created: int = Field(description="unix seconds")
    rank: int = Field(description="largest rank of its layers")
    layers: int = Field(description="linear layers it adapts")
    components: list[str] = Field(description='what it adapts: "unet", "text_encoder", ...')


class LoraList(BaseModel):
    object: Literal["list"] = "list"
    data: list[LoraResponse]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str
    size: str


class WorkerHealth(BaseModel):
    index: int
    node: str = Field(
        "local",
        description='the node (host) it runs on: "local" on one '
        "host, the Ray node id in cluster mode",
    )
    node_ip: str | None = Field(None, description="that node's address (cluster mode)")
    device: str
    state: str
    healthy: bool
    status: Literal["ok", "degraded", "unhealthy"] = Field(
        "ok",
        description="degraded: its loop has been in one model stage call (busy_stage) for "
        "busy_s > --stage-overrun-s; it still makes progress, routing sends it nothing new "
        "while another worker is ok",
    )
    busy_stage: str | None = None
    busy_s: float = 0.0
    reason: str | None
    pid: int | None
    address: str | None
    in_flight: int
    restarts: int = Field(
        description="restarts of this worker's processes since the server started: its "
        "supervisor (by the server) and its loop, pre and post processes (by the supervisor)"
    )
    batch_size: int
    steps_total: int
    last_stats_age_s: float | None
    cost_model: Literal["profile", "flops"] | None = Field(
        description="how the mask-aware router prices this worker: its fitted latency profile, "
        "FLOPs (no profile), or null (no cost spec yet: routed by load)"
    )
    cache_gpu_budget_bytes: int | None = Field(
        None,
        description="the GPU tier's budget this worker's loop reports, bytes; null until "
        "it reports one",
    )
    execution: ExecConfig | None = Field(
        None,
        description="how this worker's model executes (attention backend, channels_last, CUDA "
        "graphs and their capture, cuDNN benchmark, fused kernels): the flags it was started "
        "with, else their INSTGENIE_* variables, else the defaults (instgenie/config.py "
        "ExecConfig)",
    )


class TierBudget(BaseModel):
    budget_bytes: int | None = Field(
        description="the most bytes of templates' caches the tier holds; null: not used or "
        "not reported"
    )
    source: str = Field(
        description='how the budget was derived: "flag" (given), "auto: ..." (from the '
        "machine: a share of MemAvailable, of the cache root's free disk space; for the GPU "
        "tier, measured by each worker's loop), or why there is none"
    )


class CacheTiers(BaseModel):
    gpu: TierBudget
    dram: TierBudget
    disk: TierBudget


class CacheHealth(BaseModel):
    root: str | None = Field(
        description="the host cache's directory (absolute); null: no host cache, templates "
        "are cached in each worker's device memory"
    )
    root_source: str = Field(
        description='how the root was chosen: "flag", "INSTGENIE_CACHE_ROOT", '
        '"auto: ~/.cache/instgenie/activations", ...'
    )
    tiers: CacheTiers


class NodeHealth(BaseModel):
    node: str = Field(description='Ray node id, or "local" on a single host')
    address: str | None = Field(description="the node's address (cluster mode)")
    alive: bool = Field(description="alive in the cluster as of the last membership poll")
    workers: list[int] = Field(description="indices of the workers on it")


class HealthResponse(BaseModel):
    status: Literal["ok", "degraded", "unhealthy"]
    draining: bool
    cache: CacheHealth | None = Field(
        None,
        description="the activation cache the workers were started with (resolved once "
        'at start: --cache-root and the tiers\' budgets, from the machine where "auto")',
    )
    workers: list[WorkerHealth]
    nodes: list[NodeHealth] = Field(
        default_factory=list,
        description="the nodes (hosts) the workers run on, each with its workers' indices: "
        'one "local" node on a single host; in cluster mode every Ray node with workers',
    )


class ReadyResponse(BaseModel):
    ready: bool
    reason: str | None


ERRORS = {code: {"model": ErrorBody} for code in (400, 404, 409, 413, 415, 422, 429, 503, 504)}
OPENAI_ERRORS = {code: {"model": OpenAIErrorBody} for code in (400, 404, 413, 429, 503, 504)}
