"""The bucket ladder of bucketed step graphs (scheduler/buckets.py): which captured graph a
masked step replays, and how many tokens it pads."""

from __future__ import annotations

import math

import pytest

from instgenie.scheduler.buckets import (
    MAX_RATIO,
    RUNGS,
    STEP,
    Bucket,
    ladder,
    pads,
    pick,
)


def test_the_ladder_is_geometric_and_reaches_the_top_ratio() -> None:
    assert RUNGS[0] == pytest.approx(0.04)
    for lo, hi in zip(RUNGS, RUNGS[1:], strict=False):
        assert hi == pytest.approx(min(1.0, lo * STEP))
    assert RUNGS[-1] >= MAX_RATIO > RUNGS[-2]
    assert ladder(0.5, 2.0, 1.0) == (0.5, 1.0)
    with pytest.raises(ValueError):
        ladder(0.1, 1.0)


def test_a_step_takes_the_lowest_rung_that_holds_every_grid() -> None:
    # SDXL at 1024²: 4096 and 1024 tokens; CFG doubles the rows. Ratios 0.10 (fine) and
    # 0.14 (coarse, max-pooled): the coarse grid binds
    counts = {4096: round(0.10 * 2 * 4096), 1024: round(0.14 * 2 * 1024)}
    b = pick(2, counts)
    assert b is not None and b.rows == 2 and b.holds(counts)
    assert b.ratio >= 0.14 and (b.rung == 0 or not Bucket(2, b.rung - 1).holds(counts))
    # padding costs at most one rung step of the binding grid's tokens
    assert b.capacity(1024) <= math.ceil(STEP * counts[1024]) + 1
    # a forced minimum (the warm-up captures every rung) only raises it
    assert pick(2, counts, min_rung=b.rung + 2).rung == b.rung + 2
    assert pick(2, counts, min_rung=0).rung == b.rung


def test_capacity_is_clamped_to_the_grid() -> None:
    top = Bucket(3, len(RUNGS) - 1)
    assert top.capacity(16) <= 3 * 16
    assert Bucket(1, 0).capacity(1) == 1  # never zero


def test_too_large_a_ratio_is_not_bucketed() -> None:
    assert pick(1, {1024: 1024}) is None  # a full-path row among cache readers, alone
    assert pick(2, {1024: 1024}) is not None  # half the rows: ratio 0.5


@pytest.mark.parametrize("counts", [{1024: -1}, {1024: 2049}, {0: 0}])
def test_bad_counts_are_refused(counts) -> None:
    with pytest.raises(ValueError):
        pick(2, counts)


def test_pads_fill_rows_in_order_up_to_their_grid() -> None:
    """The executor pads its token sets and pricing counts its pads by this one rule."""
    assert pads([3, 10, 0], 20, 10) == [7, 0, 0]
    assert pads([9, 2, 0], 25, 10) == [1, 8, 5]
    assert pads([4, 4], 8, 10) == [0, 0]
    with pytest.raises(ValueError):
        pads([6, 6], 10, 10)  # fewer than the tokens there are
    with pytest.raises(ValueError):
        pads([1, 1], 21, 10)  # more than two rows of 10 hold
