"""Every message that crosses a process boundary: typed, frozen dataclasses, each registered for
the wire at import (instgenie/wire.py: msgpack frames, strict decoding; never pickle), and the
vocabularies they carry (StrEnums: equal to, and written to JSON and SQLite as, their value).
Owners: client (API server, tests, load tester), sup (worker supervisor), pre/loop/post (processes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum

from instgenie.scheduler.fits import LinearFit
from instgenie.scheduler.spec import BlockSpec, CostSpec
from instgenie.wire import ClientToWorker, Internal, Nested, WorkerToClient, register


# ---- vocabularies (StrEnum: equal to, and JSON/SQLite-written as, their string value) ---------
class Path(StrEnum):  # how an edit's denoising ran (EditPipeline.select_path)
    MASKED = "masked"  # computes its masked tokens, reads the rest from its template's cache
    FULL = "full"  # computes every token


class CacheOutcome(StrEnum):  # an edit of a template: could it read the template's cache
    HIT = "hit"  # read it (path masked)
    MISS = "miss"  # not usable (not ready, mismatched, evicted): path full, with a reason


class Tier(StrEnum):  # where a template's cache was read from
    GPU = "gpu"  # the loop's device store on a CUDA device
    CPU = "cpu"  # the loop's device store on the CPU
    DRAM = "dram"  # the host store's shared memory
    DISK = "disk"  # the host store's disk entries

    @classmethod
    def named(cls, name: str) -> Tier | None:
        """The tier a store names (cache.store.tier_of), None for a name outside these."""
        return cls._value2member_map_.get(name)  # type: ignore[return-value]


class Stage(StrEnum):  # what happens to a request on its worker, in order
    PREPROCESS = "preprocess"  # image decode and validation (sup: sent to pre)
    ENCODE = "encode"  # prompt + VAE encode in the loop (model_stages="loop")
    DENOISE = "denoise"  # in the denoise batch (the API's job stage; steps report Progress.step)
    DECODE = "decode"  # VAE decode in the loop (model_stages="loop")
    POSTPROCESS = "postprocess"  # resize back, paste back, image encode (sup: sent to post)


# ---- nested structs ----------------------------------------------------------------------------
@dataclass(slots=True, frozen=True, kw_only=True)
class TensorRef(Nested):  # one tensor in a TensorBundle's segment (tensorshm.pack)
    name: str  # key in the packed dict
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: list[int]  # elements per dim; [] for a scalar
    offset: int  # bytes from the segment start; a multiple of 64
    nbytes: int  # bytes, = prod(shape) * itemsize


@dataclass(slots=True, frozen=True, kw_only=True)
class TensorBundle(Nested):  # tensors in one POSIX shm segment; the receiver owns (tensorshm)
    segment: str  # shm name without "/": "<prefix>_<16 hex>"
    size: int  # segment length, bytes (>= 1, >= offset + nbytes of every tensor)
    tensors: list[TensorRef]  # in pack order; byte ranges never overlap


@dataclass(slots=True, frozen=True, kw_only=True)
class StepEntry(Nested):  # one iteration of the denoise loop (loop)
    step: int  # loop iteration counter since the loop started
    t_start: float  # unix seconds, worker clock
    duration_ms: float  # wall time of the iteration, ms
    members: list[tuple[str, int]]  # (uid, that request's step index) per batch member
    joined: list[str]  # uids admitted before this step
    waited_ms: list[float]  # per joined uid: received by the loop -> admitted, ms
    left: list[str]  # uids retired after this step
    #: cached activations copied in for this step (pipelined loads, step windows), bytes
    bytes_loaded: int
    compute_all_blocks: int  # blocks run on all tokens (no cache load), count
    policy: str  # batching policy name, e.g. "continuous"
    #: how its backbone ran (engine.graphs): "replay" | "capture" | "warmup" | "eager"; the
    #: costliest of them when a step made several calls (requests of several sizes)
    graph: str
    #: cache-reading members by the tier that serves them: "gpu" | "cpu" | "dram" | "disk"
    tiers: dict[str, int] = field(default_factory=dict)
    #: members that ran this step without their LoRAs (still loading, within the async bound)
    lora_without: list[str] = field(default_factory=list)
    #: requests held out of this step until their LoRAs are loaded (bound reached)
    lora_held: list[str] = field(default_factory=list)


@dataclass(slots=True, frozen=True, kw_only=True)
class RequestNotes(Nested):  # what a request's stages learn about it (RequestState.notes)
    #: a capture run: the registered template it builds (client id) and the cache key it records
    template_id: str | None = None
    capture_key: str | None = None
    capture_lost_race: bool = False  # a capture run whose key another process captures
    #: a capture run that found no room in the node's cache tiers (every entry in use): why;
    #: the capture records nothing and its build fails, retryable ("" = it had room)
    capture_no_room: str = ""
    #: that no room is for good (the cache is larger than every tier): not retryable
    capture_too_large: bool = False
    cache: CacheOutcome | None = None  # an edit of a template: could it read the cache; else None
    cache_tier: Tier | None = None  # on a hit: where the cache was read from when it joined
    fallback_reason: str | None = None  # a miss: why the edit runs the full path
    encode_ms: float = 0.0  # prompt + VAE encode in the loop, ms (model_stages="loop"; else 0)
    decode_ms: float = 0.0  # VAE decode in the loop, its share of the batch's, ms (else 0)
    lora_steps_without: int = 0  # steps run without its LoRAs (bounded async loading), count
    lora_held_ms: float = 0.0  # time held out of the batch waiting for its LoRAs, ms


@dataclass(slots=True, frozen=True, kw_only=True)
class EditParams(Nested):  # an engine EditRequest without its image and mask (worker.state_wire)
    uid: str  # the request's uid (a capture run: "capture:<key prefix>")
    prompt: str
    seed: int
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    strength: float = 1.0
    height: int | None = None  # pixels
    width: int | None = None  # pixels
    paste_back: bool = True
    output_format: str = "png"
    template_id: str | None = None  # the pipeline's template key (not the client's id)
    loras: list[tuple[str, float]] = field(default_factory=list)  # (LoRA id, scale), in order


@dataclass(slots=True, frozen=True, kw_only=True)
class InputsMeta(Nested):  # decoded inputs, model work not done (pre -> loop, model_stages="loop")
    uid: str  # SubmitEdit.uid, or the capture run's uid
    request: EditParams
    image_mode: str  # PIL mode of the image tensors ("RGB"); masks are "L"
    height: int  # working size, pixels
    width: int
    notes: RequestNotes


@dataclass(slots=True, frozen=True, kw_only=True)
class StateMeta(Nested):  # the non-tensor part of a RequestState (worker.state_wire.to_parts)
    uid: str  # SubmitEdit.uid, or the capture run's uid
    request: EditParams
    guidance_scale: float  # as resolved (the family's default when the request gave none)
    num_rows: int  # 2 with classifier-free guidance, else 1
    step_index: int  # steps done
    path: Path
    image_mode: str  # PIL mode of the image tensors ("RGB"); masks are "L"
    notes: RequestNotes
    size: tuple[int, int] | None = None  # RequestState.size: (height, width), pixels
    decoded_mode: str | None = None  # PIL mode of the "decoded" tensor, when the loop decoded
    cache_key: str | None = None  # RequestState.cache_key: the template cache it read (masked)


# ---- client -> worker (client fills every field; types are checked here, values by pre) -------
@dataclass(slots=True, frozen=True, kw_only=True)
class SubmitEdit(ClientToWorker):  # one edit request
    uid: str  # request id, unique per client; every reply carries it
    image: bytes | None  # encoded image (PNG/JPEG/WebP); None: template_id's image
    mask: bytes  # encoded mask image, white = edit
    prompt: str  # what to draw in the masked region
    negative_prompt: str | None = None  # None: model default
    seed: int  # RNG seed of the initial noise
    num_inference_steps: int | None = None  # denoise steps; None: model default
    guidance_scale: float | None = None  # CFG scale; None: model default
    strength: float = 1.0  # fraction of the noise schedule to run, (0, 1]
    height: int | None = None  # output height, pixels; None: from the image
    width: int | None = None  # output width, pixels; None: from the image
    paste_back: bool = True  # copy unmasked input pixels into the output
    output_format: str = "png"  # "png" | "jpeg" | "webp"
    template_id: str | None = None  # RegisterTemplate id whose activation cache may be used
    submitted_at: float = 0.0  # unix seconds, client clock
    loras: list[tuple[str, float]] = field(default_factory=list)  # (LoRA id (64 hex), scale)


@dataclass(slots=True, frozen=True, kw_only=True)
class RegisterTemplate(ClientToWorker):  # build and keep a template's activation cache
    template_id: str  # 64 lowercase hex (hash of the image bytes)
    image: bytes  # encoded template image
    prompt: str  # the template's own prompt/caption
    negative_prompt: str | None = None  # None: model default
    seed: int  # template seed: replaying prompt + seed reproduces full computation exactly
    num_inference_steps: int | None = None  # denoise steps (part of the cache key)
    guidance_scale: float | None = None  # CFG scale (part of the cache key)
    strength: float = 1.0  # fraction of the noise schedule, (0, 1]
    mask: bytes | None = None  # encoded mask; None: whole image
    #: (LoRA id (64 hex), scale) the capture runs with, in order (part of the cache key); edits
    #: naming the same LoRAs read activations made with them; [] = a cache made without adapters
    loras: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True, frozen=True, kw_only=True)
class Cancel(ClientToWorker):  # drop a request: leaves the batch next step, EditFailed(cancelled)
    uid: str  # SubmitEdit.uid


@dataclass(slots=True, frozen=True, kw_only=True)
class DropTemplate(ClientToWorker):  # forget a template and delete its cache in every tier
    template_id: str  # RegisterTemplate.template_id; unknown ids are ignored (idempotent)


@dataclass(slots=True, frozen=True, kw_only=True)
class Shutdown(ClientToWorker):  # stop the worker; new requests are refused at once
    drain: bool = True  # finish in-flight requests first


@dataclass(slots=True, frozen=True, kw_only=True)
class GetStats(ClientToWorker):
    """Ask for a Stats reply."""

    cost: bool = False  # include the loop's CostSpec (Stats.cost)


@dataclass(slots=True, frozen=True, kw_only=True)
class GetStepLog(ClientToWorker):  # ask for a StepLog reply
    since_step: int = 0  # entries with step >= since_step


# ---- worker -> client (sup sends; the producer is named per class) ------------------------------
@dataclass(slots=True, frozen=True, kw_only=True)
class Accepted(WorkerToClient):  # queued (sup)
    uid: str  # SubmitEdit.uid
    queue_position: int  # requests ahead of it in the worker queue, count


@dataclass(slots=True, frozen=True, kw_only=True)
class Progress(WorkerToClient):  # a denoise step finished (loop), or the request changed stage
    uid: str  # SubmitEdit.uid
    step: int  # steps done, 1..num_steps; 0 in a stage report
    num_steps: int  # denoise steps the request will run; 0 in a stage report before it is known
    #: the stage it entered: PREPROCESS (sup), ENCODE, DECODE (loop), POSTPROCESS (sup);
    #: None = a denoise step report
    stage: Stage | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class EditDone(WorkerToClient):  # the result (post); times: worker wall clock, ms
    uid: str  # SubmitEdit.uid
    data: bytes  # encoded output image
    output_format: str  # format of data
    width: int  # pixels
    height: int  # pixels
    mask_ratio: float  # fraction of latent tokens masked, [0, 1]
    num_steps: int  # denoise steps run
    path: Path  # MASKED (template cache used) | FULL
    cache: CacheOutcome | None = None  # HIT (template cache read) | MISS | None (no template)
    cache_tier: Tier | None = None  # on a hit, where the cache was read from when the edit
    # joined: GPU | CPU (the loop's device store) | DRAM | DISK (host store); None otherwise
    fallback_reason: str | None = None  # an edit of a template on the full path: why (loop's
    # path selection, EditPipeline.select_path); None otherwise
    queue_ms: float = 0.0  # waiting: total_ms minus the three stage times below
    preprocess_ms: float = 0.0  # pre-process wall time (decode, validate, prompt + VAE encode)
    denoise_ms: float = 0.0  # joined the batch -> left it
    postprocess_ms: float = 0.0  # post-process wall time (VAE decode, paste, encode)
    # (with model_stages="loop" the encode/decode parts ran in the loop, between steps)
    total_ms: float = 0.0  # accepted -> done


@dataclass(slots=True, frozen=True, kw_only=True)
class EditFailed(WorkerToClient):  # terminal for uid (sup, pre, loop or post)
    uid: str  # SubmitEdit.uid
    code: str  # "invalid_request" | "cancelled" | "worker_died" | "internal_error" | ...
    message: str  # precise, human-readable; never a traceback
    retryable: bool  # the same request may succeed if sent again (e.g. worker_died)


@dataclass(slots=True, frozen=True, kw_only=True)
class TemplateReady(WorkerToClient):  # outcome of RegisterTemplate (sup)
    template_id: str  # RegisterTemplate.template_id
    ok: bool  # the cache is built and resident
    message: str = ""  # why not ok; empty when ok
    build_ms: float = 0.0  # registered -> cache ready (or failed), worker wall clock, ms (sup)
    #: cache bytes per tier where the entry lives now: "gpu" | "cpu" (the loop's device store),
    #: "dram" | "disk" (host store); empty when not ok (loop)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    #: not ok for a reason that may pass (no room in the node's tiers now): registering the
    #: template again later may succeed; false for content that cannot be captured
    retryable: bool = False


@dataclass(slots=True, frozen=True, kw_only=True)
class Stats(WorkerToClient):  # reply to GetStats (sup)
    counters: dict[str, float]  # counters and gauges; units in the name (*_ms, *_bytes)
    cost: CostSpec | None = None  # when GetStats.cost and the loop has reported it
    #: template id -> {tier: bytes} of every template the worker knows whose cache is resident
    #: now, as of the loop's last report: "gpu" | "cpu" (its loop's device store), "dram" |
    #: "disk" (the node's host tiers, shared by its workers); inclusive (a template in DRAM and
    #: on disk lists both); an evicted or dropped template is absent
    residency: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(slots=True, frozen=True, kw_only=True)
class StepLog(WorkerToClient):  # reply to GetStepLog (sup, from the loop's ring buffer)
    entries: list[StepEntry]  # oldest first


@dataclass(slots=True, frozen=True, kw_only=True)
class WorkerReady(WorkerToClient):  # loaded and accepting requests (sup)
    pid: int  # supervisor pid
    model: str  # model id, e.g. "sd2-inpaint:tiny"
    device: str  # torch device, e.g. "cuda:0"


# ---- inside a worker ---------------------------------------------------------------------------
@dataclass(slots=True, frozen=True, kw_only=True)
class Prepared(Internal):  # pre -> loop; the receiver owns `state` and must release it
    uid: str  # SubmitEdit.uid
    state: TensorBundle  # latents, prompt embeddings, masks, ...
    meta: InputsMeta | StateMeta  # decoded inputs (model_stages="loop") or a prepared state
    preprocess_ms: float  # pre-process wall time, ms
    pid: int  # pre-process pid (whose shm prefix to clean up if it dies)


@dataclass(slots=True, frozen=True, kw_only=True)
class Finished(Internal):  # loop -> post; the receiver owns `latents` and must release it
    uid: str  # SubmitEdit.uid
    latents: TensorBundle  # final latents (and whatever post needs)
    meta: StateMeta  # the finished state (its notes carry the loop's additions)
    denoise_ms: float  # joined the batch -> left it, ms


@dataclass(slots=True, frozen=True, kw_only=True)
class Heartbeat(Internal):  # liveness and progress (pre/loop/post -> sup)
    pid: int  # sender pid
    loop_iterations: int  # monotonic; equal in two beats while in_flight is non-empty = stuck
    in_flight: list[str]  # uids the sender holds
    time: float  # sender's time.monotonic(), s (CLOCK_MONOTONIC is host-wide on Linux)
    #: what the main thread does outside its loop iterations ("encode", "decode"), "" = nothing,
    #: and since when (sender's time.monotonic(), s)
    busy: str = ""
    busy_since: float = 0.0


@dataclass(slots=True, frozen=True, kw_only=True)
class LoopSteps(Internal):  # step log entries since the last LoopSteps (loop -> sup)
    entries: list[StepEntry]  # oldest first
    #: the loop's activation-cache counters (TieredStore.stats: evictions_dram, bytes_disk, ...),
    #: sent at most once a second or after the loop added/deleted an entry, else empty; always
    #: empty without a host cache
    cache: dict[str, float] = field(default_factory=dict)
    #: template id -> {tier: bytes} resident now (Stats.residency), read with the host counters
    #: (at most once a second, or at once after this loop added or deleted an entry); None:
    #: unchanged since the last LoopSteps that carried one
    residency: dict[str, dict[str, int]] | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class ChildReady(Internal):  # a pre/loop/post process loaded its model parts (child -> sup)
    role: str  # "pre" | "loop" | "post"
    index: int  # which one of its role, 0-based
    pid: int  # child pid
    codec: bool  # this process may decode/encode images (False: the loop, except naive)
    cost: CostSpec | None = None  # the loop's: how the router prices its batches


@dataclass(slots=True, frozen=True, kw_only=True)
class BuildTemplate(Internal):  # prepare the capture run of a registered template (sup -> pre)
    template_id: str  # RegisterTemplate.template_id, already sent to the same process


@dataclass(slots=True, frozen=True, kw_only=True)
class Abort(Internal):  # drop a request wherever it is (sup -> pre/loop/post)
    uid: str  # SubmitEdit.uid
    reason: str  # becomes EditFailed.code: "cancelled" | "deadline" | ...


@dataclass(slots=True, frozen=True, kw_only=True)
class StopProcess(Internal):  # exit (sup -> pre/loop/post)
    drain: bool = True  # finish what the process holds first
    reason: str = ""  # for the log


@dataclass(slots=True, frozen=True, kw_only=True)
class Ping(Internal):  # health probe (sup -> any); answered by Pong
    nonce: int  # any int; Pong echoes it
    time: float  # sender's time.monotonic(), s


@dataclass(slots=True, frozen=True, kw_only=True)
class Pong(Internal):  # answer to Ping (any -> sup)
    nonce: int  # Ping.nonce
    time: float  # Ping.time, echoed
    pid: int  # responder pid


for _cls in (LinearFit, BlockSpec, CostSpec):  # nested structs of other modules, users last
    register(_cls, nested=True)
for _cls in [c for c in list(globals().values()) if dataclasses.is_dataclass(c)
             and c.__module__ == __name__]:  # fmt: skip  # nested first
    register(_cls)  # type: ignore[arg-type]
