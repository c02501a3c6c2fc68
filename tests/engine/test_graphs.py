"""The CUDA-graph form of a denoising step (engine/graphs.py), checked on CPU.

A graph replays what the step's graph form computed when it was captured, so the graph form must
equal the plain path: static input buffers, cached rows read by `index_select` over the step axis
of the store's per-block stacks with the step index in a device tensor. `force_static` runs that
form eagerly on CPU at every step (replay itself is checked on CUDA in test_gpu_masked.py).
Equality is exact: the same kernels see the same values.
"""

from __future__ import annotations

import gc
import os
import uuid

import pytest
import torch

from instgenie.cache.host_store import HostActivationStore
from instgenie.cache.shm_segment import cleanup
from instgenie.cache.store import InMemoryStore
from instgenie.cache.tiered import TieredStore
from instgenie.cache.window import SLOTS
from instgenie.engine.graphs import (
    COST_MIN_SAMPLES,
    COST_SAMPLES,
    CallCosts,
    StepGraphs,
    capture_pays,
    costliest_mode,
)
from instgenie.engine.masked import context
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.exec_config import ExecConfig
from tests.conftest import make_image, make_mask, png_bytes

STEPS = 4


def _pipe(family: str, store: InMemoryStore | None = None) -> EditPipeline:
    """A tiny pipeline whose graphs capture compositions while serving ("auto", what these
    tests check; bucket graphs: tests/engine/test_bucket_graphs.py)."""
    loaded = EditPipeline.load(f"{family}:tiny", execution=ExecConfig(graph_capture="auto"))
    return loaded if store is None else EditPipeline(loaded.family, store=store)


def _template(pipe: EditPipeline, seed: int) -> str:
    img = png_bytes(make_image(128, 128, seed=seed))
    return pipe.build_template(TemplateSpec(image=img, prompt="a coat", seed=seed,
                                            num_inference_steps=STEPS))  # fmt: skip


def _edit(uid: str, key: str | None, box, seed: int, guidance: float | None = None) -> EditRequest:
    img = None if key else png_bytes(make_image(128, 128, seed=9))
    mask = png_bytes(make_mask(128, 128, box))
    return EditRequest(uid=uid, image=img, template_id=key, mask=mask, prompt=f"a {uid} scarf",
                       seed=seed, num_inference_steps=STEPS, guidance_scale=guidance,
                       paste_back=False)  # fmt: skip


def _run_staggered(pipe: EditPipeline, requests: list[EditRequest]) -> list[torch.Tensor]:
    """Request i joins at step i: the batch mixes step indices, templates and paths."""
    states, out = [], {}
    pending = [pipe.preprocess(r) for r in requests]
    while pending or states:
        if pending:
            states.append(pending.pop(0))
        pipe.denoise_step(states)
        for s in states:
            if s.is_done:
                out[s.uid] = s.latents.clone()
        states = [s for s in states if not s.is_done]
    return [out[r.uid] for r in requests]


