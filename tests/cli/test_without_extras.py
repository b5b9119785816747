"""The command line where only the core is installed: commands that need an extra say which, in one line, exit 2.

Each run is a fresh interpreter in which the extra's modules cannot be imported (a finder refuses them), as after
`pip install .` without extras; `.ci/run` also checks this in a virtual environment with no torch at all.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Run `kvstate.cli.main(argv)` with the top-level modules BLOCKED refused as if not installed.
RUNNER = """
import sys

BLOCKED = set(sys.argv[1].split(","))


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
from kvstate.cli import main

code = main(sys.argv[2:])
leaked = sorted(BLOCKED & {name.partition(".")[0] for name in sys.modules})
assert not leaked, leaked
raise SystemExit(code)
"""


def run_without(blocked: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "400"}  # one line per message
    return subprocess.run(
        [sys.executable, "-P", "-c", RUNNER, blocked, *argv],  # -P: the installed kvstate, not the source tree
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def test_help_lists_the_executors_commands_without_torch() -> None:
    done = run_without("torch,safetensors,numpy,matplotlib", "--help")
    assert done.returncode == 0, done.stderr
    for command in ("demo", "soak", "generate", "bench", "check", "report"):
        assert f"    {command} " in done.stdout, done.stdout


@pytest.mark.parametrize("argv", [["demo"], ["soak"], ["bench", "--only", "migration"]])
def test_an_executor_command_without_torch_names_the_executor_extra(argv: list[str]) -> None:
    done = run_without("torch", *argv)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"kvstate {argv[0]}: error: needs torch, which is not installed: pip install 'kvstate[executor]'\n"
    )
    assert done.stdout == ""


def test_report_without_matplotlib_names_the_report_extra(tmp_path) -> None:
    trace = tmp_path / "t.ndjson"
    trace.write_text("", encoding="utf-8")
    done = run_without("matplotlib", "report", str(trace), "--out", str(tmp_path / "out"), "--mkdir")
    assert done.returncode == 2, done.stderr
    needs = "needs matplotlib, which is not installed: pip install 'kvstate[report]'"
    assert done.stderr == f"kvstate report: error: {needs}\n"
    assert not (tmp_path / "out").exists()


def test_check_without_matplotlib_writes_the_counterexample_and_says_why_it_is_not_drawn(tmp_path) -> None:
    from tests.diagrams.test_spec_diff import changed, no_release_at_finish

    leaky = changed(tmp_path, "leaky", no_release_at_finish)  # the spec with `finish` releasing nothing
    cx = tmp_path / "cx"
    argv = ["check", "--bound", "no_host", "--spec", str(leaky), "--counterexample-dir", str(cx), "--no-refinement"]
    done = run_without("matplotlib", *argv)
    assert done.returncode == 1, done.stderr  # violated, as with matplotlib
    assert len(list(cx.glob("*.ndjson"))) == 1 and not list(cx.glob("*-report")), done.stdout + done.stderr
    assert "counterexample not drawn (needs matplotlib, which is not installed: pip install 'kvstate[report]')" in (
        done.stdout
    )
