"""The README's pass report example runs as written, and the same pass with a served victim fails VICTIM-TAIL."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstate.errors import InvariantViolation

README = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")


def example() -> str:
    found = re.search(r"\*\*A pass report, by example\.\*\*.*?```python\n(.*?)```", README, flags=re.S)
    assert found, "the README lost its pass report example"
    return found[1]


def test_the_readme_pass_report_example_runs_and_passes_the_vllm_preset() -> None:
    namespace: dict = {}
    exec(example(), namespace)
    assert namespace["observed"].record.decisions[0].victim == "b"


def test_the_readme_pass_report_with_a_served_victim_fails_victim_tail() -> None:
    """The same pass with "b" taking "a", which the pass served before it: "a" is no eligible victim."""
    swapped = (
        example()
        .replace('Victim(requester="a", victim="b"', 'Victim(requester="b", victim="a"')
        .replace('(Listed("b", "recompute_paused"),)', '(Listed("a", "recompute_paused"),)')
    )
    assert swapped != example()
    with pytest.raises(InvariantViolation) as caught:
        exec(swapped, {})
    assert caught.value.invariant_id == "VICTIM-TAIL" and "scheduled_this_pass excludes it" in str(caught.value)