@pytest.mark.parametrize("step_copy", ["auto", "on"])
def test_graph_form_equals_plain_path(family: str, step_copy: str, monkeypatch) -> None:
    """step_copy "on": cached rows read by the Triton step-copy kernel (interpreted on CPU)."""
    if step_copy == "on" and os.environ.get("TRITON_INTERPRET") != "1":
        # a CUDA machine (conftest sets the interpreter only without one): Triton cannot
        # launch on these CPU tensors; test_gpu_masked.py runs the kernel on the device
        pytest.skip("the step-copy kernel on CPU tensors needs TRITON_INTERPRET=1")
    monkeypatch.setattr(context, "STEP_COPY", step_copy)
    pipe = _pipe(family)
    ex = pipe.family.masked
    k1, k2 = _template(pipe, 1), _template(pipe, 2)
    reqs = [
        _edit("a", k1, (0.1, 0.1, 0.4, 0.5), 3),
        _edit("b", k2, (0.5, 0.2, 0.9, 0.7), 4),
        _edit("c", None, (0.3, 0.3, 0.6, 0.6), 5),  # full path, in the same batch
        _edit("d", k1, (0.0, 0.6, 1.0, 1.0), 6),
        # no guidance (UNets: one row) on a template captured with CFG: its cond row
        _edit("e", k2, (0.2, 0.0, 0.7, 0.4), 7, guidance=1.0),
    ]
    ex.graphs.mode = "off"
    plain = _run_staggered(pipe, reqs)
    assert ex.graphs.counters["warmup"] == 0
    ex.graphs = StepGraphs(ex.device, "all")
    ex.graphs.force_static = True
    static = _run_staggered(pipe, reqs)
    # 4 joins + 3 steps to finish the last: every step took the graph form
    assert ex.graphs.counters["warmup"] == STEPS + len(reqs) - 1
    assert ex.graphs.counters["eager"] == 0
    for a, b in zip(plain, static, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("loading", ["auto", "pipelined", "window"])
def test_graph_form_reads_host_memory(family: str, loading: str, tmp_path) -> None:
    """Caches in the host DRAM tier (shared memory): the graph form reads each request's step
    from the segment in place ("auto" on CPU; on CUDA the pinned pages' device view), through
    the composition's own loader whose copies are part of the step ("pipelined"), or from a
    device step window DMA'd one step ahead, at slot step % 2 ("window": what CUDA does by
    default, decision 0029). All equal the plain path exactly."""
    ns = uuid.uuid4().hex[:10]
    tiered = TieredStore(tmp_path, ns, 256 << 20, 0, disk_enabled=False)
    try:
        pipe = _pipe(family, HostActivationStore(tiered, tmp_path))
        ex = pipe.family.masked
        k1, k2 = _template(pipe, 1), _template(pipe, 2)
        reqs = [
            _edit("a", k1, (0.1, 0.1, 0.4, 0.5), 3),
            _edit("b", k2, (0.5, 0.2, 0.9, 0.7), 4),
            _edit("c", None, (0.3, 0.3, 0.6, 0.6), 5),
            _edit("e", k2, (0.2, 0.0, 0.7, 0.4), 7, guidance=1.0),
        ]
        ex.graphs.mode = "off"
        plain = _run_staggered(pipe, reqs)
        graph_form_reading(ex, loading)
        loaders = []
        make = ex._graph_loader
        ex._graph_loader = lambda dtype: loaders.append(make(dtype)) or loaders[-1]
        static = _run_staggered(pipe, reqs)
        assert ex.graphs.counters["warmup"] == STEPS + len(reqs) - 1
        assert ex.graphs.counters["eager"] == 0
        for a, b in zip(plain, static, strict=True):
            assert torch.equal(a, b)
        assert ex.loader is None  # no eager (DMA) loading ran
        if loading == "pipelined":  # one loader per composition that read the cache
            assert len(loaders) == STEPS + len(reqs) - 1
            assert all(ld.bytes_loaded > 0 for ld in loaders)
        else:
            assert loaders == []
        # a window per cache-reading request, each step copied into it once
        windows = ex._windows
        assert len(windows) == (3 if loading == "window" else 0)
        assert all(w.bytes_copied == STEPS * w.nbytes // SLOTS for w in windows)
    finally:
        tiered.close()
        cleanup(ns)


def graph_form_reading(ex, loading: str) -> None:  # noqa: ANN001 - a MaskedExecutor
    """Steps in the graph form (eagerly on CPU), host-tier rows read `loading`: "auto" (in
    place), "pipelined" (the composition's loader) or "window" (device step windows)."""
    ex.graphs = StepGraphs(ex.device, "all")
    ex.graphs.force_static = True
    if loading == "window":
        ex.windows = "on"
    else:
        ex.loading = loading


def test_a_window_is_decided_once_per_edit(tmp_path) -> None:
    """A window attached mid-edit would change what the composition's captured graph reads (the
    slot, not the step): a request that got none at its first step (over the budget) reads host
    memory for its whole edit, even once the budget allows one, and stays exact."""
    ns = uuid.uuid4().hex[:10]
    tiered = TieredStore(tmp_path, ns, 256 << 20, 0, disk_enabled=False)
    try:
        pipe = _pipe("sdxl-inpaint", HostActivationStore(tiered, tmp_path))
        ex = pipe.family.masked
        key = _template(pipe, 1)
        ex.graphs.mode = "off"
        plain = _run_staggered(pipe, [_edit("a", key, (0.2, 0.2, 0.6, 0.6), 3)])[0]
        ex.graphs = StepGraphs(ex.device, "all")
        ex.graphs.force_static = True
        ex.windows, ex.window_budget_bytes = "on", 0
        s = pipe.preprocess(_edit("a", key, (0.2, 0.2, 0.6, 0.6), 3))
        pipe.denoise_step([s])
        handle = s.cache_handle
        assert handle.window_decided and handle.window is None
        ex.window_budget_bytes = 1 << 30
        while not s.is_done:
            pipe.denoise_step([s])
            assert handle.window is None or s.is_done
        assert ex._windows == [] and torch.equal(s.latents, plain)
    finally:
        tiered.close()
        cleanup(ns)


def test_graph_form_reads_each_step(family: str) -> None:
    """The step index is a device scalar written before every call: a graph form stuck at the
    step it was built for reads the wrong cached rows (guards the fill of the step index)."""
    pipe = _pipe(family)
    ex = pipe.family.masked
    key = _template(pipe, 1)
    req = _edit("a", key, (0.2, 0.2, 0.6, 0.6), 3)
    ex.graphs.mode = "off"
    plain = _run_staggered(pipe, [req])[0]
    written = []

    class StuckSteps(StepGraphs):
        def _write_steps(self, entry, ctx):
            written.append([r.step for r in ctx.requests])
            if len(written) == 1:  # the first step only, then never updated
                super()._write_steps(entry, ctx)

    ex.graphs = StuckSteps(ex.device, "masked")
    ex.graphs.force_static = True
    stuck = _run_staggered(pipe, [req])[0]
    assert written == [[s] for s in range(STEPS)]
    assert not torch.equal(plain, stuck)


def test_full_path_batches_share_a_graph_across_compositions(family: str) -> None:
    """A batch that reads and records no cache has no step context: its graph reads only its
    inputs, so a later batch of other requests with the same shapes runs in the same entry (on
    CUDA: replays the graph instead of capturing), and still equals the plain path exactly.
    A masked batch stays keyed by its members (its token sets are in its graph)."""
    pipe = _pipe(family)
    ex = pipe.family.masked
    first = [_edit("a", None, (0.1, 0.1, 0.4, 0.5), 3), _edit("b", None, (0.5, 0.2, 0.9, 0.7), 4)]
    second = [_edit("c", None, (0.3, 0.3, 0.6, 0.6), 5), _edit("d", None, (0.0, 0.6, 1.0, 1.0), 6)]
    ex.graphs.mode = "off"
    plain = [_run_together(pipe, reqs) for reqs in (first, second)]
    ex.graphs = StepGraphs(ex.device, "all")
    ex.graphs.force_static = True
    static = [_run_together(pipe, reqs) for reqs in (first, second)]
    assert len(ex.graphs._entries) == 1  # one entry served both compositions
    (entry,) = ex.graphs._entries.values()
    assert entry.calls == 2 * STEPS
    for a, b in zip(plain, static, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    key = _template(pipe, 1)
    held = []  # two masked compositions of one shape, alive: two more entries
    for i in range(2):
        held.append(pipe.preprocess(_edit(f"m{i}", key, (0.1 * i, 0.2, 0.5, 0.6), i)))
        while not held[-1].is_done:
            pipe.denoise_step(held[-1:])
    assert len(ex.graphs._entries) == 3


def _run_together(pipe: EditPipeline, requests: list[EditRequest]) -> list[torch.Tensor]:
    states = [pipe.preprocess(r) for r in requests]
    while not all(s.is_done for s in states):
        pipe.denoise_step(states)
    return [s.latents.clone() for s in states]


def test_store_stacks_are_the_step_entries() -> None:
    pipe = _pipe("sdxl-inpaint")
    key = _template(pipe, 1)
    h = pipe.store.open(key)
    meta = pipe.store.meta(key)
    for b, (L, C) in meta.block_shapes.items():
        stack = h.block_steps(b, h.device)
        assert stack.shape == (STEPS, meta.num_rows, L, C)
        for s in range(STEPS):
            assert h.block(s, b).data_ptr() == stack[s].data_ptr()
    assert meta.nbytes >= sum(h.block_steps(b, h.device).nbytes for b in meta.block_shapes)


def test_eligibility() -> None:
    fp8 = _pipe("sdxl-inpaint", InMemoryStore("cpu", dtype=torch.float8_e4m3fn))
    ex = fp8.family.masked
    ex.graphs.force_static = True
    key = _template(fp8, 1)
    state = fp8.preprocess(_edit("a", key, (0.2, 0.2, 0.6, 0.6), 3))
    assert state.path == "masked"
    ctx = ex.context([state], fp8.plan_step([state]))
    dtype = state.latents.dtype
    assert not ex.graphs.eligible(ctx, dtype, ex.block_order)  # fp8 rows have no stacks

    pipe = _pipe("sdxl-inpaint")
    ex = pipe.family.masked
    graphs = StepGraphs(ex.device, "all")
    graphs.force_static = True
    key = _template(pipe, 1)
    state = pipe.preprocess(_edit("a", key, (0.2, 0.2, 0.6, 0.6), 3))
    ctx = ex.context([state], pipe.plan_step([state]))
    assert graphs.eligible(ctx, dtype, ex.block_order)
    assert not graphs.eligible(ctx, torch.float64, ex.block_order)  # stack dtype differs
    assert graphs.eligible(None, dtype, ex.block_order)  # a full batch
    graphs.mode = "masked"
    assert not graphs.eligible(None, dtype, ex.block_order)
    spec = TemplateSpec(image=png_bytes(make_image(128, 128, seed=7)), num_inference_steps=STEPS)
    capture = pipe.capture_state(pipe.register_template(spec))
    assert not graphs.eligible(
        ex.context([state, capture], pipe.plan_step([state, capture])), dtype, ex.block_order
    )
    assert not StepGraphs(ex.device, "all").eligible(None, dtype, ex.block_order)  # CPU
    with pytest.raises(ValueError, match="unknown CUDA graph mode"):
        StepGraphs(ex.device, "sometimes")
    with pytest.raises(ValueError, match="unknown graph capture policy"):
        StepGraphs(ex.device, "all", capture="never")


def test_entries_are_bounded_and_dropped_with_their_requests() -> None:
    pipe = _pipe("sdxl-inpaint")
    ex = pipe.family.masked
    ex.graphs = StepGraphs(ex.device, "all", max_graphs=2)
    ex.graphs.force_static = True
    key = _template(pipe, 1)
    for i in range(3):  # three compositions, one after the other
        _run_staggered(pipe, [_edit(f"r{i}", key, (0.1 * i, 0.2, 0.5, 0.6), i)])
    assert len(ex.graphs._entries) <= 2
    gc.collect()
    ex.graphs._drop_dead()
    assert len(ex.graphs._entries) == 0  # every request state is gone


# ---- when a capture pays ---------------------------------------------------------------------
# Costs shaped like the H200 SDXL 1024² masked step (masked-step-h200.md): at batch 1 an eager
# call is host-bound (64 ms) and a replay takes 20 ms; at batch 8 both take ~120 ms. A capture
# is the step's Python under capture plus instantiation (~60 ms here) and one replay.
SMALL, LARGE = "b1", "b8"


def _costs() -> CallCosts:
    costs = CallCosts()
    for kind, small, large in (("eager", 64, 122), ("replay", 20, 120), ("capture", 80, 180)):
        for _ in range(COST_MIN_SAMPLES):
            costs.add(kind, SMALL, small)
            costs.add(kind, LARGE, large)
    return costs


def test_capture_pays_when_replays_win_back_the_capture() -> None:
    costs = _costs()
    # batch 1: 80 + 20 < 2 * 64 — pays from the second call on; one call never pays
    assert not capture_pays(costs, SMALL, 1)
    assert capture_pays(costs, SMALL, 2)
    assert capture_pays(costs, SMALL, 20)
    # batch 8: a replay saves 2 ms a call and the capture costs 58 ms more than an eager call,
    # so only a composition of more than 30 calls pays (180 + 29 * 120 = 30 * 122 = 3660);
    # a 20-step request never keeps one that long
    assert not capture_pays(costs, LARGE, 3)
    assert not capture_pays(costs, LARGE, 30)
    assert capture_pays(costs, LARGE, 31)


def test_capture_pays_without_knowledge() -> None:
    costs = _costs()
    assert capture_pays(costs, SMALL, None)  # a caller that does not know its horizon
    assert capture_pays(costs, "b4", 2)  # no cost of that shape measured yet: measure it
    assert not capture_pays(costs, "b4", 1)  # but a composition of one call never pays
    partial = CallCosts()
    for _ in range(COST_MIN_SAMPLES):
        partial.add("eager", SMALL, 64)
        partial.add("replay", SMALL, 20)
    assert capture_pays(partial, SMALL, 2)  # never captured at that shape yet
    for n in range(COST_MIN_SAMPLES):  # one slow capture is not yet a cost
        assert capture_pays(partial, SMALL, 2)
        partial.add("capture", SMALL, 5000.0 if n == 0 else 200.0)
    assert not capture_pays(partial, SMALL, 2)  # 200 + 20 > 2 * 64


def test_call_costs_are_the_median_of_the_newest() -> None:
    costs = CallCosts()
    assert costs.ms("eager", SMALL) is None
    costs.add("eager", SMALL, 5000.0)  # the first call of a process compiles
    costs.add("eager", SMALL, 60.0)
    assert costs.ms("eager", SMALL) is None  # fewer than COST_MIN_SAMPLES
    costs.add("eager", SMALL, 70.0)
    assert costs.ms("eager", SMALL) == 70.0
    for _ in range(COST_SAMPLES):
        costs.add("eager", SMALL, 64.0)
    assert costs.ms("eager", SMALL) == 64.0  # the compile is no longer among the samples
    assert costs.ms("eager", LARGE) is None and costs.ms("replay", SMALL) is None


def test_costliest_mode() -> None:
    before = {"capture": 1, "warmup": 3, "eager": 0, "replay": 10}
    assert costliest_mode({**before, "replay": 11}, before) == "replay"
    assert costliest_mode({**before, "replay": 11, "warmup": 4}, before) == "warmup"
    assert costliest_mode({**before, "capture": 2, "warmup": 4}, before) == "capture"
    assert costliest_mode(before, before) == "eager"  # no graph call at all


def test_cpu_graph_form_times_its_calls() -> None:
    """The warm-up calls of the graph form are timed as eager calls, per batch shape."""
    pipe = _pipe("sdxl-inpaint")
    ex = pipe.family.masked
    ex.graphs.force_static = True
    key = _template(pipe, 1)
    _run_staggered(pipe, [_edit("a", key, (0.2, 0.2, 0.6, 0.6), 3)])
    (shape,) = {s for (kind, s) in ex.graphs.costs._ms}
    assert shape[0] is True  # a batch that reads a template cache
    assert len(ex.graphs.costs._ms[("eager", shape)]) == STEPS
    assert ex.graphs.costs.ms("eager", shape) > 0


def test_when_a_composition_is_captured() -> None:
    """The decision alone (no CUDA needed): "always" on call 2; "auto" on call 1 only for a
    batch shape captured before in the process, and only when the costs say it pays."""
    cuda = torch.device("cuda")
    always = StepGraphs(cuda, "all", capture="always")
    assert not always._should_capture(True, SMALL, None)
    assert always._should_capture(False, SMALL, None)
    assert always._should_capture(False, SMALL, 1)  # "always" ignores costs and horizon

    auto = StepGraphs(cuda, "all")
    auto.costs = _costs()
    assert not auto._should_capture(True, SMALL, 5)  # never captured at this shape: warm up
    assert auto._should_capture(False, SMALL, 5)
    auto._captured.add(SMALL)
    assert auto._should_capture(True, SMALL, 5)  # warmed: capture on the first call
    assert not auto._should_capture(True, LARGE, 5) and not auto._should_capture(False, LARGE, 5)
    assert not auto._should_capture(True, SMALL, 1)  # one call left: eager is cheaper
    auto.capture_first = False  # after a failed first-call capture
    assert not auto._should_capture(True, SMALL, 5) and auto._should_capture(False, SMALL, 5)
    assert not StepGraphs(torch.device("cpu"), "all")._should_capture(False, SMALL, None)


def test_prepare_tokens_builds_every_grid_length() -> None:
    """Before a first-call capture every TokenSet the blocks will ask for exists (their host ->
    device copies cannot be captured): one per grid length of the masks, none left to build."""
    pipe = _pipe("sdxl-inpaint")
    ex = pipe.family.masked
    key = _template(pipe, 1)
    state = pipe.preprocess(_edit("a", key, (0.2, 0.2, 0.6, 0.6), 3))
    ctx = ex.context([state], pipe.plan_step([state]))
    ctx._tokens.clear()
    ctx.prepare_tokens()
    assert sorted(ctx._tokens) == sorted(state.token_index)
    built = dict(ctx._tokens)
    pipe.denoise_step([state])  # the same composition: its step reuses these token sets
    assert ex.last_context._tokens is ctx._tokens
    assert all(ctx._tokens[L] is ts for L, ts in built.items())  # used, not rebuilt
    assert set(ctx._tokens) == set(built)  # and none missing
