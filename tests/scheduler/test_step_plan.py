"""The step as an explicit value: StepPlan's invariants, the executor honouring the plan it is
given (compute-all set, timing, graph use), and no component passing a step's inputs by setting
another's attributes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.scheduler.step import GraphUse, Member, StepPlan, horizon_of, members_of
from tests.conftest import make_image, make_mask, png_bytes, tiny_pipeline

ROOT = Path(__file__).resolve().parents[2]


def test_plan_invariants_are_checked() -> None:
    a, b = Member("a", 0, 4), Member("b", 3, 4)
    plan = StepPlan(index=7, members=(a, b), joined=("a",), horizon=1, compute_all={2, 1})
    assert plan.compute_all == frozenset({1, 2}) and plan.leaving == ("b",) and plan.may_graph
    assert not dataclasses.replace(plan, timed=True).may_graph
    assert not dataclasses.replace(plan, graph=GraphUse.EAGER).may_graph
    with pytest.raises(ValueError, match="duplicate"):
        StepPlan(index=0, members=(a, a))
    with pytest.raises(ValueError, match="no step left"):
        StepPlan(index=0, members=(Member("c", 4, 4),))
    with pytest.raises(ValueError, match="joined"):
        StepPlan(index=0, members=(a,), joined=("z",))
    with pytest.raises(ValueError, match="horizon"):
        StepPlan(index=0, members=(a,), horizon=0)
    assert horizon_of([a, b]) == 1 and horizon_of([a]) == 4 and horizon_of([]) is None


def _edit(pipe):
    img, mask = png_bytes(make_image(64, 64, seed=5)), png_bytes(make_mask(64, 64))
    common = dict(prompt="a hat", seed=3, num_inference_steps=3)
    key = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
    return pipe.preprocess(EditRequest(uid="e", image=None, template_id=key, mask=mask, **common))


def test_the_executor_runs_the_plan_it_is_given() -> None:
    pipe = tiny_pipeline("sd2-inpaint")
    ex = pipe.family.masked
    s = _edit(pipe)
    assert s.path == "masked"
    every = frozenset(ex.block_order)
    pipe.prepare_reads([s])
    pipe.denoise_step([s], StepPlan(index=0, members=members_of([s]), compute_all=every))
    assert ex.last_context.compute_all == every and ex.last_context.masked_blocks == []
    pipe.prepare_reads([s])
    pipe.denoise_step([s], StepPlan(index=1, members=members_of([s]), timed=True))
    ctx = ex.last_context
    assert ctx.compute_all == frozenset() and len(ctx.masked_blocks) == ex.num_blocks
    assert set(ctx.timer.results_ms()) == set(ex.block_order)  # timed: every block
    # a plan for other members (or other step indices) is refused before anything runs
    stale = StepPlan(index=2, members=(Member("e", 0, 3),))
    with pytest.raises(ValueError, match="planned"):
        pipe.denoise_step([s], stale)
    assert s.step_index == 2


def test_eager_plans_never_enter_the_graph_path() -> None:
    pipe = tiny_pipeline("sd2-inpaint")
    graphs = pipe.family.masked.graphs
    s = _edit(pipe)
    graphs.force_static = True  # the graph form on CPU: eligible calls are graph warm-ups
    graphs.capture = "auto"  # compositions captured while serving (buckets: only at start)
    try:
        before = dict(graphs.counters)
        pipe.prepare_reads([s])
        eager = StepPlan(index=0, members=members_of([s]), graph=GraphUse.EAGER)
        pipe.denoise_step([s], eager)
        assert graphs.counters["eager"] == before["eager"] + 1
        assert graphs.counters["warmup"] == before["warmup"]
        pipe.denoise_step([s])  # a plan made by the pipeline: graphs allowed
        assert graphs.counters["warmup"] == before["warmup"] + 1
    finally:
        graphs.force_static, graphs.capture = False, pipe.family.execution.graph_capture
        pipe.release(s)


#: assignments that would pass a step's inputs through another component's attributes
_SIDE_CHANNELS = re.compile(
    r"(masked|graphs|executor|\bex)\.(compute_all|planner|horizon|timer_factory|store)\s*=[^=]"
)


def test_no_component_sets_a_step_input_on_another() -> None:
    hits = []
    roots = ("instgenie", "bench", "tests")  # tests too: they pass plans, not attributes
    for path in [p for r in roots for p in ROOT.joinpath(r).rglob("*.py") if p != Path(__file__)]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _SIDE_CHANNELS.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
