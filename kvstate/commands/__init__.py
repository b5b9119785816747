"""The torch-free subcommands of the `kvstate` command line; each module exposes `register(subparsers)`. The ones
that run the torch executor live with it, in `executor.commands`; `kvstate.cli` registers both.

A registered subparser sets `run=<callable(args) -> int>` as its default.
"""
