"""Bucketed step graphs (engine/bucket_graphs.py, graph_capture "buckets"), checked on CPU.

A bucket's graph is captured at start and replayed by every composition of its bucket, so its
graph form — token sets padded to the bucket's capacity and copied into static sets, cached
rows read through device address tables — must compute what the plain path computes, whatever
the composition, and pads must never reach a real output. `force_static` runs that form eagerly
on CPU (replay itself: tests/engine/test_gpu_bucket_graphs.py, marked gpu)."""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest
import torch

from instgenie.engine.graphs import StepGraphs
from instgenie.engine.masked import bound_rows, context
from instgenie.engine.pipeline import EditPipeline
from instgenie.scheduler import buckets
from instgenie.worker import warmup
from tests.conftest import png_bytes
from tests.engine.test_graphs import STEPS, _edit, _pipe, _run_staggered, _template

REQS = (
    ("a", 1, (0.1, 0.1, 0.4, 0.5), 3, None),
    ("b", 2, (0.5, 0.2, 0.9, 0.7), 4, None),
    ("c", None, (0.3, 0.3, 0.6, 0.6), 5, None),  # full path, in the same batch
    ("d", 1, (0.0, 0.6, 1.0, 0.8), 6, None),
    ("e", 2, (0.2, 0.0, 0.7, 0.4), 7, 1.0),  # no guidance on a CFG template: its cond row
)


def _requests(pipe: EditPipeline):
    keys = {1: _template(pipe, 1), 2: _template(pipe, 2)}
    return [_edit(u, None if t is None else keys[t], box, seed, guidance=g)
            for u, t, box, seed, g in REQS]  # fmt: skip


def _bucketed(pipe: EditPipeline, warming: bool = True) -> StepGraphs:
    ex = pipe.family.masked
    ex.graphs = StepGraphs(ex.device, "all", capture="buckets")
    ex.graphs.force_static = True
    ex.graphs.warming = warming  # entries are made on demand (on CUDA: captured) while set
    return ex.graphs


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # padded GEMMs run at another M: the library may round real rows differently (float32)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("step_copy", ["auto", "on"])
def test_bucket_graph_form_equals_plain_path(family: str, step_copy: str, monkeypatch) -> None:
    """Staggered joins and leaves (a new composition at every step; templates, paths, CFG and
    no-CFG rows mixed), every step through a bucket's static sets and tables. step_copy "on":
    the Triton indirect copy (interpreted on CPU)."""
    if step_copy == "on" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the indirect copy kernel on CPU tensors needs TRITON_INTERPRET=1")
    monkeypatch.setattr(context, "STEP_COPY", step_copy)
    pipe = _pipe(family)
    reqs = _requests(pipe)
    pipe.family.masked.graphs.mode = "off"
    plain = _run_staggered(pipe, reqs)
    graphs = _bucketed(pipe)
    padded = _run_staggered(pipe, reqs)
    assert graphs.counters["warmup"] >= len(reqs) + 1 and graphs.counters["capture"] == 0
    for a, b in zip(plain, padded, strict=True):
        assert _close(b, a)


def test_compositions_of_one_bucket_share_its_graph(monkeypatch) -> None:
    """A, then B (another template, another mask of the same size), then A again, each alone:
    one bucket entry, rebound at each change (and not between steps of one composition), every
    result equal to the plain path's."""
    binds = []
    bind = bound_rows.BoundRows.bind

    def counting(self, ctx, blocks, key):
        binds.append(key)
        return bind(self, ctx, blocks, key)

    monkeypatch.setattr(bound_rows.BoundRows, "bind", counting)
    pipe = _pipe("flux-fill")
    k1, k2 = _template(pipe, 1), _template(pipe, 2)
    # boxes on the token grid (16 px at 128²): 2 x 2 tokens each
    a, b = (0.125, 0.125, 0.375, 0.375), (0.5, 0.5, 0.75, 0.75)
    reqs = [_edit("a", k1, a, 3), _edit("b", k2, b, 4), _edit("a2", k1, a, 5)]

    def one_by_one():
        out = []
        for r in reqs:
            state = pipe.preprocess(r)
            while not state.is_done:
                pipe.denoise_step([state])
            out.append(state.latents)
        return out

    pipe.family.masked.graphs.mode = "off"
    plain = one_by_one()
    graphs = _bucketed(pipe)
    padded = one_by_one()
    assert len(graphs.buckets.entries) == 1 and len(binds) == len(reqs)
    assert graphs.counters["warmup"] == 4 * len(reqs)
    for a, b in zip(plain, padded, strict=True):
        assert torch.equal(a, b)


