"""The worker runtime with real processes on CPU (tiny SD2): step-level joins asserted from the step
log, static batching, process separation, cancellation, failure isolation and exactness against the
direct pipeline. Process failures and recovery: tests/worker/test_failures.py; the host cache
tiers (DRAM, device): tests/worker/test_worker_cache_tiers.py."""

from __future__ import annotations

import io
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from instgenie.config import Config, ModelConfig, WorkerConfig
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.ipc import ClientSocket, ipc_dir_prefix
from instgenie.messages import EditDone, Progress, RegisterTemplate, StepEntry, SubmitEdit
from instgenie.tensorshm import SHM_DIR
from instgenie.wire import WorkerToClient
from instgenie.worker.client import EditHandle, WorkerError, start_worker
from instgenie.worker.names import shm_base
from instgenie.worker.stages import capture_uid
from tests.conftest import make_image, make_mask, png_bytes, tiny_pipeline

MODEL = "sd2-inpaint"
SIZE = 64
FAULTS = "pre=FAULT-PRE,post=FAULT-POST,nan=FAULT-NAN,stall=FAULT-STALL"
STEP_DEADLINE_S = 60  # generous: a 2-core CI machine runs 4 processes


def _config(policy: str = "continuous", **worker) -> Config:
    w = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=15.0, stall_timeout_s=30.0,
             restart_backoff_s=0.2, max_batch=2)  # fmt: skip
    w.update(worker)
    return Config(model=ModelConfig(model=f"{MODEL}:tiny"), worker=WorkerConfig(policy=policy, **w))


def _fields(uid: str, steps: int, seed: int = 0, prompt: str = "a red hat", **kw) -> dict:
    return dict(uid=uid, image=png_bytes(make_image(SIZE, SIZE, seed=seed)),
                mask=png_bytes(make_mask(SIZE, SIZE)), prompt=prompt, seed=seed,
                num_inference_steps=steps, paste_back=False) | kw  # fmt: skip


def _direct(fields: dict) -> bytes:
    """The same request through the in-process pipeline, alone."""
    req = EditRequest(**{k: v for k, v in fields.items() if k != "submitted_at"})
    return tiny_pipeline(MODEL).run([req])[0].data


def _pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB")).astype(np.int16)


