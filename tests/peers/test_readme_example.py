"""The README's fuzzing example runs as written: its code block is extracted, executed, and its test case run."""

from __future__ import annotations

import re
import unittest
from pathlib import Path

import pytest

pytestmark = pytest.mark.peers
pytest.importorskip("vllm", reason="vLLM is an optional peer: run scripts/install-peers to install it")

README = Path(__file__).resolve().parents[2] / "README.md"


def fuzzing_example() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Fuzz your own scheduler against the spec") :]
    section = section[: section.index("\n## ", 1)]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S) if "kvstate.adapters.vllm" in b]
    assert len(blocks) == 1, f"expected one python block using kvstate.adapters.vllm in the fuzzing section: {blocks}"
    return blocks[0]


def test_the_readme_fuzzing_example_runs_as_written_and_passes() -> None:
    namespace: dict = {"__name__": "test_vllm"}
    exec(compile(fuzzing_example(), str(README), "exec"), namespace)
    case = namespace["TestVLLMScheduler"]
    assert case.settings.max_examples == 20 and case.settings.stateful_step_count == 40
    assert case.settings.deadline is None  # the machine's own default
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case).run(result)
    assert result.testsRun == 1 and result.wasSuccessful(), result.failures + result.errors