def test_pads_never_reach_a_real_output(monkeypatch) -> None:
    """Pads gather another token of their row (the last instead of the first): every real
    output is bit-identical, so a pad's result goes to the trash row and nowhere else."""
    family = "sdxl-inpaint"
    pad = context._pad

    def pad_last(idx, rows, counts, capacity, L):
        scatter = pad(idx, rows, counts, capacity, L)
        for r in range(len(idx)):
            pads = scatter[r] == len(idx) * L
            idx[r] = torch.where(pads, r * L + L - 1, idx[r])
        return scatter

    runs = []
    for last in (False, True):
        if last:
            monkeypatch.setattr(context, "_pad", pad_last)
        pipe = _pipe(family)
        reqs = _requests(pipe)
        graphs = _bucketed(pipe)
        runs.append(_run_staggered(pipe, reqs))
        assert graphs.counters["warmup"] > 0
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_padding_fills_rows_up_to_their_grid() -> None:
    """_pad: each row takes pads up to L tokens, rows in order; pads gather token 0 of their
    row and scatter to R * L; capacity beyond R * L or below the tokens is refused."""
    L = 4
    idx = [torch.tensor([1, 2]), torch.tensor([4, 5, 6, 7]), torch.tensor([9])]
    rows = [torch.full((t.numel(),), r) for r, t in enumerate(idx)]
    counts = [2, 4, 1]
    scatter = context._pad(idx, rows, counts, 10, L)
    assert counts == [4, 4, 2]
    assert idx[0].tolist() == [1, 2, 0, 0] and idx[2].tolist() == [9, 8]
    assert scatter[0].tolist() == [1, 2, 12, 12] and scatter[1].tolist() == [4, 5, 6, 7]
    assert rows[2].tolist() == [2, 2]
    for cap in (6, 13):
        with pytest.raises(ValueError):
            context._pad([t.clone() for t in idx], list(rows), [4, 4, 2], cap, L)


def test_serving_never_captures() -> None:
    """Outside the warm-up a step whose bucket has no graph runs eagerly: no entry is made, no
    capture is asked for; a full-path shape without a graph likewise."""
    pipe = _pipe("sdxl-inpaint")
    reqs = _requests(pipe)
    graphs = _bucketed(pipe, warming=False)
    _run_staggered(pipe, reqs)
    assert not graphs.buckets.entries and not graphs._entries
    assert graphs.counters["eager"] > 0 and graphs.counters["warmup"] == 0
    on_cuda = StepGraphs(torch.device("cuda"), capture="buckets")  # the policy only (no device)
    assert not on_cuda._should_capture(False, (True, (2, 4, 8, 8)), None)
    on_cuda.warming = True
    assert on_cuda._should_capture(False, (False, (2, 4, 8, 8)), None)
    assert not on_cuda._should_capture(True, (False, (2, 4, 8, 8)), None)


def test_warm_up_makes_the_buckets_serving_uses_and_releases_them(family: str) -> None:
    """The warm-up makes a graph per bucket rung and batch size and per full-path shape (on
    CPU: their graph-form entries), keeps them with their tables zeroed and sources dropped,
    and an edit served after it takes a bucket and equals the plain path."""
    pipe = _pipe(family)
    graphs = _bucketed(pipe, warming=False)
    report = warmup.warm_up(pipe, max_batch=2)
    assert report is not None and not graphs.warming
    rows = {b.rows for b, *_ in graphs.buckets.entries}
    per_request = min(rows)
    assert rows == {per_request, 2 * per_request}
    for n in rows:  # every rung from the tiny mask's own (tiny grids: one token is a large ratio)
        rungs = sorted(b.rung for b, *_ in graphs.buckets.entries if b.rows == n)
        assert rungs == list(range(rungs[0], len(buckets.RUNGS)))
    assert report.graphs == len(graphs.buckets.entries) + len(graphs._entries) > 0
    assert all(k[0][0] == () for k in graphs._entries)  # full-path shapes only
    for e in graphs.buckets.entries.values():
        assert e.bound.key is None and not e.bound._sources
        assert not bool(e.bound.base.any())
    entries = dict(graphs.buckets.entries)
    reqs = _requests(pipe)[:2]
    before = graphs.counters["warmup"]
    served = _run_staggered(pipe, reqs)
    assert graphs.counters["warmup"] > before  # steps took a bucket's graph form
    assert graphs.buckets.entries == entries  # and made none
    graphs.mode = "off"
    for a, b in zip(_run_staggered(pipe, reqs), served, strict=True):
        assert _close(b, a)
    gc.collect()


