"""wire: strict decoding of every frame (MessageError and nothing else), fuzzing, size limits,
what encode refuses, and which types may register. Examples of every message: test_messages."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from instgenie import messages as m
from instgenie import wire as w
from instgenie.wire import MessageError, decode, encode
from tests.test_messages import (
    BUNDLE,
    COST,
    DONE,
    EXAMPLES,
    INPUTS_META,
    NOTES,
    REF,
    STATE_META,
    STEP,
    _native,
    _text,
)

# ---- fuzzing: decode raises MessageError and nothing else --------------------------------------
FRAMES = [encode(e) for e in EXAMPLES]


def _decode_ok_or_message_error(data: bytes) -> None:
    try:
        msg = decode(data)
    except MessageError:
        return
    encode(msg)  # whatever decode accepts is a valid message


@settings(max_examples=250, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_ok_or_message_error(data)


@settings(max_examples=250, deadline=None)
@given(st.sampled_from(FRAMES), st.data())
def test_fuzz_mutated_bytes(frame: bytes, data: st.DataObject) -> None:
    buf = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        i = data.draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif buf:
            del buf[i : i + data.draw(st.integers(1, 8))]
    _decode_ok_or_message_error(bytes(buf))


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    """Every location inside an unpacked frame (map keys and list indices)."""
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    )
    return [path] + [p for k, v in items for p in _paths(v, (*path, k))]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FRAMES), st.data())
def test_fuzz_structural_mutations(frame: bytes, data: st.DataObject) -> None:
    """Replace, drop or add one value anywhere in a valid frame's structure."""
    obj = msgpack.unpackb(frame)
    path = data.draw(st.sampled_from(_paths(obj)[1:]))
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    op = data.draw(st.sampled_from(["replace", "drop", "add"]))
    if op == "replace":
        parent[path[-1]] = data.draw(_native)
    elif op == "drop":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[data.draw(_text | st.integers(0, 9))] = data.draw(_native)
    else:
        parent.append(data.draw(_native))
    _decode_ok_or_message_error(msgpack.packb(obj))


# ---- specific errors ---------------------------------------------------------------------------
def _frame(tag: Any, fields: Any, version: Any = w.SCHEMA_VERSION) -> bytes:
    return msgpack.packb([tag, version, fields])


def _deep(n: int) -> Any:
    return 0 if n == 0 else [_deep(n - 1)]


