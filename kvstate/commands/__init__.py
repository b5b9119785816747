"""Subcommands of the `kvstate` command line; each module exposes `register(subparsers)`.

A registered subparser sets `run=<callable(args) -> int>` as its default.
"""

from kvstate.commands import check, demo, diagram, spec_summary

ALL = (check, demo, diagram, spec_summary)
