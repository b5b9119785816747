"""The errors the conformance kit raises besides the spec's own `kvstate.errors.InvariantViolation`.

Both are `AssertionError`s, so a test runner reports them as failures of the scheduler under test, not as errors of
the test.
"""

from __future__ import annotations

from kvstate.errors import KVStateError

__all__ = ["AdapterContractError", "LifecycleViolation"]


class LifecycleViolation(KVStateError, AssertionError):
    """An observed state, or a change between two observations, that the spec's state graph does not allow."""

    invariant_id = "SPEC-EDGE"


class AdapterContractError(KVStateError, AssertionError):
    """The adapter broke the `SchedulerAdapter` protocol (missing ids or keys, wrong exception types)."""
