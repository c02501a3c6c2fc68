"""The wire format of every message that crosses a process boundary (msgpack; never pickle):
the message roots, the registry, and `encode`/`decode`. The messages themselves are in
instgenie/messages.py.

Frame = msgpack [tag, version, fields]: tag = class name, version = SCHEMA_VERSION, fields = map of
field name -> value; nested structs are maps of their fields (the annotation gives the type); bytes
are msgpack bin, str msgpack str (UTF-8), tuples and lists arrays. Every message dataclass is
registered when instgenie.messages is imported (tag = class name), and so are the structs of
other modules that travel nested (scheduler.spec's CostSpec, BlockSpec, fits.LinearFit);
changing any of them bumps SCHEMA_VERSION.
Invariant: decode raises MessageError, and nothing else, for any input that is not a valid message
(unknown tag, other version, unknown or missing fields, wrong types, oversized, not msgpack); a
field with a default may be absent. Types are checked at encode and decode (not at construction)
from the resolved annotations: int (64-bit), float, bool, str, bytes, None, unions, list[T],
tuple[A, B], dict[str, T], nested structs and StrEnums (a member of that enum exactly at encode, one
of its values at decode); no `Any`: every field has a type. Built-in types exactly (bool is not an
int), but an int is a valid float (decoded as float).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import StrEnum
from typing import Any

import msgpack

from instgenie.errors import InstGenIEError

#: the version of the message set (instgenie/messages.py and the structs it registers)
SCHEMA_VERSION = 13  # 6: CostSpec of scheduler.spec; 7: typed request state (notes, meta, enums);
# 8: template residency (Stats.residency, LoopSteps.residency); 9: TemplateReady.retryable,
# RequestNotes.capture_no_room; 10: LoRA lists (SubmitEdit, EditParams, RegisterTemplate.loras;
# StepEntry.lora_*, RequestNotes.lora_*); 11: CostSpec.capture; 12: CostSpec.compute_margin;
# 13: RequestNotes.capture_too_large
MAX_MESSAGE_BYTES = 64 << 20  # default cap on one encoded message, bytes (tensors go via shm)
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack can carry


class MessageError(InstGenIEError, ValueError):  # not a valid message, or cannot be encoded
    code = "bad_message"


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


def register(cls: type, nested: bool = False) -> None:
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
