"""`kvstate soak` (being built)."""


def register(subparsers):
    """Registers nothing until the command is implemented."""
