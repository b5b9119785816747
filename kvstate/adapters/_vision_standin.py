"""A stand-in for `torchvision`, installed by `kvstate.adapters.sglang` only when the real one does not import.

SGLang imports `torchvision` at module level (its multimodal processors and configs), and PyPI's torchvision wheels
do not load against a CPU build of torch ("operator torchvision::nms does not exist"). The adapter drives SGLang's
scheduler and memory pools only, which never run vision code, so every `torchvision` module and name is an inert
`Placeholder`: importing, reading an attribute, calling or subclassing one succeeds and computes nothing.

Invariant: the stand-in is installed only after `import torchvision` failed, and never replaces a real module
(`installed()` says whether it is in use).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

ROOT = "torchvision"


class Placeholder:
    """Any torchvision name: an inert value that yields placeholders for every use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Placeholder:
        return Placeholder()

    def __getattr__(self, name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder()

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases: tuple) -> tuple[type, ...]:
        return (Placeholder,)  # `class X(torchvision.Something)` derives from Placeholder


class _StandinModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path, target=None):
        if fullname == ROOT or fullname.startswith(ROOT + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandinModule(spec.name, "kvstate's inert stand-in (kvstate.adapters._vision_standin)")
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


_FINDER = _Finder()


def install_if_missing() -> bool:
    """Install the stand-in unless the real `torchvision` imports; True if the stand-in is now in use."""
    if installed():
        return True
    try:
        import torchvision  # noqa: F401
    except Exception:  # the CPU-torch mismatch raises RuntimeError, not only ImportError
        for name in [m for m in sys.modules if m == ROOT or m.startswith(ROOT + ".")]:
            del sys.modules[name]  # a half-imported real module must not shadow the stand-in
        _pin_transformers_without_torchvision()
        sys.meta_path.insert(0, _FINDER)
        return True
    return False


def _pin_transformers_without_torchvision() -> None:
    """transformers asks `importlib.util.find_spec("torchvision")` once and caches the answer: ask it now, before
    the stand-in would answer, so that transformers never takes the stand-in for a real torchvision."""
    try:
        from transformers.utils import import_utils
    except ImportError:
        return
    import_utils.is_torchvision_available()


def installed() -> bool:
    return _FINDER in sys.meta_path
