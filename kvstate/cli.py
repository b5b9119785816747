"""The `kvstate` command line. Each subcommand lives in its own module under `kvstate.commands`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvstate import commands
from kvstate.errors import KVStateError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstate",
        description="A formally specified request lifecycle for paged KV caches with a GPU tier and a host tier.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in commands.ALL:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns its exit code. Expected errors print one clear line, not a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KVStateError as err:
        print(f"kvstate {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
