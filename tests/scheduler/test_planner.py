"""Load planner (instgenie.scheduler.planner): the pipeline model, the exact optimiser against brute
force, the paper's greedy Algorithm 1, the two regimes of §4.2, speed, and input validation.

Realistic costs (`sdxl_costs`, `flux_costs`) are derived from the H200 masked-step benchmarks in
docs/benchmarks/data/ (batch 4, 1024x1024):
- SDXL: 144.7 ms full step of which 43.2 ms outside transformer blocks -> ~101 ms over 70 blocks;
  the 10 blocks at 4096 tokens x 640 channels have ~1.57x the FLOPs of the 60 at 1024 x 1280,
  so compute_full ~ 2.1 ms / 1.33 ms; masked/full transformer time ~ 0.2 + 0.8 * mask ratio
  (bench: 0.28 at 0.05, 0.46 at 0.35, 0.59 at 0.5); cached rows: batch x 2 CFG rows x tokens x
  channels x 2 bytes (fp16) x (1 - mask ratio) over a host->GPU bandwidth (PCIe 5: ~50 GB/s).
- Flux: ~676 ms over 19 double-stream blocks (~2x the FLOPs of a single-stream one) and 38
  single-stream blocks -> 17.8 ms / 8.9 ms; masked/full ~ 0.34 + 0.73 * mask ratio; cached rows:
  batch x 4608 tokens x 3072 channels x 2 bytes (bf16) x (1 - mask ratio).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from instgenie.scheduler.planner import (
    PLAN_STEP_FRONT_CAP,
    BlockCosts,
    Plan,
    greedy_plan,
    optimal_plan,
    plan_step,
    simulate,
)

# ---------------------------------------------------------------------------------- helpers


def brute_force(costs: BlockCosts) -> float:
    """Minimum of `simulate` over all 2^N plans."""
    return min(
        simulate(p, costs) for p in itertools.product((False, True), repeat=costs.num_blocks)
    )


def uniform(n: int, cached: float, full: float, load: float, start: float = 0.0) -> BlockCosts:
    return BlockCosts((cached,) * n, (full,) * n, (load,) * n, start)


def sdxl_costs(
    mask_ratio: float,
    batch: int = 4,
    gbps: float = 50.0,
    noise: float = 0.0,
    rng: random.Random | None = None,
) -> BlockCosts:
    """SDXL-like per-block costs (ms) of one step; `noise` = relative per-block jitter."""
    rng = rng or random.Random(0)
    cached, full, load = [], [], []
    for i in range(70):
        hires = i < 4 or i >= 64  # down_blocks.1 (4 blocks) and up_blocks.2 (6 blocks)
        tokens, channels = (4096, 640) if hires else (1024, 1280)
        f = (2.1 if hires else 1.33) * batch / 4
        mb = batch * 2 * tokens * channels * 2 / 1e6 * (1 - mask_ratio)

        def jit() -> float:
            return 1.0 + rng.uniform(-noise, noise)

        full.append(f * jit())
        cached.append(f * (0.2 + 0.8 * mask_ratio) * jit())
        load.append(mb / gbps * jit())  # MB / (GB/s) = ms
    return BlockCosts(cached, full, load)


def flux_costs(
    mask_ratio: float,
    batch: int = 4,
    gbps: float = 50.0,
    noise: float = 0.0,
    rng: random.Random | None = None,
) -> BlockCosts:
    """Flux-like per-block costs (ms) of one step (19 double- + 38 single-stream blocks)."""
    rng = rng or random.Random(0)
    cached, full, load = [], [], []
    mb = batch * 4608 * 3072 * 2 / 1e6 * (1 - mask_ratio)
    for i in range(57):
        f = (17.8 if i < 19 else 8.9) * batch / 4

        def jit() -> float:
            return 1.0 + rng.uniform(-noise, noise)

        full.append(f * jit())
        cached.append(f * min(1.0, 0.34 + 0.73 * mask_ratio) * jit())
        load.append(mb / gbps * jit())
    return BlockCosts(cached, full, load)


# ------------------------------------------------------------------------------ simulate


def test_simulate_hand_examples() -> None:
    # 1. all full: loads are irrelevant, latency = sum of compute_full = 1 + 2 + 3
    c = BlockCosts((0.5, 0.5, 0.5), (1.0, 2.0, 3.0), (9.0, 9.0, 9.0))
    assert simulate((False, False, False), c) == 6.0
    # 2. all cache, copy-bound: load_end 2 -> comp max(0, 2) + 1 = 3; load_end 4 ->
    #    comp max(3, 4) + 1 = 5
    c = BlockCosts((1.0, 1.0), (5.0, 5.0), (2.0, 2.0))
    assert simulate((True, True), c) == 5.0
    # 3. mixed, copy stream busy until 1.5: block 0 load_end 4.5, comp 4.5 + 1 = 5.5;
    #    block 1 full: comp 9.5; block 2 load_end 6.5, comp max(9.5, 6.5) + 1 = 10.5
    c = BlockCosts((1.0, 1.0, 1.0), (4.0, 4.0, 4.0), (3.0, 1.0, 2.0), load_start=1.5)
    assert simulate((True, False, True), c) == 10.5
    # plans may be lists, 0/1 ints
    assert simulate([1, 0, 1], c) == 10.5
    # empty model
    assert simulate((), BlockCosts((), (), ())) == 0.0


# --------------------------------------------------------------------- exact vs brute force


def _value(rng: random.Random) -> float:
    r = rng.random()
    if r < 0.15:
        return 0.0
    if r < 0.35:
        return float(rng.randint(1, 3))  # small integers: many exact ties
    if r < 0.40:
        return 1e6  # huge
    return rng.uniform(0.0, 5.0)


def test_exact_equals_brute_force_seeded() -> None:
    rng = random.Random(1234)
    for trial in range(400):
        n = 12 if trial < 12 else rng.randint(0, 9)
        start = rng.choice((0.0, 0.0, float(rng.randint(1, 4)), rng.uniform(0.0, 10.0)))
        c = BlockCosts(
            [_value(rng) for _ in range(n)],
            [_value(rng) for _ in range(n)],
            [_value(rng) for _ in range(n)],
            start,
        )
        p = optimal_plan(c)
        assert p.exact
        assert p.latency_ms == brute_force(c), c  # bit-equal: the DP's clocks are simulate's
        assert p.latency_ms == simulate(p.use_cache, c)
        # the bounded search is never better than the optimum, and equal when it says exact
        q = plan_step(c, front_cap=2)
        assert q.latency_ms >= p.latency_ms
        assert q.latency_ms == simulate(q.use_cache, c)
        if q.exact:
            assert q.latency_ms == p.latency_ms
        assert q.latency_ms <= min(greedy_plan(c).latency_ms, p.all_cache_ms, p.all_full_ms)


_cost = st.one_of(
    st.just(0.0),
    st.sampled_from((1.0, 2.0, 3.0)),
    st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False),
    st.just(1e6),
)


@st.composite
def _instances(draw: st.DrawFn) -> BlockCosts:
    n = draw(st.integers(0, 8))
    triples = draw(st.lists(st.tuples(_cost, _cost, _cost), min_size=n, max_size=n))
    start = draw(st.one_of(st.just(0.0), st.floats(0.0, 20.0)))
    return BlockCosts(
        [t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples], start
    )


@settings(max_examples=300, deadline=None)
@given(_instances())
def test_exact_equals_brute_force_hypothesis(c: BlockCosts) -> None:
    p = optimal_plan(c)
    assert p.exact
    assert p.latency_ms == brute_force(c)
    assert p.latency_ms <= min(greedy_plan(c).latency_ms, p.all_cache_ms, p.all_full_ms)


def test_special_cases() -> None:
    # zero loads: every block takes min(cached, full), no stall ever
    c = BlockCosts((1.0, 5.0, 2.0), (3.0, 4.0, 2.0), (0.0, 0.0, 0.0))
    p = optimal_plan(c)
    assert p.latency_ms == 1.0 + 4.0 + 2.0
    assert p.use_cache == (True, False, True)  # the tie at block 2 goes to the cache
    # zero compute with the cache: the latency is the copy stream's, unless full is cheaper
    c = BlockCosts((0.0, 0.0), (10.0, 10.0), (3.0, 3.0))
    assert optimal_plan(c).latency_ms == 6.0
    # huge loads: never worth it
    c = uniform(5, 0.1, 1.0, 1e6)
    p = optimal_plan(c)
    assert p.use_cache == (False,) * 5 and p.latency_ms == 5.0
    # a busy copy stream (load_start) pushes the cache out of the first blocks
    c = uniform(4, 0.5, 2.0, 1.0, start=5.0)
    p = optimal_plan(c)
    assert p.latency_ms == brute_force(c)
    assert p.use_cache[0] is False
    # empty
    p = optimal_plan(BlockCosts((), (), ()))
    assert p.use_cache == () and p.latency_ms == 0.0 and p.exact


# ---------------------------------------------------------------------- the two regimes


def test_small_masks_are_copy_bound() -> None:
    """Mask ratio 0.05: loads (0.40 ms per low-res block) exceed the cached compute (0.32 ms),
    so the copy stream is the bottleneck and some blocks should compute all."""
    c = sdxl_costs(0.05)
    assert sum(c.load) > sum(c.compute_cached)
    p = optimal_plan(c)
    assert p.exact and False in p.use_cache
    assert p.latency_ms < p.all_cache_ms < p.all_full_ms
    assert p.latency_ms <= greedy_plan(c).latency_ms
    q = plan_step(c)
    assert q.latency_ms == p.latency_ms  # the bounded search finds the optimum here
    # a slower link (PCIe 4, 25 GB/s): many more blocks compute all
    c = sdxl_costs(0.05, gbps=25.0)
    p25 = optimal_plan(c)
    assert len(p25.compute_all) > len(p.compute_all)
    assert p25.latency_ms < 0.75 * p25.all_cache_ms


def test_large_masks_are_compute_bound() -> None:
    """Mask ratio 0.5: loads (0.21 ms per low-res block) hide behind the cached compute
    (0.80 ms); the first block's load + cached compute (0.42 + 1.26 ms) still beats computing it
    all (2.1 ms): every block uses the cache."""
    for c in (sdxl_costs(0.5), sdxl_costs(0.7), flux_costs(0.5), flux_costs(0.05)):
        p = optimal_plan(c)
        assert p.use_cache == (True,) * c.num_blocks
        assert p.latency_ms == p.all_cache_ms < p.all_full_ms
        assert plan_step(c).use_cache == p.use_cache
        assert greedy_plan(c).use_cache == p.use_cache


# ---------------------------------------------------------------------------------- greedy


def test_greedy_reproduces_algorithm_1() -> None:
    # C_w = 1, C_wo = 2, L = 3 for 5 blocks; Algorithm 1 step by step (comp, load after block):
    # 1: max(0+3, 0)+1 = 4 > 0+2 -> full   (2, 0)
    # 2: max(0+3, 2)+1 = 4 <= 2+2 -> cache (4, 3)   [tie -> cache]
    # 3: max(3+3, 4)+1 = 7 > 4+2 -> full   (6, 3)
    # 4: max(3+3, 6)+1 = 7 <= 6+2 -> cache (7, 6)
    # 5: max(6+3, 7)+1 = 10 > 7+2 -> full  (9, 6)
    g = greedy_plan(uniform(5, 1.0, 2.0, 3.0))
    assert g.use_cache == (False, True, False, True, False)
    assert g.latency_ms == 9.0
    assert g.all_cache_ms == 16.0 and g.all_full_ms == 10.0
    assert not g.exact
    # per-block constants and a busy copy stream (load_start = 1):
    # 1: max(1+1, 0)+1 = 3 <= 0+4 -> cache (3, 2)
    # 2: max(2+5, 3)+0 = 7 > 3+3 -> full  (6, 2)
    # 3: max(2+2, 6)+2 = 8 <= 6+2 -> cache (8, 4)   [tie -> cache]
    c = BlockCosts((1.0, 0.0, 2.0), (4.0, 3.0, 2.0), (1.0, 5.0, 2.0), load_start=1.0)
    g = greedy_plan(c)
    assert g.use_cache == (True, False, True) and g.latency_ms == 8.0
    assert g.latency_ms == simulate(g.use_cache, c)


def test_greedy_is_not_optimal() -> None:
    """Block 0 saves 1 ms with a 9 ms load, which greedy takes; that load delays block 1's
    (whose cache saves 100 ms) by 9 ms. Greedy: cache, cache -> max(9 + 5, 9) + 0 = 14 ms;
    optimum: full, cache -> max(0 + 5, 10) + 0 = 10 ms."""
    c = BlockCosts((0.0, 0.0), (10.0, 100.0), (9.0, 5.0))
    g, p = greedy_plan(c), optimal_plan(c)
    assert g.use_cache == (True, True) and g.latency_ms == 14.0
    assert p.use_cache == (False, True) and p.latency_ms == 10.0 == brute_force(c)
    # on a realistic copy-bound step the gap is large
    c = sdxl_costs(0.05, gbps=25.0)
    assert optimal_plan(c).latency_ms < 0.8 * greedy_plan(c).latency_ms


# ---------------------------------------------------------------------------------- speed


def _realistic(rng: random.Random) -> BlockCosts:
    make = rng.choice((sdxl_costs, flux_costs))
    ratio = rng.choice((rng.uniform(0.01, 0.2), rng.uniform(0.01, 0.9)))
    return make(
        ratio,
        batch=rng.choice((1, 2, 4, 8)),
        gbps=rng.choice((16.0, 25.0, 50.0)),
        noise=rng.choice((0.0, 0.0, 0.02)),  # 0: per-class fits; 0.02: per-block fits
        rng=rng,
    )


def _median_ms(fn, instances: list[BlockCosts]) -> tuple[float, float]:
    times = []
    for c in instances:
        t0 = time.perf_counter()
        fn(c)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), 1e3 * max(times)


def test_plan_step_speed() -> None:
    """Median over 50 realistic steps (SDXL N = 70 and Flux N = 57); the bound is generous for
    slow shared CI machines: ~0.2 ms median on one laptop-class core."""
    rng = random.Random(7)
    instances = [_realistic(rng) for _ in range(50)]
    sdxl = [c for c in instances if c.num_blocks == 70]
    flux = [c for c in instances if c.num_blocks == 57]
    assert sdxl and flux
    median_ms, max_ms = _median_ms(plan_step, instances)
    fronts = [plan_step(c).max_front for c in instances]
    print(
        f"\nplan_step (cap {PLAN_STEP_FRONT_CAP}): median {median_ms:.3f} ms, max {max_ms:.3f} ms;"
        f" sdxl median {_median_ms(plan_step, sdxl)[0]:.3f} ms,"
        f" flux median {_median_ms(plan_step, flux)[0]:.3f} ms;"
        f" front median {statistics.median(fronts)}, max {max(fronts)}"
    )
    assert median_ms < 5.0
    # the exact DP on class-structured costs (equal costs for blocks of one class)
    structured = []
    for _ in range(50):
        ratio, gbps, batch = rng.uniform(0.01, 0.9), rng.choice((16.0, 25.0, 50.0)), 4
        structured.append(sdxl_costs(ratio, batch=batch, gbps=gbps))
    median_ms, max_ms = _median_ms(optimal_plan, structured)
    fronts = [optimal_plan(c).max_front for c in structured]
    print(
        f"optimal_plan, SDXL class-structured: median {median_ms:.3f} ms, max {max_ms:.3f} ms;"
        f" front median {statistics.median(fronts)}, max {max(fronts)}"
    )
    assert median_ms < 5.0


def test_plan_step_quality() -> None:
    """The bounded search against the exact optimum on realistic inputs (class-structured
    costs: optimal; per-block jitter: within 1 %)."""
    rng = random.Random(3)
    for trial in range(20):
        noise = 0.0 if trial % 2 == 0 else 0.02
        ratio, gbps = rng.uniform(0.01, 0.4), rng.choice((16.0, 25.0, 50.0))
        c = sdxl_costs(ratio, gbps=gbps, noise=noise, rng=rng)
        q, p = plan_step(c), optimal_plan(c)
        assert p.exact
        if noise == 0.0:
            assert q.latency_ms == p.latency_ms
        assert q.latency_ms <= 1.01 * p.latency_ms


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ((1.0,), (1.0, 2.0), (1.0,)),
            "lengths differ: compute_cached has 1 blocks, compute_full 2, load 1",
        ),
        (((1.0,), (1.0,), (-0.5,)), r"BlockCosts.load[0] = -0.5: must be finite and >= 0 (ms)"),
        (((math.nan,), (1.0,), (1.0,)), "BlockCosts.compute_cached[0] = nan: must be finite"),
        (((1.0,), (math.inf,), (1.0,)), "BlockCosts.compute_full[0] = inf: must be finite"),
        (((1.0,), ("x",), (1.0,)), "BlockCosts.compute_full: expected a sequence of floats"),
        (((1.0,), (None,), (1.0,)), "BlockCosts.compute_full: expected a sequence of floats"),
        (("1", (1.0,), (1.0,)), "BlockCosts.compute_cached: expected a sequence of floats"),
        (((1.0,), (1.0,), (1.0,), -1.0), "BlockCosts.load_start = -1.0: must be finite and >= 0"),
        (((1.0,), (1.0,), (1.0,), math.inf), "BlockCosts.load_start = inf: must be finite"),
        (((1.0,), (1.0,), (1.0,), None), "BlockCosts.load_start = None: expected a float"),
        (((1e308, 1e308), (1.0, 1.0), (1.0, 1.0)), "BlockCosts.compute_cached: the sum overflows"),
    ],
)
def test_invalid_costs(args: tuple, message: str) -> None:
    with pytest.raises(ValueError) as e:
        BlockCosts(*args)
    assert message in str(e.value)


def test_invalid_plans_and_caps() -> None:
    c = BlockCosts((1.0, 1.0), (2.0, 2.0), (1.0, 1.0))
    with pytest.raises(ValueError, match=r"^plan has 3 entries but costs have 2 blocks$"):
        simulate((True, True, False), c)
    with pytest.raises(ValueError, match=r"^plan\[1\] = 2: must be a bool$"):
        simulate((True, 2), c)
    with pytest.raises(ValueError, match=r"^plan\[0\] = 'yes': must be a bool$"):
        simulate(("yes", True), c)
    with pytest.raises(ValueError, match=r"^plan\[0\] = None: must be a bool$"):
        simulate((None, True), c)
    for cap in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"front_cap = .*: must be an int >= 1 or None"):
            optimal_plan(c, front_cap=cap)  # type: ignore[arg-type]


def test_plan_fields() -> None:
    c = BlockCosts((0.0, 0.0, 0.0), (10.0, 1.0, 10.0), (1.0, 50.0, 1.0))
    p = optimal_plan(c)
    assert isinstance(p, Plan)
    assert p.use_cache == (True, False, True)
    assert p.compute_all == frozenset({1}) and p.num_cached == 2
    assert p.latency_ms == 2.0 and p.all_full_ms == 21.0 and p.all_cache_ms == 52.0
    assert p.exact and p.max_front >= 1