_CANCEL = {"uid": "u"}
_REF = {"name": "x", "dtype": "uint8", "shape": [2], "offset": 0, "nbytes": 2}
_STEP, _BUNDLE = dataclasses.asdict(STEP), dataclasses.asdict(BUNDLE)
_META = {**dataclasses.asdict(STATE_META), "path": "masked", "size": None}
_META["notes"] = {"cache": "hit", "cache_tier": "dram"}
_FIN = {"uid": "u", "meta": _META, "denoise_ms": 1.0, "latents": _BUNDLE}
_PREP = {"uid": "u", "state": _BUNDLE, "meta": _META, "preprocess_ms": 1.0, "pid": 1}
_BAD = {
    "empty": b"",
    "not msgpack": b"\xc1",
    "trailing bytes": _frame("Cancel", _CANCEL) + b"\x00",
    "map at top": msgpack.packb({"tag": "Cancel"}),
    "two items": msgpack.packb(["Cancel", 1]),
    "unknown tag": _frame("Nope", _CANCEL),
    "nested tag at top": _frame("TensorRef", _REF),
    "bytes tag": _frame(b"Cancel", _CANCEL),
    "old version": _frame("Cancel", _CANCEL, 0),
    "bool version": _frame("Cancel", _CANCEL, True),
    "fields not a map": _frame("Cancel", ["u"]),
    "missing field": _frame("Cancel", {}),
    "unknown field": _frame("Cancel", {"uid": "u", "extra": 1}),
    "int key": _frame("Cancel", {1: "u"}),
    "bytes key": _frame("Cancel", {b"uid": "u"}),
    "int for str": _frame("Cancel", {"uid": 5}),
    "bytes for str": _frame("Cancel", {"uid": b"u"}),
    "None for str": _frame("Cancel", {"uid": None}),
    "bool for int": _frame("Accepted", {"uid": "u", "queue_position": True}),
    "float for int": _frame("Accepted", {"uid": "u", "queue_position": 1.0}),
    "int for bool": _frame("Shutdown", {"drain": 1}),
    "str for float": _frame("Ping", {"nonce": 1, "time": "1.0"}),
    "invalid utf-8": b"\x93\xa6Cancel\x01\x81\xa3uid\xa1\xff",
    "ext type": _frame("Cancel", {"uid": msgpack.ExtType(1, b"x")}),
    "timestamp": _frame("Ping", {"nonce": 1, "time": msgpack.Timestamp(1, 0)}),
    "tuple too short": _frame("StepLog", {"entries": [{**_STEP, "members": [["a"]]}]}),
    "nested wrong type": _frame("Finished", {**_FIN, "latents": []}),
    "nested missing field": _frame("Finished", {**_FIN, "latents": {"segment": "s", "size": 1}}),
    "nested bad element": _frame("Finished", {**_FIN, "latents": {**_BUNDLE, "tensors": [{}]}}),
    "list for dict": _frame("Stats", {"counters": [1.0]}),
    "deep value for a struct": _frame("Finished", {**_FIN, "meta": {"d": _deep(40)}}),
    "deep raw nesting": b"\x91" * 5000 + b"\xc0",
    # a prepared request's meta is typed: a malformed one is refused like any other field
    "meta not a map": _frame("Prepared", {**_PREP, "meta": [1, 2]}),
    "meta str for int": _frame("Prepared", {**_PREP, "meta": {**_META, "num_rows": "2"}}),
    "meta bool for int": _frame("Prepared", {**_PREP, "meta": {**_META, "step_index": True}}),
    "meta unknown path": _frame("Prepared", {**_PREP, "meta": {**_META, "path": "partial"}}),
    "meta path as int": _frame("Prepared", {**_PREP, "meta": {**_META, "path": 1}}),
    "meta path as bytes": _frame("Prepared", {**_PREP, "meta": {**_META, "path": b"full"}}),
    "meta path wrong case": _frame("Prepared", {**_PREP, "meta": {**_META, "path": "FULL"}}),
    "meta unknown tier": _frame(
        "Prepared", {**_PREP, "meta": {**_META, "notes": {"cache_tier": "nvme"}}}
    ),
    "meta unknown note": _frame("Prepared", {**_PREP, "meta": {**_META, "notes": {"x": 1}}}),
    "meta size too short": _frame("Prepared", {**_PREP, "meta": {**_META, "size": [64]}}),
    "meta request missing": _frame(
        "Prepared", {**_PREP, "meta": {k: v for k, v in _META.items() if k != "request"}}
    ),
    "meta of neither kind": _frame(
        "Prepared", {**_PREP, "meta": {**_META, "height": 64, "width": 64}}
    ),
    "finished meta as inputs": _frame(
        "Finished", {**_FIN, "meta": dataclasses.asdict(INPUTS_META)}
    ),
    "unknown stage": _frame("Progress", {"uid": "u", "step": 0, "num_steps": 0, "stage": "x"}),
}


@pytest.mark.parametrize("data", list(_BAD.values()), ids=list(_BAD))
def test_decode_rejects(data: bytes) -> None:
    with pytest.raises(MessageError):
        decode(data)


@pytest.mark.parametrize("data", [None, "text", 5, [b"x"]])
def test_decode_rejects_non_bytes(data: Any) -> None:
    with pytest.raises(MessageError):
        decode(data)


def test_size_limits() -> None:
    big = m.EditDone(
        **{
            **dataclasses.asdict(next(e for e in EXAMPLES if isinstance(e, m.EditDone))),
            "data": b"x" * 5000,
        }
    )
    with pytest.raises(MessageError, match="limit"):
        encode(big, max_bytes=4096)
    with pytest.raises(MessageError):
        decode(encode(big), max_bytes=4096)
    assert decode(encode(big), max_bytes=8192) == big