def test_an_eager_step_releases_the_bound_sources() -> None:
    """Once a step runs outside the buckets (here a template's capture run), the last bucket's
    tables are zeroed and its cache stacks no longer referenced, so an evicted template's memory
    can go."""
    pipe = _pipe("flux-fill")
    graphs = _bucketed(pipe)
    key = _template(pipe, 1)
    state = pipe.preprocess(_edit("a", key, (0.125, 0.125, 0.375, 0.375), 3))
    pipe.denoise_step([state])
    (entry,) = graphs.buckets.entries.values()
    assert entry.bound.key is not None and bool(entry.bound.base.any())
    assert entry.bound._sources
    _template(pipe, 2)  # its capture steps run eagerly
    assert entry.bound.key is None and not entry.bound._sources
    assert not bool(entry.bound.base.any())


def test_serving_takes_the_lowest_captured_rung_and_skips_failed_ones() -> None:
    """A step whose own rung has no graph replays the lowest captured rung above it (more
    pads, the same result); a bucket whose capture failed is never used: the plain path."""
    pipe = _pipe("flux-fill")
    ex = pipe.family.masked
    graphs = _bucketed(pipe)
    key = _template(pipe, 1)
    req = _edit("a", key, (0.125, 0.125, 0.375, 0.375), 3)
    ex.graphs.mode = "off"
    (plain,) = _run_staggered(pipe, [req])
    ex.graphs.mode = "all"
    top = len(buckets.RUNGS) - 1
    ex.bucket_min_rung = top  # the warm-up's forcing: only the top rung gets an entry
    _run_staggered(pipe, [req])
    ex.bucket_min_rung = 0
    ((bucket, *_),) = graphs.buckets.entries
    assert bucket.rung == top
    graphs.warming = False
    before = graphs.counters["warmup"]
    (served,) = _run_staggered(pipe, [req])
    assert graphs.counters["warmup"] - before == STEPS and len(graphs.buckets.entries) == 1
    assert torch.equal(served, plain)
    (entry,) = graphs.buckets.entries.values()
    entry.failed = True
    before = graphs.counters["eager"]
    (eager,) = _run_staggered(pipe, [req])
    assert graphs.counters["eager"] - before == STEPS and torch.equal(eager, plain)


def test_a_finished_member_releases_the_binding() -> None:
    """When a member's last step is done its handle closes next (its memory is freed and no
    longer counted): no binding may still name its stacks."""
    pipe = _pipe("flux-fill")
    graphs = _bucketed(pipe)
    state = pipe.preprocess(_edit("a", _template(pipe, 1), (0.125, 0.125, 0.375, 0.375), 3))
    while state.step_index < STEPS - 1:
        pipe.denoise_step([state])
    (entry,) = graphs.buckets.entries.values()
    assert entry.bound.key is not None
    pipe.denoise_step([state])
    assert state.is_done and entry.bound.key is None and not entry.bound._sources


def test_a_source_the_kernel_cannot_read_is_not_bound() -> None:
    """A stack whose step slice is not contiguous: bind refuses (the step runs eagerly)."""

    class Handle:
        device = torch.device("cpu")

        def block_steps(self, block, device):
            return torch.zeros(3, 2, 8, 4).transpose(2, 3)  # (S, rows, C, L) viewed as (L, C)

    rows = [context.RequestRows(start=0, num_rows=2, step=1, handle=Handle(),
                                token_index={32: torch.tensor([0])})]  # fmt: skip
    ctx = context.StepContext(rows, torch.device("cpu"))
    bound = bound_rows.BoundRows(1, 2, torch.device("cpu"), kernel=False)
    assert bound.bind(ctx, [0], "key") is False and bound.key is None
    assert not bool(bound.base.any())


def _convs_pipe(sparse: str) -> EditPipeline:
    from instgenie.config import ExecConfig

    return EditPipeline.load("sdxl-inpaint:tiny", execution=ExecConfig(sparse_convs=sparse))


def _count_tiles(monkeypatch) -> list[int]:
    """Calls of the sparse conv blocks' tile forward (one per conv block and step with tiles)."""
    from instgenie.engine.masked import sparse_convs

    calls: list[int] = []
    tiles_forward = sparse_convs.tiles_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return tiles_forward(*args, **kwargs)

    monkeypatch.setattr(sparse_convs, "tiles_forward", counting)
    return calls


