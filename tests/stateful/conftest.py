"""What the stateful suites share: `find_failure`, which runs a conformance machine until Hypothesis finds the
failure a planted bug causes and checks that the printed step list replays it as plain Python."""

from __future__ import annotations

import re

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvstate.errors import InvariantViolation
from kvstate.testing import Submission

FIND_EXAMPLES = 300  # a failing search stops at its first failure; one that holds runs them all


@pytest.fixture
def find_failure():
    """`find_failure(machine, error=InvariantViolation)`: the error Hypothesis finds, its step list replayed."""
    return _find_failure


def _find_failure(machine: type, error: type[BaseException] = InvariantViolation) -> BaseException:
    """Run `machine` with up to `FIND_EXAMPLES` examples; return the error after checking that its printed
    step list replays the same failure as plain Python.

    Derandomized, so that a planted bug is found the same way every run (no flaky test). Shrinking is off: the
    raw failing case is enough to name the invariant, and shrinking stateful cases costs minutes.
    """
    run_settings = settings(
        max_examples=FIND_EXAMPLES,
        stateful_step_count=50,
        database=None,
        report_multiple_bugs=False,
        derandomize=True,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    with pytest.raises(error) as caught:
        run_state_machine_as_test(machine, settings=run_settings)
    replay_printed_steps(machine, caught.value, error)
    return caught.value


def replay_printed_steps(machine: type, err: BaseException, error: type[BaseException]) -> None:
    """Hypothesis attaches the failing step list to the error; it must run as written and fail the same way."""
    report = "\n".join(getattr(err, "__notes__", []))
    start = report.index(f"state = {machine.__name__}()")
    end = report.index("state.teardown()") + len("state.teardown()")
    program = report[start:end]
    assert re.search(r"^state\.\w+\(", program, flags=re.M), report
    with pytest.raises(error) as replayed:
        exec(program, {machine.__name__: machine, "Submission": Submission})
    assert getattr(replayed.value, "invariant_id", None) == getattr(err, "invariant_id", None)
