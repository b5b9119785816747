"""Subcommands of the `kvstate` command line; each module exposes `register(subparsers)`.

A registered subparser sets `run=<callable(args) -> int>` as its default.
"""

from kvstate.commands import bench, check, demo, diagram, generate, report, soak, spec_summary, validate

ALL = (bench, check, demo, diagram, generate, report, soak, spec_summary, validate)
