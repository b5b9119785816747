"""The torch-free subcommands of the `kvstate` command line; each module exposes `register(subparsers)`. The ones
that run the torch executor live with it, in `executor.commands`, and reach `kvstate.cli` through the
`kvstate.commands` entry-point group.

A registered subparser sets `run=<callable(args) -> int>` as its default.
"""
