"""messages: an example of every registered type round-trips; generated values of every field
type round-trip; house style of the types. Strict decoding and fuzzing: test_wire."""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from instgenie import messages as m
from instgenie import wire as w
from instgenie.wire import decode, encode

REF = m.TensorRef(name="latents", dtype="bfloat16", shape=[1, 4, 64, 64], offset=0, nbytes=32768)
BUNDLE = m.TensorBundle(segment="igw0-123_0123456789abcdef", size=32768, tensors=[REF])
# fmt: off
STEP = m.StepEntry(
    step=7, t_start=1.7e9, duration_ms=41.5, members=[("a", 3), ("b", 0)], joined=["b"],
    waited_ms=[2.5], left=[], bytes_loaded=1 << 20, compute_all_blocks=2, policy="continuous",
    graph="replay",
)
# At least one example per registered message type, with non-default values where possible.
COST = m.CostSpec(
    model="sdxl-inpaint:tiny", granule=32, text_len=77, cfg=True, default_guidance=7.5,
    default_steps=20, cache_dtype="float32",
    blocks=[m.BlockSpec(block_id=0, kind="unet", channels=32, ff_macs=10240, context_dim=32,
                        mlp=0, stride=16)],
    compute={"unet:32/cached": m.LinearFit(slope=2e-12, intercept=0.5)},
    load={"dram": m.LinearFit(slope=1e-8, intercept=0.01)}, profile="profiles/x.json",
)
PARAMS = m.EditParams(
    uid="u1", prompt="a red hat", seed=-5, negative_prompt="blur", num_inference_steps=20,
    guidance_scale=7.5, strength=0.9, height=512, width=768, paste_back=False,
    output_format="webp", template_id="ab" * 32,
)
NOTES = m.RequestNotes(
    cache=m.CacheOutcome.HIT, cache_tier=m.Tier.DRAM, encode_ms=3.5, decode_ms=4.25
)
STATE_META = m.StateMeta(
    uid="u1", request=PARAMS, guidance_scale=7.5, num_rows=2, step_index=20, path=m.Path.MASKED,
    image_mode="RGB", notes=NOTES, size=(512, 768), decoded_mode="RGB", cache_key="ab" * 32,
)
INPUTS_META = m.InputsMeta(
    uid="capture:0123456789abcdef", request=m.EditParams(uid="capture:0123", prompt="", seed=0),
    image_mode="RGBA", height=64, width=96,
    notes=m.RequestNotes(template_id="ef" * 32, capture_key="01" * 32, capture_lost_race=True),
)
EXAMPLES: list[w.Message] = [
    m.SubmitEdit(
        uid="u1", image=b"\x89PNG...", mask=b"mask", prompt="a red hat", negative_prompt="blur",
        seed=-5, num_inference_steps=20, guidance_scale=7.5, strength=0.9, height=512, width=768,
        paste_back=False, output_format="webp", template_id="ab" * 32, submitted_at=1.7e9,
    ),
    m.SubmitEdit(uid="u2", image=None, mask=b"", prompt="", seed=0, template_id="cd" * 32),
    m.RegisterTemplate(
        template_id="ef" * 32, image=b"img", prompt="a cat", negative_prompt=None, seed=1,
        num_inference_steps=30, guidance_scale=5.0, strength=1.0, mask=b"m",
        loras=[("0a" * 32, 0.75), ("0b" * 32, -1.0)],
    ),
    m.Cancel(uid="u1"),
    m.Shutdown(drain=False),
    m.GetStats(),
    m.GetStats(cost=True),
    m.GetStepLog(since_step=100),
    m.Accepted(uid="u1", queue_position=3),
    m.Progress(uid="u1", step=4, num_steps=20),
    m.Progress(uid="u1", step=0, num_steps=0, stage=m.Stage.ENCODE),
    m.EditDone(
        uid="u1", data=b"\x00" * 100, output_format="png", width=512, height=512, mask_ratio=0.25,
        num_steps=20, path=m.Path.FULL, cache=m.CacheOutcome.MISS, queue_ms=1.0,
        preprocess_ms=2.0,
        fallback_reason="the edit runs 20 denoise steps but the template's cache was captured at 4",
        denoise_ms=300.0, postprocess_ms=4.0, total_ms=310.5,
    ),
    m.EditFailed(uid="u1", code="worker_died", message="worker 0 exited", retryable=True),
    m.TemplateReady(template_id="ef" * 32, ok=False, message="bad image"),
    m.TemplateReady(
        template_id="ef" * 32, ok=True, build_ms=1234.5, bytes_by_tier={"dram": 10, "disk": 10}
    ),
    m.DropTemplate(template_id="ef" * 32),
    m.Stats(counters={"requests_total": 10.0, "garbage_frames": 0.0, "p50_ms": 12.5}),
    m.Stats(counters={}, cost=COST),
    m.StepLog(entries=[STEP, dataclasses.replace(STEP, step=8, members=[])]),
    m.WorkerReady(pid=1234, model="sd2-inpaint:tiny", device="cpu"),
    m.Prepared(uid="u1", state=BUNDLE, preprocess_ms=3.5, pid=99, meta=INPUTS_META),
    m.Prepared(uid="u1", state=BUNDLE, preprocess_ms=3.5, pid=99,
               meta=dataclasses.replace(STATE_META, step_index=0, decoded_mode=None, size=None)),
    m.Finished(uid="u1", latents=BUNDLE, meta=STATE_META, denoise_ms=250.0),
    m.Heartbeat(pid=99, loop_iterations=12345, in_flight=["u1", "u2"], time=123.25),
    m.LoopSteps(entries=[STEP]),
    m.LoopSteps(entries=[], cache={"evictions_dram": 2.0, "bytes_disk": 1e9}),
    m.ChildReady(role="loop", index=0, pid=4321, codec=False),
    m.ChildReady(role="loop", index=1, pid=4322, codec=False, cost=COST),
    m.BuildTemplate(template_id="ef" * 32),
    m.Abort(uid="u1", reason="cancelled"),
    m.StopProcess(drain=False, reason="shutdown"),
    m.Ping(nonce=2**63, time=1.0),
    m.Pong(nonce=-(2**63), time=1.0, pid=1),
]
# fmt: on
DONE = next(e for e in EXAMPLES if isinstance(e, m.EditDone))