def test_a_bucketed_step_computes_the_tiles_values_on_whole_maps(monkeypatch) -> None:
    """With sparse convs, a step that takes a bucket runs each conv block on whole maps inside
    the graph (tiles have no fixed shape), normalised with the template's statistics, and keeps
    the masked tokens: staggered joins and leaves (templates, a full-path row, a no-CFG row
    mixed) equal the eager tiles of the plain path, and only the step of all five (no bucket)
    computes tiles."""
    on = _convs_pipe("auto")
    convs = on.family.masked.convs
    assert convs is not None
    reqs = _requests(on)  # (captures its templates)
    on.family.masked.graphs.mode = "off"
    tiles = _count_tiles(monkeypatch)
    plain = _run_staggered(on, reqs)
    assert tiles
    graphs = _bucketed(on)
    tiles.clear()
    bucketed = _run_staggered(on, reqs)
    assert graphs.counters["eager"] == 1 and graphs.counters["warmup"] >= len(reqs) + 1
    assert 0 < len(tiles) <= len(convs.blocks)  # the eager step's (whole maps where they pay)
    ctx = on.family.masked.last_context
    assert not ctx.compute_all & set(convs.blocks) and set(ctx.masked_blocks) >= set(convs.blocks)
    for a, b in zip(plain, bucketed, strict=True):
        assert _close(b, a)


def test_an_edit_does_not_depend_on_its_batch_mates_with_sparse_convs(monkeypatch) -> None:
    """An edit alone takes a bucket (whole maps in the graph); with four batch-mates the step has
    no bucket and computes tiles eagerly. Its result is the same; so is a bucketed step whose
    plan says "compute all" for the conv blocks (a bucket prices them the same either way). (An
    eager plan that says "compute all" for them, which the planner makes only to avoid host
    loads, runs their stock forward: decision 0054.)"""
    on = _convs_pipe("auto")
    key = _template(on, 1)
    graphs = _bucketed(on)
    boxes = [(0.1 * i, 0.1, 0.1 * i + 0.25, 0.35) for i in range(buckets.MAX_REQUESTS + 1)]
    edits = [_edit(f"e{i}", key, box, 10 + i) for i, box in enumerate(boxes)]
    tiles = _count_tiles(monkeypatch)

    def run(reqs, compute_all=frozenset()):
        from instgenie.scheduler.step import StepPlan, members_of

        states = [on.preprocess(r) for r in reqs]
        for i in range(STEPS):
            plan = StepPlan(index=i, members=members_of(states), compute_all=compute_all)
            on.denoise_step(states, plan)
        return states[0].latents

    alone = run(edits[:1])
    assert not tiles and graphs.counters["eager"] == 0
    graphs.warming = False  # serving: no bucket for five requests
    together = run(edits)
    assert tiles and graphs.counters["eager"] == STEPS
    assert _close(together, alone)
    told = run(edits[:1], frozenset(on.family.masked.convs.blocks))
    assert graphs.counters["eager"] == STEPS and _close(told, alone)


def test_a_step_without_a_bucket_still_computes_sparse_tiles(monkeypatch) -> None:
    """Serving more requests than buckets are captured for: the step has no bucket and runs
    eagerly, its conv blocks on their tiles with the template's statistics (what sparse convs
    exist for at large batches)."""
    on = _convs_pipe("auto")
    graphs = _bucketed(on, warming=False)
    key = _template(on, 1)
    boxes = [(0.1 * i, 0.1, 0.1 * i + 0.25, 0.35) for i in range(buckets.MAX_REQUESTS + 1)]
    states = [on.preprocess(_edit(f"e{i}", key, box, 10 + i)) for i, box in enumerate(boxes)]
    eager = graphs.counters["eager"]
    calls = _count_tiles(monkeypatch)
    on.denoise_step(states)
    assert calls and graphs.counters["eager"] == eager + 1 and graphs.counters["warmup"] == 0
    assert not on.family.masked.last_context.compute_all


def test_the_warm_up_makes_buckets_with_sparse_convs() -> None:
    """With sparse convs on, the warm-up still makes the buckets serving replays (their conv
    blocks on whole maps), so a served edit that fits one never runs its small batch eagerly."""
    on = _convs_pipe("auto")
    graphs = _bucketed(on, warming=False)
    report = warmup.warm_up(on, max_batch=1)
    assert report is not None and len(graphs.buckets.entries) >= 1


