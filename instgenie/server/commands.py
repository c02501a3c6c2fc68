"""The `serve` and `client` subcommands; instgenie/cli.py calls `add_commands(sub)`."""

from __future__ import annotations

import argparse

from instgenie.config import (
    LimitsConfig,
    ModelConfig,
    WorkerConfig,
    add_dataclass_args,
    dataclass_from_args,
)
from instgenie.errors import ValidationError
from instgenie.server.client_cli import add_client_parser
from instgenie.server.config import ServerConfig


def cmd_serve(args: argparse.Namespace) -> int:
    from instgenie.server.launcher import serve

    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    parts = {}
    for name, cls, extra in (
        ("model", ModelConfig, {"device": devices[0] if devices else "cpu"}),
        ("worker", WorkerConfig, {"max_queue": args.worker_max_queue}),
        ("limits", LimitsConfig, {}),
        ("server", ServerConfig, {}),
    ):
        try:
            parts[name] = dataclass_from_args(cls, args, **extra)
        except ValueError as exc:  # the message names the setting
            raise ValidationError(name, str(exc)) from None
    from instgenie.worker.policies import get_policy  # (light: no torch)

    try:
        get_policy(parts["worker"].policy)
    except ValueError as exc:
        raise ValidationError("policy", str(exc)) from None
    return serve(parts["model"], devices, parts["worker"], parts["limits"], parts["server"])


def add_commands(sub) -> None:
    """Register `serve` and `client` on the `instgenie` subparsers."""
    serve = sub.add_parser(
        "serve",
        help="start the API server and one worker per device",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_dataclass_args(serve, ModelConfig, skip=("device",))
    serve.add_argument(
        "--devices",
        default="cpu",
        help="comma-separated torch devices, one worker each: cpu | cuda:0,cuda:1",
    )
    add_dataclass_args(serve, ServerConfig)
    add_dataclass_args(serve, WorkerConfig, skip=("max_queue",))
    serve.add_argument(
        "--worker-max-queue",
        type=int,
        default=WorkerConfig.max_queue,
        help="requests one worker holds at most (its own bound)",
    )
    add_dataclass_args(serve, LimitsConfig)
    serve.set_defaults(func=cmd_serve)

    add_client_parser(sub)
