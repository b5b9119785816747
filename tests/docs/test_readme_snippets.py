"""Every ```python and ```bash snippet of README.md and of the docs/ pages it links to runs as written, in order
(the README first, then the pages in DOCUMENTS' order), in one fresh directory.

Not run here: the quick-start install lines (they create a virtual environment and install the project; CI runs
them, see test_readme.py), the README's section "Fuzz your own scheduler against the spec" and docs/fuzzing.md
(tested with `kvstate.testing`: tests/stateful/test_readme_take_passes.py, tests/peers/test_readme_example.py and
tests/fuzz/test_hypofuzz_campaign.py). Each snippet is bounded in time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = (
    "README.md",
    "docs/install.md",
    "docs/commands.md",
    "docs/executor.md",
    "docs/real-model.md",
    "docs/checking.md",
    "docs/diagrams.md",
    "docs/tla.md",
    "docs/testing.md",
    "docs/layout.md",
)
SKIPPED_SECTIONS = {"README.md": ("Fuzz your own scheduler against the spec",)}
NOT_RUN = ("docs/fuzzing.md", "docs/vllm-findings.md", "docs/sglang-findings.md", "docs/trtllm-findings.md")
SNIPPET_TIMEOUT_S = 300
FENCE = re.compile(r"^```(python|bash)\n(.*?)^```$", flags=re.S | re.M)


def document_snippets(document: str) -> list[tuple[str, str, str, str, int]]:
    """(document, section, language, code, line) of every snippet this test runs in `document`, in its order."""
    text = (ROOT / document).read_text(encoding="utf-8")
    snippets = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        headings = re.findall(r"^## (.+)$", text[: match.start()], flags=re.M)
        section = headings[-1] if headings else ""
        language, code = match.groups()
        if section in SKIPPED_SECTIONS.get(document, ()) or "python3 -m venv" in code:
            continue
        snippets.append((document, section, language, code, line))
    return snippets


SNIPPETS = [snippet for document in DOCUMENTS for snippet in document_snippets(document)]


def test_every_page_under_docs_is_run_or_named_as_not_run():
    pages = {str(path.relative_to(ROOT)) for path in (ROOT / "docs").glob("*.md")}
    assert pages == (set(DOCUMENTS) | set(NOT_RUN)) - {"README.md"}


def test_the_readme_has_snippets_to_run():
    readme = [(language, code) for document, _, language, code, _ in SNIPPETS if document == "README.md"]
    assert {language for language, _ in readme} == {"python", "bash"}
    languages = {language for _, _, language, _, _ in SNIPPETS}
    assert languages == {"python", "bash"} and len(SNIPPETS) >= 4
    assert any("kvstate generate" in code for _, _, _, code, _ in SNIPPETS)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize(
    "document, section, language, code, line",
    SNIPPETS,
    ids=[f"{Path(document).stem}-line{line}-{language}" for document, _, language, _, line in SNIPPETS],
)
def test_readme_snippet_runs_as_written(workdir, document, section, language, code, line):
    path = workdir / f"snippet_{Path(document).stem}_line{line}.{'py' if language == 'python' else 'sh'}"
    path.write_text(code, encoding="utf-8")
    command = [sys.executable, str(path)] if language == "python" else ["bash", "-euo", "pipefail", str(path)]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    try:
        done = subprocess.run(
            command, check=False, cwd=workdir, env=env, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{document} line {line} ({section}): the {language} snippet ran past {SNIPPET_TIMEOUT_S} s")
    assert done.returncode == 0, (
        f"{document} line {line} ({section}): the {language} snippet failed with exit "
        f"status {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )
    assert "Traceback" not in done.stderr
