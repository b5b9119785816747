"""The `kvstate` subcommands that run the torch executor: `demo`, `soak`, `generate` and `bench`. Each module
exposes `register(subparsers)`, as the torch-free ones under `kvstate.commands` do; `kvstate.cli` finds these
through the `kvstate.commands` entry-point group (pyproject.toml), so the core never imports the executor.

Importing these modules imports no torch (`executor`'s names load on first use): a command imports what it runs
once its command line has been checked, so `--help` and usage errors stay fast.
"""
