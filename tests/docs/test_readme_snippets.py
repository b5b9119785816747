"""Every ```python and ```bash snippet of README.md runs as written, in order, in one fresh directory.

Not run here: the quick-start install lines (they create a virtual environment and install the project; CI runs
them, see test_readme.py) and the section "Fuzz your own scheduler against the spec" (tested with
`kvstate.testing`). Each snippet is bounded in time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SKIPPED_SECTIONS = ("Fuzz your own scheduler against the spec",)
SNIPPET_TIMEOUT_S = 300
FENCE = re.compile(r"^```(python|bash)\n(.*?)^```$", flags=re.S | re.M)


def readme_snippets() -> list[tuple[str, str, str, int]]:
    """(section, language, code, line) of every snippet this test runs, in README order."""
    snippets = []
    for match in FENCE.finditer(README):
        line = README.count("\n", 0, match.start()) + 1
        headings = re.findall(r"^## (.+)$", README[: match.start()], flags=re.M)
        section = headings[-1] if headings else ""
        language, code = match.groups()
        if section in SKIPPED_SECTIONS or "python3 -m venv" in code:
            continue
        snippets.append((section, language, code, line))
    return snippets


SNIPPETS = readme_snippets()


def test_the_readme_has_snippets_to_run():
    languages = {language for _, language, _, _ in SNIPPETS}
    assert languages == {"python", "bash"} and len(SNIPPETS) >= 4
    assert any("kvstate generate" in code for _, _, code, _ in SNIPPETS)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize(
    "section, language, code, line", SNIPPETS, ids=[f"line{line}-{language}" for _, language, _, line in SNIPPETS]
)
def test_readme_snippet_runs_as_written(workdir, section, language, code, line):
    path = workdir / f"snippet_line{line}.{'py' if language == 'python' else 'sh'}"
    path.write_text(code, encoding="utf-8")
    command = [sys.executable, str(path)] if language == "python" else ["bash", "-euo", "pipefail", str(path)]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    try:
        done = subprocess.run(
            command, check=False, cwd=workdir, env=env, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"README.md line {line} ({section}): the {language} snippet ran past {SNIPPET_TIMEOUT_S} s")
    assert done.returncode == 0, (
        f"README.md line {line} ({section}): the {language} snippet failed with exit "
        f"status {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )
    assert "Traceback" not in done.stderr