class _Unregistered(m.Cancel):
    __slots__ = ()


@pytest.mark.parametrize(
    "msg",
    [
        m.Cancel(uid=5),  # type: ignore[arg-type]
        m.Accepted(uid="u", queue_position=True),
        m.Accepted(uid="u", queue_position=2**64),
        m.Accepted(uid="u", queue_position=-(2**63) - 1),
        m.Shutdown(drain=0),  # type: ignore[arg-type]
        m.Finished(uid="u", latents="seg", meta=STATE_META, denoise_ms=1.0),  # type: ignore[arg-type]
        m.Prepared(uid="u", state=BUNDLE, meta={"x": object()}, preprocess_ms=1.0, pid=1),  # type: ignore[arg-type]
        m.Prepared(uid="u", state=BUNDLE, meta={1: "int key"}, preprocess_ms=1.0, pid=1),  # type: ignore[arg-type]
        m.Heartbeat(pid=1, loop_iterations=1, in_flight="u1", time=0.0),  # type: ignore[arg-type]
        # an enum field takes a member of its enum, not its value nor another enum's member
        dataclasses.replace(DONE, path="full"),  # type: ignore[arg-type]
        dataclasses.replace(DONE, path=m.Tier.DISK),  # type: ignore[arg-type]
        m.Progress(uid="u", step=0, num_steps=0, stage="encode"),  # type: ignore[arg-type]
        m.Finished(uid="u", latents=BUNDLE, meta=INPUTS_META, denoise_ms=1.0),  # type: ignore[arg-type]
        m.Prepared(
            uid="u",
            state=BUNDLE,
            meta=dataclasses.replace(STATE_META, notes=dataclasses.replace(NOTES, cache="hit")),
            preprocess_ms=1.0,
            pid=1,
        ),  # type: ignore[arg-type]  # fmt: skip
        m.Prepared(
            uid="u",
            state=BUNDLE,
            meta=dataclasses.replace(STATE_META, num_rows=2.0),
            preprocess_ms=1.0,
            pid=1,
        ),  # type: ignore[arg-type]  # fmt: skip
        m.Cancel(uid="\udcff"),  # lone surrogate: not UTF-8 encodable
        _Unregistered(uid="u"),
        "not a message",
    ],
)
def test_encode_rejects(msg: Any) -> None:
    with pytest.raises(MessageError):
        encode(msg)


def test_encode_rejects_self_referencing_value() -> None:
    loop: list = []
    loop.append(loop)
    with pytest.raises(MessageError, match="expected str"):
        encode(m.Heartbeat(pid=1, loop_iterations=1, in_flight=loop, time=0.0))


def test_defaults_may_be_absent_and_conversions() -> None:
    msg = decode(
        _frame("SubmitEdit", {"uid": "u", "image": None, "mask": b"m", "prompt": "p", "seed": 1})
    )
    assert msg == m.SubmitEdit(uid="u", image=None, mask=b"m", prompt="p", seed=1)
    # an int is a valid float and decodes as a float; tuples travel as lists
    back = decode(
        encode(m.SubmitEdit(uid="u", image=None, mask=b"", prompt="", seed=1, guidance_scale=7))
    )
    assert type(back.guidance_scale) is float and back.guidance_scale == 7.0  # type: ignore[attr-defined]
    ref = decode(encode(m.Finished(uid="u", latents=dataclasses.replace(
        BUNDLE, tensors=[dataclasses.replace(REF, shape=(1, 2))]), meta=STATE_META, denoise_ms=1)))  # type: ignore[arg-type]  # fmt: skip
    assert ref.latents.tensors[0].shape == [1, 2]  # type: ignore[attr-defined]