def test_a_large_mask_computes_the_same_in_a_bucket_and_in_a_large_batch(monkeypatch) -> None:
    """Masks of about half the image, on cells of the coarsest grid: their tiles would cover the
    maps, so a large eager batch of them computes whole maps there (the same values as tiles)
    and keeps the result the edit has alone in a bucket. (That the planner leaves such conv
    blocks masked rather than "compute all", which would run the stock forward with the
    edit's own statistics: tests/scheduler/test_pricing.py; this pipeline has no profile.)"""
    on = _convs_pipe("auto")
    key = _template(on, 1)
    graphs = _bucketed(on)
    big = _edit("big", key, (0.0, 0.0, 0.75, 0.625), 5)
    mates = [_edit(f"m{i}", key, (0.0, 0.0, 0.75, 0.625), 6 + i) for i in range(4)]
    tiles = _count_tiles(monkeypatch)

    def run(reqs) -> torch.Tensor:
        states = [on.preprocess(r) for r in reqs]
        while not all(s.is_done for s in states):
            on.denoise_step(states)
        return states[0].latents

    alone = run([big])
    assert graphs.counters["eager"] == 0 and not tiles
    graphs.warming = False  # serving: no bucket for five requests
    together = run([big, *mates])
    blocks = len(on.family.masked.convs.blocks)
    assert graphs.counters["eager"] == STEPS and 0 < len(tiles) < STEPS * blocks
    assert _close(together, alone)


def test_a_capture_after_the_eager_run_rebuilds_the_steps_derived_tensors() -> None:
    """CUDA captures a bucket right after running its graph form eagerly on the same context.
    What that run built from the step's own sets (the template's decoded statistics, joint
    sets) must be rebuilt inside the capture, or the graph would replay that one step's
    statistics for every later step (tests/engine/test_gpu_bucket_graphs.py replays it)."""
    from instgenie.engine.bucket_graphs import BucketGraphs

    on = _convs_pipe("auto")
    key = _template(on, 1)
    graphs = _bucketed(on)
    state = on.preprocess(_edit("e", key, (0.1, 0.1, 0.4, 0.5), 3))
    on.denoise_step([state])
    ctx = on.family.masked.last_context
    assert ctx._stats_in is not None and ctx._joint  # built by the step
    (entry,) = graphs.buckets.entries.values()
    BucketGraphs._use(entry, ctx)
    assert ctx._stats_in is None and not ctx._joint
    assert all(ctx._tokens[L] is entry.tokens[L] for L in entry.tokens)


def test_a_mask_covering_a_coarse_grid_uses_its_own_statistics_in_a_bucket(monkeypatch) -> None:
    """A dot every 16 px touches every token of the coarsest grid (16-px cells) and a quarter of
    the finest (8 px): that cache-reading row computes the coarse conv blocks with its own
    statistics (TokenSet.full_rows; the tiles' dense_rows), in a bucket (with two small edits,
    so the batch fits a rung) as in eager tiles."""
    from PIL import Image, ImageDraw

    on = _convs_pipe("auto")
    key = _template(on, 1)
    dots = Image.new("L", (128, 128), 0)
    for y in range(4, 128, 16):
        for x in range(4, 128, 16):
            ImageDraw.Draw(dots).rectangle([x, y, x + 1, y + 1], fill=255)
    edits = [
        dataclasses.replace(_edit("dots", key, (0, 0, 1, 1), 5), mask=png_bytes(dots)),
        _edit("s1", key, (0.1, 0.1, 0.3, 0.3), 6),
        _edit("s2", key, (0.6, 0.5, 0.8, 0.7), 7),
    ]
    probe = on.preprocess(edits[0])
    coarse = min(probe.token_index)
    assert probe.token_index[coarse].numel() == coarse  # the whole coarse grid
    assert max(n.numel() / L for L, n in probe.token_index.items() if L != coarse) < 0.5

    def run() -> list[torch.Tensor]:
        states = [on.preprocess(r) for r in edits]
        while not all(s.is_done for s in states):
            on.denoise_step(states)
        return [s.latents for s in states]

    on.family.masked.graphs.mode = "off"
    tiles = run()
    graphs = _bucketed(on)
    bucketed = run()
    assert graphs.counters["warmup"] == STEPS and graphs.counters["eager"] == 0
    full_rows = on.family.masked.last_context.tokens(coarse).full_rows
    assert full_rows is not None and full_rows.tolist()[:2] == [True, True]  # its CFG rows
    assert not any(full_rows.tolist()[2:])
    for a, b in zip(tiles, bucketed, strict=True):
        assert _close(b, a)
