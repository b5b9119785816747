"""Check `--inject KIND[:RATE]` values before torch is imported.

`executor.faults` is pure Python, but importing it through its package runs `executor/__init__`, which imports
torch (seconds). `check_fault_plan` runs the real `FaultPlan.parse` from a private, torch-free copy of that one
module (loaded from its file under a private name, never under its package's), so a bad `--inject` fails in well under
a second with the parser's own message; the command then parses again with the real module once torch is loaded.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import ModuleType

from kvstate.commands.args import UsageError

PRIVATE_NAME = "_kvstate_inject_syntax"


@cache
def _faults_module() -> ModuleType:
    if "executor.faults" in sys.modules:  # already imported (with torch): use it
        return sys.modules["executor.faults"]
    package = importlib.util.find_spec("executor")  # finds the package without importing it
    if package is None or not package.submodule_search_locations:
        raise UsageError("--inject needs the executor package, which is not installed; reinstall kvstate")
    path = Path(next(iter(package.submodule_search_locations))) / "faults.py"
    spec = importlib.util.spec_from_file_location(PRIVATE_NAME, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"--inject needs {path}, which cannot be loaded as a module; reinstall kvstate")
    module = importlib.util.module_from_spec(spec)
    sys.modules[PRIVATE_NAME] = module  # dataclasses look their module up while the classes are built
    spec.loader.exec_module(module)
    return module


def check_fault_plan(texts: Sequence[str], seed: int) -> None:
    """Raise `UsageError` (the parser's message) when `texts` is not a valid fault plan; import no torch."""
    faults = _faults_module()
    try:
        faults.FaultPlan.parse(texts, seed=seed)
    except ValueError as err:
        raise UsageError(str(err)) from None
