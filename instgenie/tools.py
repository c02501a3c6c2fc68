"""The tools' subcommands beside serving: `loadtest`, `simulate`, `dataset`, `train-classifier`
and `train-reference`. Each module's parser imports nothing heavy (no torch) until it runs."""

from __future__ import annotations

import argparse


def add_tool_commands(sub: argparse._SubParsersAction) -> None:
    from instgenie.dataset.command import add_dataset_parser
    from instgenie.loadtest.command import add_loadtest_parser
    from instgenie.reference.command import add_train_reference_parser
    from instgenie.sim.command import add_simulate_parser

    add_loadtest_parser(sub)
    add_simulate_parser(sub)
    add_dataset_parser(sub)
    add_train_reference_parser(sub)
