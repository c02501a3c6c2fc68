"""Every message that crosses a process boundary, and its wire format.

Wire format (one ZMQ frame): the msgpack encoding of the array `[tag, version, fields]` where
`tag` is the class name (str), `version` is SCHEMA_VERSION (int) and `fields` is a map from field
name to value. Nested structs (TensorRef, TensorBundle, StepEntry) are maps of their fields; their
type is known from the enclosing field's annotation, so they carry no tag. bytes travel as msgpack
bin, str as msgpack str (UTF-8), tuples and lists as arrays. Never pickle.

Invariants:
- `decode` raises MessageError, and nothing else, for any input that is not exactly a valid message
  (unknown tag, other version, unknown/missing fields, wrong types, oversized, not msgpack);
  a field with a default may be absent on the wire.
- Types are checked from the dataclass annotations at encode and at decode (not at construction).
  Allowed: int (64-bit), float, bool, str, bytes, None, unions, list[T], tuple[...], dict[str, T],
  registered nested structs, and `Any`, which here means a msgpack-native value (None, bool, int,
  float, str, bytes, list, dict with str keys) nested at most MAX_DEPTH deep.
  An int is accepted where a float is declared (and becomes a float); bool is never an int.
- Change any message -> bump SCHEMA_VERSION: both ends of a worker are always the same build.
Owners: "client" = API server / tests / load tester; "sup" = worker supervisor; "pre", "loop",
"post" = the worker's pre-process, denoise-loop and post-process processes.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from instgenie.errors import InstGenIEError

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20  # default cap on one encoded message (bytes); tensors go via shm
MAX_DEPTH = 32  # nesting limit of `Any` values
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack can carry


class MessageError(InstGenIEError, ValueError):
    """Bytes that are not a valid message, or a message that cannot be encoded."""

    code = "bad_message"


class Message:
    """Root of every top-level message; never instantiated itself."""

    __slots__ = ()


class ClientToWorker(Message):
    """client -> worker supervisor."""

    __slots__ = ()


class WorkerToClient(Message):
    """worker supervisor -> client (also pre/post -> supervisor for per-request outcomes)."""

    __slots__ = ()


class Internal(Message):
    """Between the processes of one worker."""

    __slots__ = ()


class Nested:
    """Root of structs that only travel inside a message field."""

    __slots__ = ()


_DIRECTIONS = (ClientToWorker, WorkerToClient, Internal)
M = TypeVar("M", bound=type)
_Conv = Callable[[Any, str], Any]  # (value, path for errors) -> converted value
MESSAGE_TYPES: dict[str, type[Message]] = {}  # tag -> class, top-level messages
NESTED_TYPES: dict[str, type[Nested]] = {}  # name -> class, structs used inside fields
_SCHEMAS: dict[type, tuple[tuple[str, _Conv, _Conv, bool], ...]] = {}  # (name, enc, dec, required)
_CODECS: dict[type, tuple[_Conv, _Conv]] = {}  # class -> (encode to map, decode from map)


def register(cls: M) -> M:
    """Class decorator (above @dataclass): compile the field checkers and add to the registry."""
    if not dataclasses.is_dataclass(cls) or not issubclass(cls, (Message, Nested)):
        raise TypeError(f"{cls.__name__}: register a dataclass deriving from Message or Nested")
    if issubclass(cls, Message) and len([b for b in _DIRECTIONS if issubclass(cls, b)]) != 1:
        raise TypeError(f"{cls.__name__}: derive from exactly one of {_DIRECTIONS}")
    table: dict[str, Any] = MESSAGE_TYPES if issubclass(cls, Message) else NESTED_TYPES
    if cls.__name__ in table:
        raise TypeError(f"duplicate message tag {cls.__name__}")
    hints = typing.get_type_hints(cls)
    schema = []
    for f in dataclasses.fields(cls):
        enc, dec = _compile(hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        schema.append((f.name, enc, dec, required))
    _SCHEMAS[cls] = tuple(schema)
    table[cls.__name__] = cls
    _CODECS[cls] = (_struct_enc(cls), _struct_dec(cls))
    return cls


# ---- field converters: one (encode, decode) pair per annotation, built once per class ----------
def _fail(path: str, want: str, got: Any) -> MessageError:
    return MessageError(f"{path}: expected {want}, got {type(got).__name__}")


def _int(v: Any, path: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and _INT_MIN <= v <= _INT_MAX:
        return int(v)
    raise _fail(path, "int (64-bit)", v)


def _float(v: Any, path: str) -> float:
    if isinstance(v, (float, int)) and not isinstance(v, bool):
        return float(v)
    raise _fail(path, "float", v)


def _bool(v: Any, path: str) -> bool:
    if v is True or v is False:
        return v
    raise _fail(path, "bool", v)


def _str(v: Any, path: str) -> str:
    if isinstance(v, str):
        return v
    raise _fail(path, "str", v)


def _bytes(v: Any, path: str) -> bytes:
    if isinstance(v, (bytes, bytearray)):
        return v
    raise _fail(path, "bytes", v)


def _none(v: Any, path: str) -> None:
    if v is None:
        return None
    raise _fail(path, "None", v)


def _any(v: Any, path: str, depth: int = 0) -> Any:
    if v is None or isinstance(v, (bool, str, bytes, bytearray, float)):
        return v
    if isinstance(v, int):
        return _int(v, path)
    if depth >= MAX_DEPTH:
        raise MessageError(f"{path}: nested deeper than {MAX_DEPTH}")
    if isinstance(v, (list, tuple)):
        return [_any(x, path, depth + 1) for x in v]
    if isinstance(v, dict):
        return {_str(k, path + ".<key>"): _any(x, f"{path}.{k}", depth + 1) for k, x in v.items()}
    raise _fail(path, "msgpack-native value", v)


_SCALARS: dict[Any, _Conv] = {
    int: _int, float: _float, bool: _bool, str: _str, bytes: _bytes, type(None): _none, Any: _any
}  # fmt: skip


def _compile(tp: Any) -> tuple[_Conv, _Conv]:
    if tp in _SCALARS:
        return _SCALARS[tp], _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        pairs = [_compile(a) for a in args]
        return _union([p[0] for p in pairs], tp), _union([p[1] for p in pairs], tp)
    if origin is list and len(args) == 1:
        enc, dec = _compile(args[0])
        return _seq(enc, list), _seq(dec, list)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        enc, dec = _compile(args[0])
        return _seq(enc, tuple), _seq(dec, tuple)
    if origin is tuple and args and Ellipsis not in args:
        pairs = [_compile(a) for a in args]
        return _fixed([p[0] for p in pairs]), _fixed([p[1] for p in pairs])
    if origin is dict and len(args) == 2 and args[0] is str:
        enc, dec = _compile(args[1])
        return _map(enc), _map(dec)
    if isinstance(tp, type) and issubclass(tp, Nested) and tp in _CODECS:
        return _CODECS[tp]
    raise TypeError(f"unsupported message field type {tp!r}")


def _union(convs: list[_Conv], tp: Any) -> _Conv:
    def conv(v: Any, path: str) -> Any:
        for c in convs:
            try:
                return c(v, path)
            except MessageError:
                continue
        raise _fail(path, str(tp), v)

    return conv


def _seq(item: _Conv, kind: type) -> _Conv:
    def conv(v: Any, path: str) -> Any:
        if not isinstance(v, (list, tuple)):
            raise _fail(path, "array", v)
        return kind(item(x, f"{path}[{i}]") for i, x in enumerate(v))

    return conv


def _fixed(items: list[_Conv]) -> _Conv:
    def conv(v: Any, path: str) -> tuple:
        if not isinstance(v, (list, tuple)) or len(v) != len(items):
            raise _fail(path, f"array of {len(items)}", v)
        return tuple(c(x, f"{path}[{i}]") for i, (c, x) in enumerate(zip(items, v)))

    return conv


def _map(value: _Conv) -> _Conv:
    def conv(v: Any, path: str) -> dict:
        if not isinstance(v, dict):
            raise _fail(path, "map", v)
        return {_str(k, path + ".<key>"): value(x, f"{path}.{k}") for k, x in v.items()}

    return conv


def _struct_enc(cls: type) -> _Conv:
    def conv(v: Any, path: str) -> dict[str, Any]:
        if type(v) is not cls:
            raise _fail(path, cls.__name__, v)
        return {name: enc(getattr(v, name), f"{path}.{name}") for name, enc, _, _ in _SCHEMAS[cls]}

    return conv


def _struct_dec(cls: type) -> _Conv:
    def conv(v: Any, path: str) -> Any:
        if not isinstance(v, dict):
            raise _fail(path, f"map ({cls.__name__})", v)
        kwargs = {}
        for name, _, dec, required in _SCHEMAS[cls]:
            if name in v:
                kwargs[name] = dec(v[name], f"{path}.{name}")
            elif required:
                raise MessageError(f"{path}: missing field {name!r}")
        if len(kwargs) != len(v):
            extra = sorted(str(k) for k in v if k not in kwargs)
            raise MessageError(f"{path}: unknown fields {extra[:5]}")
        return cls(**kwargs)

    return conv


# ---- public codec ------------------------------------------------------------------------------
def encode(msg: Message, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """One frame for `msg`; MessageError if a field has the wrong type or the frame is too big."""
    cls = type(msg)
    if MESSAGE_TYPES.get(cls.__name__) is not cls:
        raise MessageError(f"not a registered message: {cls.__name__}")
    fields = _CODECS[cls][0](msg, cls.__name__)
    try:
        data = msgpack.packb([cls.__name__, SCHEMA_VERSION, fields], use_bin_type=True)
    except Exception as e:  # e.g. a str with lone surrogates
        raise MessageError(f"{cls.__name__}: cannot pack: {e}") from e
    if len(data) > max_bytes:
        raise MessageError(f"{cls.__name__}: {len(data)} bytes > limit {max_bytes}")
    return data


def decode(data: bytes | bytearray | memoryview, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message in `data`; MessageError (only) for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise MessageError(f"{len(data)} bytes > limit {max_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ...
        raise MessageError(f"not msgpack: {type(e).__name__}") from e
    if not isinstance(obj, list) or len(obj) != 3:
        raise MessageError("expected [tag, version, fields]")
    tag, version, fields = obj
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise MessageError(f"unknown message tag {str(tag)[:64]!r}")
    if version != SCHEMA_VERSION or type(version) is not int:
        raise MessageError(f"{tag}: schema version {version!r:.20}, expected {SCHEMA_VERSION}")
    try:
        return _CODECS[cls][1](fields, tag)
    except MessageError:
        raise
    except Exception as e:  # a checker bug must still surface as the one typed error
        raise MessageError(f"{tag}: {type(e).__name__}: {e}") from e
