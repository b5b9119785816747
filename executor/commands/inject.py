"""Check `--inject KIND[:RATE]` values before torch is imported: `executor.faults` is pure Python, and importing it
imports no torch (`executor`'s names load on first use), so a bad `--inject` fails in well under a second with the
parser's own message."""

from __future__ import annotations

from collections.abc import Sequence

from executor.faults import FaultPlan
from kvstate.commands.args import UsageError


def check_fault_plan(texts: Sequence[str], seed: int) -> None:
    """Raise `UsageError` (the parser's message) when `texts` is not a valid fault plan; import no torch."""
    try:
        FaultPlan.parse(texts, seed=seed)
    except ValueError as err:
        raise UsageError(str(err)) from None