def test_enums_travel_as_their_values() -> None:
    """An enum field is a msgpack str on the wire (what the API and SQLite see) and decodes to
    its enum's member; a prepared request's meta decodes to its typed struct."""
    fields = msgpack.unpackb(encode(m.Finished(uid="u", latents=BUNDLE, meta=STATE_META,
                                               denoise_ms=1.0)))[2]  # fmt: skip
    assert (fields["meta"]["path"], fields["meta"]["notes"]["cache_tier"]) == ("masked", "dram")
    assert type(fields["meta"]["path"]) is str
    back = decode(_frame("Prepared", _PREP))
    assert isinstance(back, m.Prepared) and type(back.meta) is m.StateMeta
    assert type(back.meta.path) is m.Path and back.meta.path is m.Path.MASKED
    assert back.meta.notes == m.RequestNotes(cache=m.CacheOutcome.HIT, cache_tier=m.Tier.DRAM)
    assert type(back.meta.notes.cache_tier) is m.Tier
    inputs = decode(encode(m.Prepared(uid="u", state=BUNDLE, meta=INPUTS_META, preprocess_ms=1.0,
                                      pid=1)))  # fmt: skip
    assert type(inputs.meta) is m.InputsMeta  # type: ignore[attr-defined]
    assert m.Tier.named("disk") is m.Tier.DISK and m.Tier.named("absent") is None


def test_unsupported_annotations_fail_at_registration() -> None:
    @dataclasses.dataclass(slots=True, frozen=True, kw_only=True)
    class BadField(w.Internal):
        values: set[int]

    @dataclasses.dataclass(frozen=True)
    class NotSlotted(w.Internal):
        x: int

    @dataclasses.dataclass(slots=True, frozen=True)
    class TwoDirections(w.Internal, w.ClientToWorker):
        x: int

    for cls in (BadField, NotSlotted, TwoDirections):
        with pytest.raises(TypeError):
            w.register(cls)
        assert cls.__name__ not in w.MESSAGE_TYPES


def test_nested_structs_of_other_modules_register_only_as_frozen_slotted_dataclasses() -> None:
    """scheduler.spec's CostSpec travels nested without subclassing a message root; the same
    checks hold for such structs, and a message root is refused on that path."""
    from instgenie.scheduler.spec import BlockSpec, CostSpec

    assert w.NESTED_TYPES["CostSpec"] is CostSpec and w.NESTED_TYPES["BlockSpec"] is BlockSpec

    @dataclasses.dataclass(frozen=True)
    class NotSlotted:
        x: int

    @dataclasses.dataclass(slots=True)
    class NotFrozen:
        x: int

    class NotADataclass:
        __slots__ = ()

    @dataclasses.dataclass(slots=True, frozen=True)
    class Rooted(w.Nested):
        x: int

    for cls in (NotSlotted, NotFrozen, NotADataclass, Rooted):
        with pytest.raises(TypeError):
            w.register(cls, nested=True)
        assert cls.__name__ not in w.NESTED_TYPES


def test_a_nested_struct_of_another_module_is_checked_at_decode() -> None:
    """A CostSpec whose BlockSpec is malformed on the wire is a MessageError, like any field."""
    fields = msgpack.unpackb(encode(m.Stats(counters={}, cost=COST)))[2]
    fields["cost"]["blocks"][0]["stride"] = "16"
    bad = msgpack.packb(["Stats", w.SCHEMA_VERSION, fields], use_bin_type=True)
    with pytest.raises(MessageError, match="Stats.cost"):
        decode(bad)
    del fields["cost"]["blocks"][0]["stride"]
    with pytest.raises(MessageError, match="Stats.cost"):
        decode(msgpack.packb(["Stats", w.SCHEMA_VERSION, fields], use_bin_type=True))
    fields["cost"]["blocks"][0]["stride"] = 16  # the same frame, well-formed, decodes
    ok = decode(msgpack.packb(["Stats", w.SCHEMA_VERSION, fields], use_bin_type=True))
    assert ok == m.Stats(counters={}, cost=COST)


def test_speed() -> None:
    msg = EXAMPLES[0]
    data = encode(msg)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        encode(msg)
    t1 = time.perf_counter()
    for _ in range(n):
        decode(data)
    t2 = time.perf_counter()
    enc_us, dec_us = (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6
    print(f"SubmitEdit encode {enc_us:.1f} us, decode {dec_us:.1f} us")
    assert enc_us < 200 and dec_us < 200  # ~20 us each on a quiet core; generous for shared CI
