"""The `kvstate` subcommands that run the torch executor: `demo`, `soak` and `generate`. Each module exposes
`register(subparsers)`, as the torch-free ones under `kvstate.commands` do, and `kvstate.cli` registers both.

Importing these modules imports no torch (`executor`'s names load on first use): a command imports what it runs
once its command line has been checked, so `--help` and usage errors stay fast.
"""