def _nested_names(obj: Any) -> set[str]:
    nested = isinstance(obj, w.Nested) or type(obj) in w.NESTED_TYPES.values()
    if isinstance(obj, w.Message) or nested:
        own = {type(obj).__name__} if nested else set()
        return own.union(*(_nested_names(getattr(obj, f.name)) for f in dataclasses.fields(obj)))
    if isinstance(obj, (list, tuple)):
        return set().union(*map(_nested_names, obj))
    if isinstance(obj, dict):
        return set().union(*map(_nested_names, obj.values()))
    return set()


def test_every_registered_type_has_an_example() -> None:
    assert {type(e).__name__ for e in EXAMPLES} == set(w.MESSAGE_TYPES)
    assert set().union(*map(_nested_names, EXAMPLES)) == set(w.NESTED_TYPES)
    assert set(w.MESSAGE_TYPES).isdisjoint(w.NESTED_TYPES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip(msg: w.Message) -> None:
    data = encode(msg)
    back = decode(data)
    assert type(back) is type(msg) and back == msg
    assert encode(back) == data  # canonical: same message, same bytes


@pytest.mark.parametrize("cls", [*w.MESSAGE_TYPES.values(), *w.NESTED_TYPES.values()])
def test_house_style(cls: type) -> None:
    assert dataclasses.is_dataclass(cls) and cls.__dictoffset__ == 0  # slotted
    assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    directions = (w.ClientToWorker, w.WorkerToClient, w.Internal, w.Nested)
    # one direction; or a struct of another module registered to travel nested (scheduler.spec)
    want = 0 if cls.__module__ != m.__name__ and w.NESTED_TYPES.get(cls.__name__) is cls else 1
    assert sum(issubclass(cls, b) for b in directions) == want
    example = next((e for e in EXAMPLES if type(e) is cls), None)
    if example is not None and dataclasses.fields(example):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(example, dataclasses.fields(example)[0].name, None)
        assert not hasattr(example, "__dict__")


# ---- generated messages ------------------------------------------------------------------------
_text = st.text(max_size=12)
_floats = st.floats(allow_nan=False)  # NaN != NaN would fail equality, not the codec
_native = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | _floats
    | _text
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)


def strategy(tp: Any) -> st.SearchStrategy:
    """Valid values of a message field annotation."""
    scalars = {
        int: st.integers(-(2**63), 2**64 - 1), float: _floats, bool: st.booleans(), str: _text,
        bytes: st.binary(max_size=16), type(None): st.none(), Any: _native,
    }  # fmt: skip
    if tp in scalars:
        return scalars[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return st.builds(tp, **{f.name: strategy(hints[f.name]) for f in dataclasses.fields(tp)})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return st.lists(strategy(args[0]), max_size=3)
    if origin is tuple:
        return st.tuples(*map(strategy, args))
    if origin is dict:
        return st.dictionaries(_text, strategy(args[1]), max_size=3)
    return st.one_of(*map(strategy, args))  # a union


@pytest.mark.parametrize("cls", list(w.MESSAGE_TYPES.values()), ids=lambda c: c.__name__)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_round_trip_generated(cls: type, data: st.DataObject) -> None:
    msg = data.draw(strategy(cls))
    assert decode(encode(msg)) == msg
