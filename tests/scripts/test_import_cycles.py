"""scripts/import-cycles: function-local imports count, so a cycle they postpone to the first call is reported."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def import_cycles() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("import_cycles", str(ROOT / "scripts" / "import-cycles"))
    spec = importlib.util.spec_from_loader("import_cycles", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_cycle_closed_by_a_function_local_import_is_reported(import_cycles, tmp_path):
    _write(
        tmp_path,
        {
            "kvstate/__init__.py": "",
            "kvstate/low.py": "def names():\n    from kvstate.high import NAMES\n\n    return NAMES\n",
            "kvstate/high.py": "from kvstate.low import names\n\nNAMES = ()\n",
            "executor/__init__.py": "",
        },
    )
    graph = import_cycles.import_graph(tmp_path)
    assert import_cycles.cycles(graph) == [["kvstate.high", "kvstate.low"]]


def test_an_import_under_type_checking_is_no_edge(import_cycles, tmp_path):
    _write(
        tmp_path,
        {
            "kvstate/__init__.py": "",
            "kvstate/low.py": "import typing\n\nif typing.TYPE_CHECKING:\n    from kvstate.high import NAMES\n",
            "kvstate/high.py": "from kvstate.low import typing\n",
            "executor/__init__.py": "",
        },
    )
    assert import_cycles.cycles(import_cycles.import_graph(tmp_path)) == []


def test_the_tree_has_no_cycle_counting_function_local_imports(import_cycles):
    graph = import_cycles.import_graph()
    # the foundation: the spec's validator holds a spec against names defined below it (kvstate.roles), and a
    # request record needs nothing of the lifecycle that drives it
    assert "kvstate.output" not in graph["kvstate.validate"]
    assert "kvstate.lifecycle" not in graph["kvstate.request"]
    assert "kvstate.checker.runner" in graph["kvstate.commands.check"]  # a function-local import is an edge
    assert import_cycles.cycles(graph) == []


def test_an_import_from_the_core_into_the_executor_is_reported(import_cycles, tmp_path):
    """A function-local import counts: the core may not reach the layer above it at any time."""
    _write(
        tmp_path,
        {
            "kvstate/cli.py": "def run():\n    from executor.engine import Engine\n\n    return Engine\n",
            "executor/engine.py": "from kvstate.cli import run\n\nEngine = run\n",
        },
    )
    graph = import_cycles.import_graph(tmp_path)
    assert import_cycles.upward_imports(graph) == [("kvstate.cli", "executor.engine")]


def test_the_core_never_imports_the_executor(import_cycles):
    assert import_cycles.upward_imports(import_cycles.import_graph()) == []
