"""tensorshm: bit-identical tensors across processes, strict bundle checks, no leaked segments."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch

from instgenie import tensorshm as ts
from instgenie.messages import (
    EditParams,
    Finished,
    InputsMeta,
    Path,
    Prepared,
    RequestNotes,
    StateMeta,
    TensorBundle,
    TensorRef,
)
from instgenie.wire import decode, encode

PARAMS = EditParams(uid="u", prompt="p", seed=0)
STATE_META = StateMeta(uid="u", request=PARAMS, guidance_scale=1.0, num_rows=1, step_index=2,
                       path=Path.FULL, image_mode="RGB", notes=RequestNotes())  # fmt: skip
PREFIX = f"igtest{os.getpid()}"  # unique per test run; the fixture checks nothing is left


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    yield
    leftovers = ts.segments(PREFIX)
    ts.cleanup(PREFIX)
    assert leftovers == [], f"leaked shm segments: {leftovers}"


def make_tensors(seed: int) -> dict[str, torch.Tensor]:
    """One tensor per supported dtype plus awkward layouts; deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    f32 = torch.randn(4, 5, generator=g)
    f32[0, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
    ints = torch.randint(-(2**31), 2**31 - 1, (3, 7), generator=g)
    out = {name: f32.to(dtype) for name, dtype in ts.DTYPES.items() if dtype.is_floating_point}
    out |= {
        name: (ints % 2**31).to(dtype) for name, dtype in ts.DTYPES.items() if name[:4] == "uint"
    }
    out |= {name: ints.to(dtype) for name, dtype in ts.DTYPES.items() if name[:3] == "int"}
    out |= {
        "complex64": torch.complex(f32, -f32),
        "complex128": torch.complex(f32.double(), f32.double()),
        "bool": torch.rand(6, generator=g) > 0.5,
        "int64_extremes": torch.tensor([-(2**63), 2**63 - 1, 0]),
        "transposed_bf16": torch.randn(8, 3, generator=g).to(torch.bfloat16).t(),
        "strided_slice": torch.arange(40, dtype=torch.int16)[::3],
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0
        "channels_last": torch.randn(1, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "scalar": torch.tensor(3.5, dtype=torch.float16),
        "empty": torch.empty(0, 3, dtype=torch.bfloat16),
        "image_u8": torch.randint(0, 256, (2, 16, 16, 3), generator=g, dtype=torch.uint8),
    }
    return out


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        assert g.is_contiguous(), name
        raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(raw(g), raw(w)), name


# ---- in one process ----------------------------------------------------------------------------
def test_pack_unpack_all_dtypes_and_layouts() -> None:
    tensors = make_tensors(0)
    bundle = ts.pack(tensors, PREFIX)
    assert bundle.segment.startswith(PREFIX + "_") and ts.segments(PREFIX) == [bundle.segment]
    assert all(ref.offset % ts.ALIGN == 0 for ref in bundle.tensors)
    assert (
        decode(encode(Finished(uid="u", latents=bundle, meta=STATE_META, denoise_ms=0))).latents
        == bundle
    )
    assert_bit_identical(ts.unpack(bundle), tensors)
    assert_bit_identical(ts.unpack(bundle), tensors)  # unpack alone does not consume the segment
    assert ts.release(bundle) is True
    assert ts.release(bundle) is False  # idempotent
    with pytest.raises(ts.BundleError, match="gone"):
        ts.unpack(bundle)


def test_empty_dict_and_unlink_on_unpack() -> None:
    bundle = ts.pack({}, PREFIX)
    assert bundle.size >= 1 and ts.unpack(bundle, unlink=True) == {}
    assert ts.segments(PREFIX) == []


def test_views_share_memory_and_outlive_unlink_and_close() -> None:
    bundle = ts.pack({"x": torch.zeros(1000), "y": torch.ones(3, dtype=torch.int64)}, PREFIX)
    views, handle = ts.unpack(bundle, copy=False, unlink=True)
    assert ts.segments(PREFIX) == []  # unlinked, still mapped
    views["x"][7] = 42.0
    handle.close()  # views alive: the mapping stays until the last one is freed
    handle.close()
    assert views["x"][7].item() == 42.0 and views["y"].tolist() == [1, 1, 1]
    del views
    with ts.unpack(ts.pack({"z": torch.ones(2)}, PREFIX), copy=False, unlink=True)[1] as h:
        assert h.segment.startswith(PREFIX)


def test_cuda_like_inputs_requiring_grad_are_detached() -> None:
    t = torch.randn(3, 3, requires_grad=True) * 2
    bundle = ts.pack({"t": t}, PREFIX)
    got = ts.unpack(bundle, unlink=True)["t"]
    assert not got.requires_grad and torch.equal(got, t.detach())


def test_pack_rejects_and_leaves_nothing() -> None:
    with pytest.raises(ValueError):
        ts.pack({"x": torch.ones(1)}, "../etc")
    with pytest.raises(ValueError):
        ts.pack({"x": torch.ones(1)}, "")
    with pytest.raises(TypeError):
        ts.pack({"x": torch.ones(2).to_sparse()}, PREFIX)
    with pytest.raises(TypeError):
        ts.pack({"x": [1, 2]}, PREFIX)  # type: ignore[dict-item]
    # a failure mid-copy (meta tensors have no data) unlinks the half-written segment
    with pytest.raises((NotImplementedError, RuntimeError)):
        ts.pack({"ok": torch.ones(4), "meta": torch.empty(4, device="meta")}, PREFIX)
    assert ts.segments(PREFIX) == []


def _bad_bundles(b: TensorBundle) -> dict[str, TensorBundle]:
    ref = b.tensors[0]
    bad = lambda **kw: dataclasses.replace(b, tensors=[dataclasses.replace(ref, **kw)])  # noqa: E731
    return {
        "dtype": bad(dtype="object"),
        "nbytes": bad(nbytes=ref.nbytes + 1),
        "negative dim": bad(shape=[-4], nbytes=16),
        "beyond size": bad(offset=64, nbytes=16, shape=[4]),
        "misaligned": bad(offset=4),
        "duplicate": dataclasses.replace(b, tensors=[ref, ref]),
        "path name": dataclasses.replace(b, segment="../x_0123456789abcdef"),
        "dram segment": dataclasses.replace(b, segment="igc_ns_" + "ab" * 20),
        "larger than segment": dataclasses.replace(b, size=1 << 20),
        "missing": dataclasses.replace(b, segment=PREFIX + "_0123456789abcdef"),
    }


_DUMMY_REF = TensorRef(name="x", dtype="float32", shape=[4], offset=0, nbytes=16)


@pytest.mark.parametrize(
    "case", list(_bad_bundles(TensorBundle(segment="", size=16, tensors=[_DUMMY_REF])))
)
def test_unpack_rejects_malformed_bundles(case: str) -> None:
    bundle = ts.pack({"x": torch.arange(4, dtype=torch.float32)}, PREFIX)
    try:
        with pytest.raises(ts.BundleError):
            ts.unpack(_bad_bundles(bundle)[case])
    finally:
        ts.release(bundle)


def test_unlink_on_unpack_releases_even_when_unusable() -> None:
    bundle = ts.pack({"x": torch.ones(4)}, PREFIX)
    with pytest.raises(ts.BundleError, match="smaller"):
        ts.unpack(dataclasses.replace(bundle, size=1 << 20), unlink=True)
    assert ts.segments(PREFIX) == []


def test_cleanup_is_scoped_to_its_prefix() -> None:
    mine = ts.pack({"x": torch.ones(1)}, ts.process_prefix(PREFIX, 111))
    other_pid = ts.pack({"x": torch.ones(1)}, ts.process_prefix(PREFIX, 222))
    base = ts.pack({"x": torch.ones(1)}, PREFIX)
    other = ts.pack({"x": torch.ones(1)}, PREFIX + "x")
    try:
        assert ts.cleanup(ts.process_prefix(PREFIX, 111)) == 1
        assert ts.segments(PREFIX) == sorted([other_pid.segment, base.segment])
        assert ts.cleanup(PREFIX) == 2  # the base and every process prefix under it
        assert ts.segments(PREFIX + "x") == [other.segment]
        assert not ts.release(mine)
    finally:
        ts.cleanup(PREFIX + "x")
    with pytest.raises(ts.BundleError):
        ts.release("igc_ns_" + "ab" * 20)  # not ours: never unlinked by name


# ---- across processes (spawn) ------------------------------------------------------------------
def _child(conn: mp.connection.Connection, prefix: str, seed: int, stay: bool) -> None:
    """Pack, hand the bundle over as a message (bytes, never pickle), exit or wait to be killed."""
    bundle = ts.pack(make_tensors(seed), ts.process_prefix(prefix))
    meta = InputsMeta(uid=f"u{seed}", request=PARAMS, image_mode="RGB", height=8, width=8,
                      notes=RequestNotes())  # fmt: skip
    msg = Prepared(uid=f"u{seed}", state=bundle, meta=meta, preprocess_ms=0, pid=os.getpid())
    conn.send_bytes(encode(msg))
    if stay:
        time.sleep(60)  # the parent SIGKILLs us here


def test_child_packs_parent_unpacks_and_cleanup_after_sigkill() -> None:
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [
        ctx.Process(target=_child, args=(pipes[i][1], PREFIX, seed, stay), daemon=True)
        for i, (seed, stay) in enumerate([(1, False), (2, True)])
    ]
    for p in procs:
        p.start()
    try:
        assert all(r.poll(60) for r, _ in pipes), "children did not report"
        done, doomed = (decode(r.recv_bytes()) for r, _ in pipes)
        assert isinstance(done, Prepared) and isinstance(doomed, Prepared)
        procs[0].join(30)
        assert procs[0].exitcode == 0
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(30)
        assert procs[1].exitcode == -signal.SIGKILL
        # the creator has exited: its segment survived (no resource tracker unlinked it)
        assert_bit_identical(ts.unpack(done.state, unlink=True), make_tensors(1))
        # the killed child's segment is leaked until the supervisor's cleanup for that pid
        assert ts.segments(PREFIX) == [doomed.state.segment]
        assert ts.cleanup(ts.process_prefix(PREFIX, procs[1].pid)) == 1
        assert ts.segments(PREFIX) == []
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
