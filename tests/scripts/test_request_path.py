"""scripts/request-path: a call back into a module already on the call stack is a re-entry, and `--check` fails on
one; calls from one module into others and back out are hops, not re-entries."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

CALLER = """
def calls_back(callee):
    return callee.run(helper)


def calls_out(callee):
    return callee.leaf() + helper()


def helper():
    return 1
"""

CALLEE = """
def run(callback):
    return callback()


def leaf():
    return 2
"""


@pytest.fixture(scope="module")
def request_path() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("request_path", str(ROOT / "scripts" / "request-path"))
    spec = importlib.util.spec_from_loader("request_path", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _package(root: Path) -> tuple[dict[Path, str], ModuleType, ModuleType]:
    """A package `pkg` of two modules, `caller` and `callee`, loaded from `root`; returns (its directory as
    `request-path` walks it, caller, callee)."""
    directory = (root / "pkg").resolve()
    directory.mkdir()
    loaded = []
    for name, text in (("caller", CALLER), ("callee", CALLEE)):
        path = directory / f"{name}.py"
        path.write_text(text, encoding="utf-8")
        spec = importlib.util.spec_from_file_location(f"pkg_{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        loaded.append(module)
    return {directory: "pkg"}, loaded[0], loaded[1]


def _walked(request_path: ModuleType, packages: dict[Path, str], call) -> object:
    seen = request_path.Walk(packages)
    sys.setprofile(seen.profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def test_a_call_back_into_a_module_on_the_stack_is_a_re_entry(request_path, tmp_path):
    packages, caller, callee = _package(tmp_path)
    seen = _walked(request_path, packages, lambda: caller.calls_back(callee))
    assert seen.reentries == Counter({("pkg.callee", "pkg.caller", "helper"): 1})
    assert seen.hops == Counter({("pkg.caller", "pkg.callee"): 1, ("pkg.callee", "pkg.caller"): 1})


def test_calls_out_and_back_to_the_caller_are_hops_not_re_entries(request_path, tmp_path):
    packages, caller, callee = _package(tmp_path)
    seen = _walked(request_path, packages, lambda: caller.calls_out(callee))
    assert seen.reentries == Counter()
    assert seen.hops == Counter({("pkg.caller", "pkg.callee"): 1})
    assert seen.modules == Counter({"pkg.caller": 2, "pkg.callee": 1})


@pytest.mark.parametrize(
    ("argv", "reentry", "status"),
    [([], True, 0), (["--check"], True, 1), (["--check"], False, 0)],
    ids=["a re-entry without --check", "a re-entry with --check", "none with --check"],
)
def test_check_fails_on_a_re_entry_only(request_path, tmp_path, monkeypatch, capsys, argv, reentry, status):
    """`--check` exits 1 when the walk found a re-entry, and only then; without it the walk is only printed.
    (The walk is the fake package's, not the engine's: `main` is tested, not the workload.)"""
    packages, caller, callee = _package(tmp_path)
    seen = _walked(request_path, packages, lambda: (caller.calls_back if reentry else caller.calls_out)(callee))
    monkeypatch.setattr(request_path, "walk", lambda: (seen, Counter({"admit": 1})))
    monkeypatch.setattr(sys, "argv", ["request-path", *argv])
    assert request_path.main() == status
    printed = capsys.readouterr().out
    assert ("RE-ENTRY pkg.callee -> pkg.caller.helper" in printed) == reentry
    assert "BUDGET" not in printed
