"""The page for TLA+ readers (docs/tla.md, linked from the README) runs as written: its export command (run by
tests/docs with the other snippets) and its TLC commands, here, where Java and tla2tools.jar are installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "tla.md").read_text(encoding="utf-8")
SECTION = PAGE.split("# The spec in TLA+, checked by TLC", 1)[1].split("\n## ", 1)[0]


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", SECTION, flags=re.S | re.M)


def test_the_section_names_the_commands_the_cross_check_runs():
    (export,) = blocks("bash")
    (tlc,) = blocks("text")
    assert export.startswith("kvstate export tla ") and "--out tla" in export
    assert tlc.startswith("cd tla\n") and tlc.count("tlc2.TLC -deadlock") == 2
    assert "kvstate check --engine tlc" in SECTION


@pytest.mark.slow  # TLC's liveness check of the default bound takes minutes on two busy cores
def test_the_tlc_commands_run_as_written(tlc_tools, tmp_path):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{tlc_tools.java.rsplit('/', 1)[0]}"
        f"{os.pathsep}{os.environ.get('PATH', '')}",
    }
    script = blocks("bash")[0] + blocks("text")[0]
    done = subprocess.run(
        ["bash", "-uo", "pipefail", "-c", script],  # no -e: TLC exits 13 when LIVE_DONE is violated, as here
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    assert done.stdout.count("Model checking completed. No error has been found.") == 1  # the safety check
    assert "Temporal properties were violated." in done.stdout  # LIVE_DONE under per-action weak fairness
