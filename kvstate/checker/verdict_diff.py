"""`kvstate check --diff OLD_SPEC`: which invariants' verdicts changed between two specs, on the same bounds.

An invariant's verdict over a set of bounds: `violated (bound, ...)` when a counterexample of it was found in those
bounds, else `holds` when every bound was searched completely, else `not judged` (a search was cut short, or the
spec no longer declares it). The check finds at most one counterexample per bound, so a verdict names the first
invariant each bound breaks.

Invariants kept: pure functions of the bound reports and the specs; invariants in the new spec's order, then those
only the old one declares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstate.checker.explore import INCOMPLETE

if TYPE_CHECKING:
    from kvstate.checker.runner import BoundReport
    from kvstate.spec import Spec

HOLDS_WORD, NOT_JUDGED = "holds", "not judged"


def invariant_verdicts(reports: Sequence[BoundReport], spec: Spec) -> dict[str, str]:
    """Invariant id -> its verdict over `reports` (module docstring)."""
    violated: dict[str, list[str]] = {}
    for report in reports:
        if report.violated_invariant is not None:
            violated.setdefault(report.violated_invariant, []).append(report.bound.name)
    complete = not any(report.verdict == INCOMPLETE for report in reports)
    return {
        inv.id: (
            f"violated ({', '.join(violated[inv.id])})"
            if inv.id in violated
            else HOLDS_WORD
            if complete
            else NOT_JUDGED
        )
        for inv in spec.invariants
    }


def changed_verdicts(
    old: Sequence[BoundReport], old_spec: Spec, new: Sequence[BoundReport], new_spec: Spec
) -> list[tuple[str, str, str]]:
    """(invariant id, old verdict, new verdict) of every invariant whose verdict differs."""
    before, after = invariant_verdicts(old, old_spec), invariant_verdicts(new, new_spec)
    ids = [*after, *(i for i in before if i not in after)]
    return [
        (i, before.get(i, NOT_JUDGED), after.get(i, NOT_JUDGED))
        for i in ids
        if before.get(i, NOT_JUDGED) != after.get(i, NOT_JUDGED)
    ]


def verdict_lines(changes: Sequence[tuple[str, str, str]], old_source: str) -> list[str]:
    if not changes:
        return [f"verdicts against {old_source}: no invariant's verdict changed"]
    lines = [f"verdicts against {old_source}: {len(changes)} invariant(s) changed"]
    lines += [f"  {inv}: {was} -> {now}" for inv, was, now in changes]
    return lines
