"""The suite's progress lines (tests/progress.py): counted once per test, written at intervals, naming the
directories the workers run and the tests left; with pytest-xdist and without it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.progress import PLUGIN_NAME, ProgressLines

ROOT = Path(__file__).resolve().parents[1]


def report(nodeid: str, when: str, worker: str | None = None) -> pytest.TestReport:
    """A test report as the controller receives it from xdist worker `worker` (no worker: without xdist)."""
    made = pytest.TestReport(nodeid, (nodeid.partition("::")[0], 0, nodeid), {}, "passed", None, when)  # type: ignore[arg-type]
    if worker:
        setattr(made, "node", SimpleNamespace(gateway=SimpleNamespace(id=worker)))  # noqa: B010 (not a TestReport field)
    return made


def test_a_line_at_each_interval_counts_every_test_once_and_names_what_runs() -> None:
    now = [100.0]
    lines: list[str] = []
    progress = ProgressLines(lines.append, total=lambda: 5, interval_s=30, clock=lambda: now[0])
    for when in ("setup", "call", "teardown"):
        progress.pytest_runtest_logreport(report("tests/checker/test_a.py::t1", when, "gw0"))
    assert progress.done == 1 and lines == []  # less than an interval since the start
    now[0] = 131.0
    progress.pytest_runtest_logreport(report("tests/stateful/test_b.py::t2", "teardown", "gw1"))
    assert lines == ["-- 2 of 5 tests done, 3 left, 0 min 31 s in; running: tests/checker, tests/stateful"]
    now[0] = 140.0
    progress.pytest_runtest_logreport(report("tests/stateful/test_b.py::t3", "teardown", "gw0"))
    assert len(lines) == 1  # the next line waits for the next interval
    now[0] = 225.0
    progress.pytest_runtest_logreport(report("tests/docs/test_c.py::t4", "teardown", "gw1"))
    assert lines[-1] == "-- 4 of 5 tests done, 1 left, 2 min 05 s in; running: tests/docs, tests/stateful"


def run_pytest(tmp_path: Path, *options: str) -> str:
    for directory in ("alpha", "beta"):
        (tmp_path / directory).mkdir(exist_ok=True)
        tests = "".join(f"def test_{n}():\n    pass\n\n\n" for n in range(3))
        (tmp_path / directory / f"test_{directory}.py").write_text(tests, encoding="utf-8")
    (tmp_path / "conftest.py").write_text(
        "from tests.progress import register\n\n\ndef pytest_configure(config):\n    register(config, interval_s=0)\n",
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", *options, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_with_xdist_the_controller_writes_the_lines(tmp_path: Path) -> None:
    out = run_pytest(tmp_path, "-n", "2", "--dist", "loadfile")
    assert "-- 6 of 6 tests done, 0 left" in out, out
    running = re.findall(r"running: (.*)$", out, flags=re.M)
    assert running and {"alpha", "beta"} <= {d for line in running for d in line.split(", ")}, out


def test_without_xdist_and_turned_off(tmp_path: Path) -> None:
    assert "-- 6 of 6 tests done, 0 left" in run_pytest(tmp_path, "-p", "no:xdist")
    assert "tests done" not in run_pytest(tmp_path, "-p", f"no:{PLUGIN_NAME}")
