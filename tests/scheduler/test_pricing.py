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
    tokens, the full compute is not, and steps that run eagerly are priced unpadded; sparse conv
    blocks are priced dense in a bucketed step, on their tiles in an eager one."""
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
    # with sparse conv blocks, a bucketed step computes them densely inside its graph (the
    # executor's rule): priced at their full compute, the transformer blocks padded as before;
    # a step that runs eagerly computes their tiles
    convs = dataclasses.replace(SPEC, blocks=[*BLOCKS, conv])
    got = step_costs(dataclasses.replace(convs, buckets=True), PX, works)
    sparse = step_costs(convs, PX, works)
    assert got.compute_cached[:4] == step_costs(spec, PX, works).compute_cached
    assert got.compute_cached[4] == got.compute_full[4] > sparse.compute_cached[4]
    for batch in eager:
        assert step_costs(dataclasses.replace(convs, buckets=True), PX, batch) == step_costs(
            convs, PX, batch
        )


def test_a_conv_block_is_never_priced_above_its_whole_map() -> None:
    """Where an edit's tiles (with their halo) would cost more than the whole map, the executor
    computes the whole map (engine/masked/conv_blocks.py, the same values): pricing takes the
    cheaper, so with free loads the planner never makes a conv block "compute all" (which would
    run the stock forward with the edit's own statistics, other values)."""
    from instgenie.scheduler.planner import plan_step
    from instgenie.scheduler.pricing import TILE_WASTE, conv_row_macs

    for stride, ci in ((16, 320), (64, 640)):  # 1024 and 64 tokens: 8x8 and 4x4 tiles
        d = BlockSpec(block_id=0, kind="resnet", channels=320, ff_macs=0, stride=stride,
                      in_channels=ci)  # fmt: skip
        L = PX // stride**2
        full = conv_row_macs(d, L, L)
        assert all(conv_row_macs(d, L, n) <= full for n in range(1, L + 1))
        n = round(0.7 * L)  # the tiles alone: 0.98 L tokens, 1.5-2.2 L with conv1's halo
        t = 8 if L >= 1024 else 4
        inner = round(TILE_WASTE * n)
        tiles = 9 * round(inner * ((t + 2) / t) ** 2) * ci * 320 + 9 * inner * 320 * 320
        tiles += inner * ci * 320 if ci != 320 else 0
        assert tiles > full == conv_row_macs(d, L, n)
    conv = BlockSpec(block_id=4, kind="resnet", channels=320, ff_macs=0, stride=64,
                     in_channels=320)  # fmt: skip
    convs = dataclasses.replace(SPEC, blocks=[*BLOCKS, conv])
    big = [RequestWork(2, ((16, 700), (32, 200), (64, 50)))] * 5  # eager: more than 4 requests
    assert 4 not in plan_step(step_costs(convs, PX, big)).compute_all
    # a profile whose masked fit runs dearer than its full one (copies, scatters): the block
    # still reads the cache, capped at the full compute (it can always compute the whole map)
    from instgenie.scheduler.spec import block_class

    k = block_class(conv)
    fitted = dataclasses.replace(
        convs,
        compute={
            f"{k}/cached": LinearFit(slope=3e-9, intercept=1),
            f"{k}/full": LinearFit(slope=1e-9, intercept=0),
        },
    )
    costs = step_costs(fitted, PX, big)
    assert costs.compute_cached[4] == costs.compute_full[4]
    assert 4 not in plan_step(costs).compute_all


def _flux_spec(kv: bool) -> CostSpec:
    """Flux.1's 19 dual and 38 single blocks (C 3072, feed-forward 4x, single MLP 4x); with
    `kv`, every block but the first is a K/V block (kv_layout.py)."""
    C = 3072
    blocks = [BlockSpec(block_id=i, kind="flux_dual", channels=C, ff_macs=2 * C * 4 * C,
                        stride=16, kv=kv and i > 0) for i in range(19)]  # fmt: skip
    blocks += [BlockSpec(block_id=19 + i, kind="flux_single", channels=C, ff_macs=0, mlp=4 * C,
                         stride=16, kv=kv) for i in range(38)]  # fmt: skip
    return CostSpec(model="flux", granule=16, text_len=512, cfg=False, default_guidance=30.0,
                    default_steps=20, cache_dtype="bfloat16", blocks=blocks, kv_cache=kv,
                    load={"dram": LinearFit(slope=1e-6, intercept=0.0)})  # fmt: skip


def test_a_kv_cache_prices_masked_keys_and_values_and_two_slabs() -> None:
    """1024², m = 0.2: a K/V block projects keys and values of its 819 masked tokens only, -24.7 %
    of a masked block's multiply-adds (dual and single alike); a host load carries keys and
    values, twice an output's bytes; the planner gets no choice (every block reads the cache,
    even where computing all tokens would be cheaper than the load)."""
    px, n = 1024 * 1024, 819
    works = [RequestWork(1, ((16, n),), True)]
    out, kv = step_costs(_flux_spec(False), px, works), step_costs(_flux_spec(True), px, works)
    for b in (1, 19):
        assert kv.compute_cached[b] / out.compute_cached[b] == pytest.approx(1 - 0.247, abs=5e-4)
        assert kv.compute_full[b] == out.compute_full[b]
        assert kv.load[b] == 2 * out.load[b]
    # the first block computes its keys and values from its own inputs, and loads its output
    assert (kv.compute_cached[0], kv.load[0]) == (out.compute_cached[0], out.load[0])
    slow = dataclasses.replace(_flux_spec(True), load={"dram": LinearFit(slope=1.0, intercept=0)})
    from instgenie.scheduler.planner import plan_step

    costs = step_costs(slow, px, works)
    assert plan_step(costs).compute_all  # the DP alone would compute every token
    plan = plan_step(costs, cache_only=True)
    assert not plan.compute_all and plan.latency_ms == plan.all_cache_ms
    from instgenie.scheduler.estimate import blocks_ms

    assert blocks_ms(costs, True, cache_only=True) == plan.latency_ms > blocks_ms(costs, True)