def _wait_progress(handle: EditHandle, steps: int, timeout: float = STEP_DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while len(handle.progress) < steps:
        assert time.monotonic() < deadline, f"{handle.uid}: no progress past {handle.progress}"
        assert not handle.future.done() or handle.future.exception() is None, handle.result()
        time.sleep(0.01)


def _internal(log: list[StepEntry], uid: str) -> str:
    """The worker-internal id of client uid `uid` (step-log entries carry '<seq>:<uid>')."""
    for e in log:
        for member, _ in e.members:
            if member.partition(":")[2] == uid:
                return member
    raise AssertionError(f"{uid} never ran")


def _steps_of(log: list[StepEntry], member: str) -> list[StepEntry]:
    return [e for e in log if member in dict(e.members)]


def _shm_segments(sup_pid: int) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{shm_base(sup_pid)}-*"))


def _ipc_dirs(pid: int) -> list[str]:
    """The ipc directories of process `pid` that exist (instgenie.ipc.ipc_dir_prefix)."""
    return sorted(p.name for p in Path(tempfile.gettempdir()).glob(f"{ipc_dir_prefix(pid)}*"))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@contextmanager
def _worker(config: Config, faults: str = ""):
    """A worker with its processes; on exit: closed, and no process, shm segment or ipc
    directory left."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INSTGENIE_FAULTS", faults)
        handle = start_worker(config, timeout=240)
    pids = {handle.pid}
    try:
        yield handle, pids
        stats = handle.client.stats()
        pids |= {int(v) for k, v in stats.items() if k.startswith("pid_") and v}
    finally:
        rc = handle.close(drain=False, timeout=30)
    assert rc == 0
    assert _ipc_dirs(handle.pid) == [], "the supervisor left its ipc directory"  # (own atexit)
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], "orphan processes"
    assert _shm_segments(handle.pid) == [], "leaked shared-memory segments"


# ---- continuous ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cont():
    with _worker(_config(), FAULTS) as (handle, pids):
        yield handle, pids


def test_stages_run_in_other_processes(cont) -> None:
    handle, _ = cont
    s = handle.client.stats()
    pids = [s["pid_supervisor"], s["pid_loop_0"], s["pid_pre_0"], s["pid_post_0"]]
    assert len(set(pids)) == 4 and all(pids)
    # the loop refuses image codec work (imageio raises there); pre and post do it
    assert (s["codec_loop_0"], s["codec_pre_0"], s["codec_post_0"]) == (0.0, 1.0, 1.0)
    done = handle.client.run_edit(**_fields("codec", 2))
    assert done.width == done.height == SIZE  # decoded in pre, encoded in post


def test_the_loop_reports_its_cost_spec(cont) -> None:
    """What the server's mask-aware router prices this worker with: its own model's blocks."""
    from instgenie.engine.costspec import cost_spec

    handle, _ = cont
    spec = handle.client.cost_spec()
    assert spec is not None and spec.model == f"{MODEL}:tiny"
    assert spec == cost_spec(tiny_pipeline(MODEL))  # no --profile: FLOP prices, no fits
    assert handle.client.stats() and handle.client.cost_spec() == spec  # plain Stats unaffected


@pytest.mark.parametrize("model_stages", ["loop", "process"])
def test_stage_fits_reach_the_router_only_where_the_loop_runs_the_stages(
    model_stages: str, tmp_path
) -> None:  # noqa: ANN001
    """With a profile, the loop's CostSpec carries its fits; the encode/decode fits only when
    the loop process runs those stages (between its steps), not when the pre/post processes do."""
    import json

    from instgenie.engine.profiling import family_block_dims
    from instgenie.scheduler.fits import MODES, LinearFit, Profile
    from instgenie.scheduler.spec import block_class

    dims = family_block_dims(tiny_pipeline(MODEL).family)
    flat = LinearFit(1e-9, 0.1, 1.0, 2)
    prof = Profile(
        model=f"{MODEL}:tiny", device="cpu", dtype="float32", size=SIZE,
        compute={block_class(d): dict.fromkeys(MODES, flat) for d in dims.values()},
        load={"dram": flat}, blocks={b: block_class(d) for b, d in dims.items()}, meta={},
        other=flat, stages={"encode": flat, "decode": flat},
    )  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof.to_json()))
    with _worker(_config(model_stages=model_stages, profile=str(path))) as (handle, _):
        spec = handle.client.cost_spec()
    assert spec.profile == str(path) and spec.compute and spec.other is not None
    assert set(spec.stages) == ({"encode", "decode"} if model_stages == "loop" else set())


def test_output_equals_direct_pipeline(cont) -> None:
    handle, _ = cont
    fields = _fields("exact", 4, seed=7, prompt="a straw hat", output_format="png")
    done = handle.client.run_edit(**fields)
    assert (done.path, done.num_steps, done.output_format) == ("full", 4, "png")
    assert done.data == _direct(fields)  # byte-identical: same pre, steps and post, other pids
    assert done.total_ms >= done.preprocess_ms + done.denoise_ms + done.postprocess_ms


def test_model_stages_in_the_pre_post_processes_is_exact_too() -> None:
    """model_stages="process": encoders/VAE in the pre/post processes, not in the loop."""
    with _worker(_config(model_stages="process")) as (handle, _):
        fields = _fields("proc", 3, seed=11, prompt="a wool hat")
        done = handle.client.run_edit(**fields)
        assert done.data == _direct(fields) and done.path == "full"


def test_template_edit_is_masked_and_exact(cont) -> None:
    handle, _ = cont
    image = png_bytes(make_image(SIZE, SIZE, seed=3))
    spec = dict(image=image, prompt="a photo", seed=5, num_inference_steps=4)
    tid = "ab" * 32
    ready = handle.client.register_template(RegisterTemplate(template_id=tid, **spec))
    assert ready.ok and ready.build_ms > 0 and list(ready.bytes_by_tier) == ["cpu"]
    assert ready.bytes_by_tier["cpu"] > 0  # the loop's device store (no cache_root)
    assert handle.client.stats()["templates_ready"] >= 1
    fields = _fields("tmpl", 4, seed=9, template_id=tid, image=None)
    done = handle.client.run_edit(**fields)
    assert (done.path, done.cache, done.cache_tier) == ("masked", "hit", "cpu")
    assert handle.client.stats()["cache_hits_cpu"] >= 1
    pipe = tiny_pipeline(MODEL)
    key = pipe.build_template(TemplateSpec(**spec))
    ref = pipe.run([EditRequest(**{**fields, "template_id": key, "image": None})])[0]
    assert ref.path == "masked" and done.data == ref.data
    # an unknown template is a typed error, not a hang
    with pytest.raises(WorkerError) as e:
        handle.client.run_edit(**_fields("nope", 2, template_id="cd" * 32, image=None))
    assert e.value.code == "invalid_request" and "no template" in e.value.reason


def test_dropped_template_is_forgotten_and_can_come_back(cont) -> None:
    handle, _ = cont
    c = handle.client
    tid = "ef" * 32
    spec = dict(image=png_bytes(make_image(SIZE, SIZE, seed=4)), prompt="", seed=1,
                num_inference_steps=2)  # fmt: skip
    c.register_template(RegisterTemplate(template_id=tid, **spec))
    dropped = c.stats()["templates_dropped"]
    c.drop_template(tid)
    c.drop_template("00" * 32)  # unknown: ignored
    with pytest.raises(WorkerError) as e:  # pre forgot it (messages to one process keep order)
        c.run_edit(**_fields("gone", 2, template_id=tid, image=None))
    assert e.value.code == "invalid_request" and "no template" in e.value.reason
    assert c.stats()["templates_dropped"] == dropped + 1
    # the same id again: captured anew (the loop deleted the old cache and holds no stale abort)
    again = c.register_template(RegisterTemplate(template_id=tid, **spec))
    assert again.ok and again.bytes_by_tier["cpu"] > 0
    captures = [e for e in c.step_log() if capture_uid(tid) in dict(e.members)]
    assert len(captures) == 2 * 2  # two full capture runs of 2 steps: the first cache was deleted
    done = c.run_edit(**_fields("back", 2, template_id=tid, image=None))
    assert (done.path, done.cache) == ("masked", "hit")


def test_newcomer_joins_the_running_batch_within_one_step(cont) -> None:
    handle, _ = cont
    c = handle.client
    since = int(c.stats()["steps_total"])
    a = c.edit(**_fields("join-a", 30, seed=1))
    _wait_progress(a, 3)
    b = c.edit(**_fields("join-b", 4, seed=2))
    b.result(STEP_DEADLINE_S)
    a.result(STEP_DEADLINE_S)
    log = c.step_log(since)
    ia, ib = _internal(log, "join-a"), _internal(log, "join-b")
    join = next(e for e in log if ib in e.joined)
    a_index = dict(join.members)[ia]
    assert 3 <= a_index < 30  # a was mid-run when b joined it
    a_steps = [e.duration_ms for e in _steps_of(log, ia)]
    # b waited in the loop less than one step: it joined at the first step boundary
    assert join.waited_ms[join.joined.index(ib)] < float(np.median(a_steps))
    assert b.progress == [1, 2, 3, 4]
    # b left right after its last step, while a kept running
    assert max(e.step for e in _steps_of(log, ib)) < max(e.step for e in _steps_of(log, ia))


def test_batch_size_is_the_running_batch_and_returns_to_zero(cont) -> None:
    handle, _ = cont
    c = handle.client
    a = c.edit(**_fields("bs-a", 30, seed=1))
    _wait_progress(a, 2)
    b = c.edit(**_fields("bs-b", 30, seed=2))
    _wait_stat(c, "batch_size_last", 2.0)  # both in the running batch
    c.cancel("bs-b")
    c.cancel("bs-a")
    for h in (a, b):
        with pytest.raises(WorkerError):
            h.result(10)
    _wait_stat(c, "batch_size_last", 0.0)  # the loop holds nothing: not the last batch's 2


def test_cancel_mid_run_frees_the_slot(cont) -> None:
    handle, _ = cont
    c = handle.client
    since = int(c.stats()["steps_total"])
    fa, fb, fc = (
        _fields("cx-a", 30, seed=1),
        # b must outlive the cancel (3 steps + 0.3 s + the cancel's trip): with fewer steps a
        # fast machine finishes b first, and c takes b's slot instead of a's
        _fields("cx-b", 30, seed=2),
        _fields("cx-c", 4, seed=3),
    )
    a, b = c.edit(**fa), c.edit(**fb)
    _wait_progress(a, 3)
    _wait_progress(b, 3)
    cc = c.edit(**fc)  # the batch (max 2) is full: c waits
    time.sleep(0.3)
    assert cc.progress == []
    c.cancel("cx-a")
    with pytest.raises(WorkerError) as e:
        a.result(10)
    assert e.value.code == "cancelled" and not e.value.retryable
    done_b, done_c = b.result(STEP_DEADLINE_S), cc.result(STEP_DEADLINE_S)
    log = c.step_log(since)
    ia, ib, ic = (_internal(log, u) for u in ("cx-a", "cx-b", "cx-c"))
    last_a = max(e.step for e in _steps_of(log, ia))
    assert max(i for e in _steps_of(log, ia) for u, i in e.members if u == ia) < 29
    join_c = next(e for e in log if ic in e.joined)
    assert join_c.step == last_a + 1  # a's slot went to c at the very next step
    assert ib in dict(join_c.members)  # while b kept running
    # the others are unaffected: equal to their solo runs (batched GEMMs: one u8 level)
    for done, fields in ((done_b, fb), (done_c, fc)):
        assert np.abs(_pixels(done.data) - _pixels(_direct(fields))).max() <= 1


def test_a_failing_request_fails_alone(cont) -> None:
    handle, _ = cont
    c = handle.client
    good = [c.edit(**_fields(f"ok{i}", 3, seed=i)) for i in range(2)]
    bad = {
        "FAULT-PRE": ("internal_error", "injected pre-processing fault"),
        "FAULT-NAN": ("internal_error", "non-finite latents"),
        "FAULT-POST": ("internal_error", "injected post-processing fault"),
    }
    handles = {p: c.edit(**_fields(p, 3, seed=4, prompt=p)) for p in bad}
    broken = c.edit(**_fields("broken", 3, image=b"\x89PNG\r\n\x1a\n not really"))
    for p, (code, text) in bad.items():
        with pytest.raises(WorkerError) as e:
            handles[p].result(STEP_DEADLINE_S)
        assert e.value.code == code and text in e.value.reason, (p, e.value)
    with pytest.raises(WorkerError) as e:
        broken.result(STEP_DEADLINE_S)
    assert e.value.code == "invalid_request" and e.value.reason.startswith("image:")
    for i, h in enumerate(good):
        assert h.result(STEP_DEADLINE_S).num_steps == 3, i
    stats = c.stats()
    assert stats["child_deaths"] == 0 and stats["in_flight"] == 0


def test_duplicate_uid_is_refused_and_the_original_survives(cont) -> None:
    handle, _ = cont
    with ClientSocket(handle.address, accept=WorkerToClient) as raw:
        first = SubmitEdit(**_fields("dup", 4))
        raw.send(first)
        raw.send(first)
        replies = _replies(raw, "dup", until=EditDone)
    # stage reports (Progress with a stage: preprocess, encode, ...) may come at any point
    replies = [m for m in replies if not (isinstance(m, Progress) and m.stage)]
    kinds = [type(m).__name__ for m in replies]
    assert kinds[:2] == ["Accepted", "EditFailed"] and kinds[-1] == "EditDone", kinds
    assert replies[1].code == "invalid_request" and "already in flight" in replies[1].message
    assert [m.step for m in replies if isinstance(m, Progress)] == [1, 2, 3, 4]


def _replies(sock: ClientSocket, uid: str, until: type) -> list:
    out: list = []
    deadline = time.monotonic() + STEP_DEADLINE_S
    while not out or not isinstance(out[-1], until):
        msg = sock.recv(timeout_ms=max(1, 1e3 * (deadline - time.monotonic())))
        assert msg is not None, f"no {until.__name__} for {uid}: {out}"
        assert getattr(msg, "uid", uid) == uid
        out.append(msg)
    return out


# ---- static and naive-continuous ----------------------------------------------------------------
def test_static_arrivals_wait_for_the_batch() -> None:
    with _worker(_config("static", max_batch=4, max_queue=2)) as (handle, _):
        c = handle.client
        a = c.edit(**_fields("st-a", 12, seed=1))
        _wait_progress(a, 2)
        b = c.edit(**_fields("st-b", 3, seed=2))
        with pytest.raises(WorkerError) as e:  # a bounded queue: the third is refused at once
            c.run_edit(timeout=5, **_fields("st-c", 3))
        assert e.value.code == "overloaded" and e.value.retryable
        a.result(STEP_DEADLINE_S)
        b.result(STEP_DEADLINE_S)
        log = c.step_log()
        ia, ib = _internal(log, "st-a"), _internal(log, "st-b")
        join = next(e for e in log if ib in e.joined)
        a_steps = _steps_of(log, ia)
        assert len(a_steps) == 12 and join.step > a_steps[-1].step  # b waited for all of a
        assert dict(join.members) == {ib: 0}
        # b reached the loop while a still had steps to run, and waited through them
        arrived = join.t_start - join.waited_ms[0] / 1e3
        later = [e for e in a_steps if e.t_start > arrived]
        assert later and join.waited_ms[0] >= sum(e.duration_ms for e in later)


def test_naive_continuous_runs_stages_in_the_loop() -> None:
    with _worker(_config("naive-continuous")) as (handle, _):
        c = handle.client
        s = c.stats()
        assert "pid_pre_0" not in s and s["codec_loop_0"] == 1.0
        fields = _fields("nv", 4, seed=7, prompt="a straw hat")
        done = c.run_edit(**fields)
        assert done.data == _direct(fields)
        # the loop reports its own stage times; queue = what is left of the total
        assert done.preprocess_ms > 0 and done.denoise_ms > 0 and done.postprocess_ms > 0
        busy = done.preprocess_ms + done.denoise_ms + done.postprocess_ms
        assert done.queue_ms == pytest.approx(max(0.0, done.total_ms - busy), abs=1e-6)
        a = c.edit(**_fields("nv-a", 20, seed=1))
        _wait_progress(a, 2)
        b = c.edit(**_fields("nv-b", 3, seed=2))
        b.result(STEP_DEADLINE_S)
        a.result(STEP_DEADLINE_S)
        log = c.step_log()
        join = next(e for e in log if _internal(log, "nv-b") in e.joined)
        assert _internal(log, "nv-a") in dict(join.members)  # joined mid-run


# ---- faults of the loop process -----------------------------------------------------------------
def _wait_stat(client, name: str, value: float) -> None:
    deadline = time.monotonic() + STEP_DEADLINE_S
    while client.stats().get(name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}: {client.stats()}"
        time.sleep(0.05)
