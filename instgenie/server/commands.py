"""The `serve` and `client` subcommands; instgenie/cli.py calls `add_commands(sub)`."""

from __future__ import annotations

import argparse

from instgenie.config import (
    DefaultsHelpFormatter,
    ExecConfig,
    LimitsConfig,
    ModelConfig,
    WorkerConfig,
    add_dataclass_args,
    dataclass_from_args,
    field_help,
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
    from instgenie.scheduler.batching import get_policy  # (light: no torch)

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
        description="Start the API server and one worker per device. Every flag is a field of "
        "the config tree (instgenie/config.py, instgenie/server/config.py); its help is the "
        "field's comment there.",
        formatter_class=DefaultsHelpFormatter,
    )
    model = serve.add_argument_group("model (ModelConfig)")
    add_dataclass_args(model, ModelConfig, skip=("device", "execution"))
    model.add_argument(
        "--devices",
        default="cpu",
        help="comma-separated torch devices, one worker each: cpu | cuda:0,cuda:1",
    )
    execution = serve.add_argument_group(
        "execution, every worker (ExecConfig)",
        "a flag given wins over its INSTGENIE_* variable, read once at start",
    )
    add_dataclass_args(execution, ExecConfig)
    add_dataclass_args(serve.add_argument_group("server (ServerConfig)"), ServerConfig)
    worker = serve.add_argument_group("worker, one per device (WorkerConfig)")
    add_dataclass_args(worker, WorkerConfig, skip=("max_queue",))
    worker.add_argument(
        "--worker-max-queue",
        type=int,
        default=WorkerConfig.max_queue,
        help=field_help(WorkerConfig)["max_queue"],
    )
    add_dataclass_args(serve.add_argument_group("input limits (LimitsConfig)"), LimitsConfig)
    serve.set_defaults(func=cmd_serve)

    add_client_parser(sub)
