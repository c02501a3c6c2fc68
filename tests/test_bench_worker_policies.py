"""bench/bench_worker_policies.py's arguments: --quick only changes defaults."""

from __future__ import annotations

from bench.bench_worker_policies import SIZES, parse_args


def test_defaults_of_a_full_and_a_quick_run() -> None:
    full, quick = parse_args([]), parse_args(["--quick"])
    for k, (want_full, want_quick) in SIZES.items():
        assert getattr(full, k) == want_full and getattr(quick, k) == want_quick, k
    assert (quick.size, quick.steps, quick.rates, quick.max_batch) == (64, 3, [2.0], 2)


def test_quick_keeps_the_flags_given() -> None:
    args = parse_args(["--quick", "--size", "128", "--steps", "5", "--requests", "3",
                       "--rates", "0.5", "4", "--max-batch", "4", "--templates", "3"])  # fmt: skip
    assert (args.size, args.steps, args.requests) == (128, 5, 3)
    assert (args.rates, args.max_batch, args.templates) == ([0.5, 4.0], 4, 3)
    some = parse_args(["--steps", "7", "--quick"])  # the others keep --quick's defaults
    assert (some.steps, some.size, some.requests) == (7, 64, 6)


def test_defaults_are_not_shared_between_runs() -> None:
    parse_args(["--quick"]).rates.append(9.0)
    assert parse_args(["--quick"]).rates == [2.0]
