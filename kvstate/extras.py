"""Which extra of the `kvstate` distribution installs each optional dependency.

`pip install .` installs the core: the spec, the lifecycle machine, the scheduler, the conformance kit, the model
checker and the command line, none of which imports torch or matplotlib. What needs more names the extra that brings
it (pyproject.toml's `[project.optional-dependencies]`). A command that reaches a missing one says so in one line
naming the extra (`missing_extra`, `require`), exit status 2, never a traceback.
"""

from __future__ import annotations

import importlib.util

from kvstate.errors import KVStateError

__all__ = ["EXTRA_OF", "MissingExtra", "install_command", "missing_extra", "require"]

# top-level module -> the extra that installs it
EXTRA_OF = {
    "torch": "executor",
    "safetensors": "executor",
    "numpy": "executor",
    "matplotlib": "report",
    "tokenizers": "text",
    "gguf": "smollm2",
    "jinja2": "smollm2",
    "dask": "cluster",
    "hypofuzz": "fuzz",
}


class MissingExtra(KVStateError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def install_command(extra: str) -> str:
    """The command that installs `extra` beside kvstate."""
    return f"pip install 'kvstate[{extra}]'"


def _message(module: str, extra: str) -> str:
    return f"needs {module}, which is not installed: {install_command(extra)}"


def missing_extra(err: ModuleNotFoundError) -> str | None:
    """The one-line explanation of `err` when the module it misses comes with an extra, else None (a module that
    no extra installs is missing because the installation is broken, not because an extra was left out)."""
    module = (err.name or "").partition(".")[0]
    extra = EXTRA_OF.get(module)
    return None if extra is None else _message(module, extra)


def require(module: str) -> None:
    """Raise `MissingExtra` unless the top-level `module` (a key of `EXTRA_OF`) can be imported; imports nothing."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder refused it, or a module of that name was removed from sys.modules
        found = False
    if not found:
        raise MissingExtra(_message(module, EXTRA_OF[module]))
