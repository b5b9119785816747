"""The README stays true: its diagram is the generated one, CI runs its test command, and the suite shows the progress
it describes."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tests.progress import INTERVAL_S, ProgressLines
from tests.test_progress import report

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_embeds_the_generated_mermaid_diagram() -> None:
    blocks = re.findall(r"```mermaid\n(.*?)```", README, flags=re.S)
    assert blocks == [(ROOT / "diagrams" / "lifecycle.mmd").read_text(encoding="utf-8")]


def test_quick_start_has_the_demo_and_the_test_command_and_ci_runs_the_latter() -> None:
    commands = re.findall(r"^python3 -m venv .*$", README, flags=re.M)
    assert len(commands) == 2
    demo, tests = commands
    assert demo.endswith("kvstate demo")
    test_command = tests.split("&& ", 2)[-1]
    assert test_command.endswith("pytest -n auto --dist loadfile")  # the whole suite, on every core
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command.replace("pip install", "pip install -q") in ci


def test_the_quick_start_commands_make_distinct_virtual_environments() -> None:
    """Each quick-start command makes its own environment: the second never reuses the first's installs."""
    environments = re.findall(r"^python3 -m venv (\S+) && \. (\S+)/bin/activate", README, flags=re.M)
    assert len(environments) == 2 and all(made == activated for made, activated in environments)
    assert environments[0][0] != environments[1][0]
    for made, _ in environments:
        assert f"`{made}`" in README  # and the README says which is which


def test_the_progress_the_quick_start_describes_is_configured() -> None:
    """Each line of dots ends with the tests done of all (pytest's count style), and a line every half minute says
    what runs and how many tests are left, in the form the README shows."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    assert options["console_output_style"] == "count" and 'console_output_style = "count"' in README
    assert INTERVAL_S == 30 and "every\nhalf minute" in README
    found = re.search(r"\(`(-- .*?)`: `tests/progress.py`\)", README, flags=re.S)
    assert found, "the README lost its example progress line"
    shown = found[1].replace("\n", " ")
    lines: list[str] = []
    progress = ProgressLines(lines.append, total=lambda: 1510, interval_s=0, clock=lambda: 0.0)
    progress.done, progress.started = 522, -100.0
    progress.directory_of = {"gw0": "tests/checker"}
    progress.pytest_runtest_logreport(report("tests/stateful/test_x.py::t", "teardown", "gw1"))
    assert lines == [shown]


def test_the_quick_start_names_every_command_and_docs_commands_has_a_row_for_each() -> None:
    from kvstate.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    commands = set(subparsers.choices)  # type: ignore[arg-type]
    named = re.search(r"^The commands, each in one line.*?\n\n", README, flags=re.S | re.M)
    assert named, "the README lost its list of commands"
    assert {c for c in commands if f"`{c}" not in named[0] and f"`kvstate {c}" not in named[0]} == set()
    table = (ROOT / "docs" / "commands.md").read_text(encoding="utf-8")
    assert {c for c in commands if f"| `kvstate {c}" not in table} == set()
