"""`python -m instgenie.server serve|client ...` (the same as `instgenie serve|client ...`)."""

from __future__ import annotations

import argparse
import sys

from instgenie.server.commands import add_commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m instgenie.server")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
