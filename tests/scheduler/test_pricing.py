"""scheduler.pricing.step_costs, the one function that prices a step's blocks (worker and router),
on a synthetic spec: kinds priced once and expanded in block order, loads one copy per request,
and the cost invariants checked on that path too."""

from __future__ import annotations

import dataclasses
import math

import pytest

from instgenie.scheduler.fits import LinearFit
from instgenie.scheduler.planner import BlockCosts
from instgenie.scheduler.pricing import (
    NOMINAL_FLOPS_PER_MS,
    RequestWork,
    batch_flops,
    cached_bytes,
    step_costs,
)
from instgenie.scheduler.spec import BlockSpec, CostSpec

BLOCKS = [
    BlockSpec(block_id=i, kind="unet", channels=c, ff_macs=12 * c * c, context_dim=c, stride=s)
    for i, (c, s) in enumerate([(320, 16), (640, 32), (320, 16), (640, 32)])
]
SPEC = CostSpec(
    model="synthetic", granule=32, text_len=77, cfg=True, default_guidance=7.5,
    default_steps=20, cache_dtype="float16", blocks=BLOCKS,
)  # fmt: skip
PX = 512 * 512
TOKENS = ((16, 100), (32, 30))


def test_without_fits_each_block_costs_its_nominal_flops_in_block_order() -> None:
    works = [RequestWork(2, TOKENS), RequestWork(1, None)]
    costs = step_costs(SPEC, PX, works)
    for b, cached, full in zip(BLOCKS, costs.compute_cached, costs.compute_full, strict=True):
        L = PX // b.stride**2
        n = dict(TOKENS)[b.stride]
        assert cached == batch_flops(b, L, [n, n, L], 77) / NOMINAL_FLOPS_PER_MS
        assert full == batch_flops(b, L, [L, L, L], 77) / NOMINAL_FLOPS_PER_MS
    assert costs.load == (0.0,) * 4
    # nothing reads a cache: the masked compute is the full compute
    none = step_costs(SPEC, PX, [RequestWork(2, None)])
    assert none.compute_cached == none.compute_full


def test_host_loads_are_one_copy_per_request() -> None:
    """Two loading requests of one row each pay the load fit's intercept twice (the router once
    priced the batch's bytes in one copy and drifted from the worker)."""
    dram = LinearFit(slope=1e-6, intercept=0.5)
    spec = dataclasses.replace(SPEC, load={"dram": dram})
    costs = step_costs(spec, PX, [RequestWork(1, TOKENS, True), RequestWork(1, TOKENS, True),
                                  RequestWork(2, TOKENS, False)])  # fmt: skip
    for b, load in zip(BLOCKS, costs.load, strict=True):
        one = dram.predict(cached_bytes(PX // b.stride**2, b.channels, 1, "float16"))
        assert load == 2 * one


def test_from_kinds_equals_the_checked_constructor_and_keeps_its_invariants() -> None:
    kinds = [(1.0, 2.0, 0.5), (3.0, 4.0, 0.0)]
    seq = (0, 1, 1, 0)
    got = BlockCosts.from_kinds(kinds, seq)
    assert got == BlockCosts(*(tuple(kinds[k][j] for k in seq) for j in range(3)))
    for bad in ((math.nan, 1.0, 0.0), (1.0, -1.0, 0.0), (1.0, math.inf, 0.0)):
        with pytest.raises(ValueError):
            BlockCosts.from_kinds([bad], (0,))
    with pytest.raises(ValueError, match="overflows"):
        BlockCosts.from_kinds([(1e308, 1.0, 0.0)], (0, 0))


def test_bucket_graphs_price_the_pads_of_the_steps_bucket() -> None:
    """A worker with bucket graphs (CostSpec.buckets) runs a masked step padded to its bucket's
    capacity on every grid (scheduler/buckets.py): the cached compute is priced at the padded
    tokens, the full compute is not, and steps that run eagerly are priced unpadded."""
    spec = dataclasses.replace(SPEC, buckets=True)
    works = [RequestWork(2, TOKENS)]  # 100 of 1024 and 30 of 256 tokens a row, two rows
    # ratios 200/2048 and 60/512: rung 5 (0.04 * 1.25**5 = 0.122) is the lowest holding both
    cap16, cap32 = math.ceil(0.04 * 1.25**5 * 2048), math.ceil(0.04 * 1.25**5 * 512)
    assert (cap16, cap32) == (250, 63)
    padded = {16: [150, 100], 32: [33, 30]}  # pads fill rows in order, up to L each
    got, plain = step_costs(spec, PX, works), step_costs(SPEC, PX, works)
    for b, cached, was in zip(BLOCKS, got.compute_cached, plain.compute_cached, strict=True):
        L = PX // b.stride**2
        assert cached == batch_flops(b, L, padded[b.stride], 77) / NOMINAL_FLOPS_PER_MS
        assert cached > was
    assert got.compute_full == plain.compute_full
    eager = [
        [RequestWork(1, TOKENS)] * 5,  # more requests than buckets are captured for
        [RequestWork(2, TOKENS, loads=True)],  # rows streamed from the host every step
        [RequestWork(2, ((16, 700), (32, 200)))],  # above the top rung (0.5)
    ]
    for batch in eager:
        assert step_costs(spec, PX, batch) == step_costs(SPEC, PX, batch)
    conv = BlockSpec(block_id=4, kind="resnet", channels=320, ff_macs=0, stride=16,
                     in_channels=320)  # fmt: skip
    convs = dataclasses.replace(SPEC, blocks=[*BLOCKS, conv])
    assert step_costs(dataclasses.replace(convs, buckets=True), PX, works) == step_costs(
        convs, PX, works
    )
