"""Every message that crosses a process boundary, and its wire format (msgpack; never pickle).

Frame = msgpack [tag, version, fields]: tag = class name, version = SCHEMA_VERSION, fields = map of
field name -> value; nested structs are maps of their fields (the annotation gives the type); bytes
are msgpack bin, str msgpack str (UTF-8), tuples and lists arrays. Every dataclass below is
registered at import (tag = class name), and so are the structs of other modules that travel
nested (scheduler.spec's CostSpec, BlockSpec, fits.LinearFit); changing any of them bumps
SCHEMA_VERSION.
Invariant: decode raises MessageError, and nothing else, for any input that is not a valid message
(unknown tag, other version, unknown or missing fields, wrong types, oversized, not msgpack); a
field with a default may be absent. Types are checked at encode and decode (not at construction)
from the resolved annotations: int (64-bit), float, bool, str, bytes, None, unions, list[T],
tuple[A, B], dict[str, T], nested structs and StrEnums (a member of that enum exactly at encode, one
of its values at decode); no `Any`: every field has a type. Built-in types exactly (bool is not an
int), but an int is a valid float (decoded as float).
Owners: client (API server, tests, load tester), sup (worker supervisor), pre/loop/post (processes).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgpack

from instgenie.errors import InstGenIEError
from instgenie.scheduler.fits import LinearFit
from instgenie.scheduler.spec import BlockSpec, CostSpec

SCHEMA_VERSION = 7  # 6: CostSpec of scheduler.spec; 7: typed request state (notes, meta, enums)
MAX_MESSAGE_BYTES = 64 << 20  # default cap on one encoded message, bytes (tensors go via shm)
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack can carry


class MessageError(InstGenIEError, ValueError):  # not a valid message, or cannot be encoded
    code = "bad_message"


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


class Message:  # root of top-level messages (abstract)
    __slots__ = ()


class ClientToWorker(Message):  # client -> worker supervisor
    __slots__ = ()


class WorkerToClient(Message):  # supervisor -> client; also pre/post/loop -> sup for outcomes
    __slots__ = ()


class Internal(Message):  # between the processes of one worker
    __slots__ = ()


class Nested:  # root of structs that only travel inside a message field
    __slots__ = ()


MESSAGE_TYPES: dict[str, type[Message]] = {}  # tag -> class, top-level messages
NESTED_TYPES: dict[str, type] = {}  # name -> class, structs used inside fields
_SCHEMAS: dict[type, list[tuple[str, Any, bool]]] = {}  # class -> [(field, spec, required)]


def _register(cls: type, nested: bool = False) -> None:
    """Compile the field specs of a message dataclass and add it to its registry. `nested`: a
    struct defined elsewhere (not a subclass of these roots) that travels inside fields only;
    it must be a frozen, slotted dataclass too."""
    bases = (ClientToWorker, WorkerToClient, Internal, Nested)  # exactly one, for the direction
    params = getattr(cls, "__dataclass_params__", None)
    frozen = dataclasses.is_dataclass(cls) and params is not None and params.frozen
    roots = sum(issubclass(cls, b) for b in bases)
    if (roots != (0 if nested else 1)) or cls.__dictoffset__ or not frozen:
        want = "no message root" if nested else f"one of {bases}"
        raise TypeError(f"{cls.__name__}: @dataclass(slots=True, frozen=True) of {want}")
    hints = typing.get_type_hints(cls)
    _SCHEMAS[cls] = [
        (f.name, _spec(hints[f.name]), f.default is f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    ]
    registry: dict[str, Any] = MESSAGE_TYPES if issubclass(cls, Message) else NESTED_TYPES
    if cls.__name__ in registry and registry[cls.__name__] is not cls:
        raise TypeError(f"{cls.__name__}: another type is registered under this name")
    registry[cls.__name__] = cls


# Scalars: exact built-in types (bool is not an int, a str subclass is not a str), except that an
# int is a valid float (converted to float); ints must fit msgpack's 64-bit range.
_SCALARS: dict[Any, tuple[type, ...]] = {int: (int,), float: (float, int), bool: (bool,)}
_SCALARS.update({str: (str,), bytes: (bytes, bytearray), type(None): (type(None),)})


def _spec(tp: Any) -> Any:
    """Scalar type, nested struct, StrEnum, or (origin, arg specs, name); TypeError if not
    allowed."""
    if tp in _SCALARS or tp in _SCHEMAS:  # nested structs register before users
        return tp
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        return tp
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    origin = typing.Union if origin is types.UnionType else origin
    shape_ok = {list: len(args) == 1, tuple: Ellipsis not in args, dict: args[:1] == (str,)}
    if args and (origin is typing.Union or shape_ok.get(origin, False)):
        return origin, tuple(_spec(a) for a in args), str(tp)
    raise TypeError(f"unsupported message field type {tp!r}")


def _conv(spec: Any, v: Any, path: str, dec: bool) -> Any:
    """`v` checked against `spec`; nested structs become maps (encode) or dataclasses (dec)."""
    if type(spec) is tuple:
        origin, args, want = spec
        if origin is typing.Union:
            if v is None and type(None) in args:  # the common Optional case, without a retry
                return None
            for arg in args:
                try:
                    return _conv(arg, v, path, dec)
                except MessageError:
                    pass
        elif origin is list and type(v) in (list, tuple):
            return [_conv(args[0], x, path + "[]", dec) for x in v]
        elif origin is tuple and type(v) in (list, tuple) and len(v) == len(args):
            return tuple(_conv(a, x, path + "[]", dec) for a, x in zip(args, v, strict=True))
        elif origin is dict and type(v) is dict:
            item = args[1]
            return {
                _conv(str, k, path, dec): _conv(item, x, path + "{}", dec) for k, x in v.items()
            }
        raise _fail(path, want, v)
    if spec in _SCHEMAS:
        return _struct(spec, v, path, dec)
    if spec not in _SCALARS:  # a StrEnum: its member travels as its value
        if not dec and type(v) is spec:
            return v.value
        if dec and type(v) is str and v in spec._value2member_map_:
            return spec(v)
        raise _fail(path, f"{spec.__name__} ({'|'.join(spec)})", v)
    if type(v) not in _SCALARS[spec] or (spec is int and not _INT_MIN <= v <= _INT_MAX):
        raise _fail(path, spec.__name__, v)
    return float(v) if spec is float else v


def _struct(cls: type, v: Any, path: str, dec: bool) -> Any:
    schema = _SCHEMAS[cls]
    if not dec:
        if type(v) is not cls:
            raise _fail(path, cls.__name__, v)
        return {n: _conv(spec, getattr(v, n), path + "." + n, dec) for n, spec, _ in schema}
    if type(v) is not dict:
        raise _fail(path, f"map ({cls.__name__})", v)
    kwargs = {}
    for name, spec, required in schema:
        if name in v:
            kwargs[name] = _conv(spec, v[name], path + "." + name, dec)
        elif required:
            raise MessageError(f"{path}: missing field {name!r}")
    if len(kwargs) != len(v):
        raise MessageError(f"{path}: unknown fields {sorted(map(str, v.keys() - kwargs))[:5]}")
    return cls(**kwargs)


def _fail(path: str, want: str, got: Any) -> MessageError:
    return MessageError(f"{path}: expected {want}, got {type(got).__name__}")


def encode(msg: Message, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """One frame for `msg`; MessageError if a field has the wrong type or the frame is too big."""
    tag = type(msg).__name__
    if MESSAGE_TYPES.get(tag) is not type(msg):
        raise MessageError(f"not a registered message: {tag}")
    fields = _struct(type(msg), msg, tag, False)
    try:
        data = msgpack.packb([tag, SCHEMA_VERSION, fields], use_bin_type=True)
    except Exception as e:  # e.g. a str with lone surrogates
        raise MessageError(f"{tag}: cannot pack: {e}") from e
    if len(data) > max_bytes:
        raise MessageError(f"{tag}: {len(data)} bytes > limit {max_bytes}")
    return data


def decode(data: bytes | bytearray | memoryview, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message in `data`; MessageError (and nothing else) for anything that is not one."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > max_bytes:
        raise MessageError(f"expected bytes of at most {max_bytes}, got {type(data).__name__}")
    try:
        obj = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
        if type(obj) is not list or len(obj) != 3:
            raise MessageError("expected [tag, version, fields]")
        tag, version, fields = obj
        cls = MESSAGE_TYPES.get(tag) if type(tag) is str else None
        if cls is None:
            raise MessageError(f"unknown message tag {str(tag)[:64]!r}")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise MessageError(f"{tag}: version {str(version)[:20]}, expected {SCHEMA_VERSION}")
        return _struct(cls, fields, tag, True)
    except MessageError:
        raise
    except Exception as e:  # msgpack's ExtraData, FormatError, StackError, UnicodeDecodeError...
        raise MessageError(f"not a message: {type(e).__name__}: {str(e)[:200]}") from e


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


@dataclass(slots=True, frozen=True, kw_only=True)
class RequestNotes(Nested):  # what a request's stages learn about it (RequestState.notes)
    #: a capture run: the registered template it builds (client id) and the cache key it records
    template_id: str | None = None
    capture_key: str | None = None
    capture_lost_race: bool = False  # a capture run whose key another process captures
    cache: CacheOutcome | None = None  # an edit of a template: could it read the cache; else None
    cache_tier: Tier | None = None  # on a hit: where the cache was read from when it joined
    fallback_reason: str | None = None  # a miss: why the edit runs the full path
    encode_ms: float = 0.0  # prompt + VAE encode in the loop, ms (model_stages="loop"; else 0)
    decode_ms: float = 0.0  # VAE decode in the loop, its share of the batch's, ms (else 0)


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


@dataclass(slots=True, frozen=True, kw_only=True)
class Stats(WorkerToClient):  # reply to GetStats (sup)
    counters: dict[str, float]  # counters and gauges; units in the name (*_ms, *_bytes)
    cost: CostSpec | None = None  # when GetStats.cost and the loop has reported it


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
    _register(_cls, nested=True)
for _cls in [c for c in list(globals().values()) if dataclasses.is_dataclass(c)
             and c.__module__ == __name__]:  # fmt: skip  # nested first
    _register(_cls)  # type: ignore[arg-type]
