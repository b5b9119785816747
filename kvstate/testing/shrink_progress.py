"""What a person waiting on a failing conformance run sees: a line when the first failure is found and Hypothesis
starts shrinking it, and a line every `PROGRESS_EVERY_S` seconds while it shrinks.

Hypothesis reports a failure only once it has shrunk it, which can take a while; these lines (on stderr) say what is
happening and what it costs. `ShrinkProgress` keeps, per machine class, when the first failure of the current run was
seen, how many examples ran since, and the fewest steps of a failing example so far; a run idle for `STALE_AFTER_S`
seconds counts as over.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

__all__ = ["PROGRESS_EVERY_S", "STALE_AFTER_S", "ShrinkProgress"]

PROGRESS_EVERY_S = 10.0
STALE_AFTER_S = 120.0


@dataclass
class ShrinkProgress:
    """The shrink progress of one machine class; `example_ended` is called at the end of every example."""

    name: str
    first_failure: float | None = None
    last_seen: float = 0.0
    last_line: float = 0.0
    attempts: int = 0
    fewest_steps: int | None = None
    stream: TextIO | None = None

    def example_ended(self, failed: str | None, steps: int, now: float | None = None) -> None:
        """Record an example that ran `steps` rules and failed with `failed` (a description) or passed (None)."""
        now = time.monotonic() if now is None else now
        if self.first_failure is not None and now - self.last_seen > STALE_AFTER_S:
            self.first_failure, self.fewest_steps, self.attempts = None, None, 0
        self.last_seen = now
        if self.first_failure is None:
            if failed is not None:
                self.first_failure, self.last_line, self.fewest_steps = now, now, steps
                self.write(
                    f"{self.name}: found {failed} after {steps} rule(s); Hypothesis now shrinks it to the shortest "
                    "step list that still fails, replaying variants of it: seconds to minutes, a line every "
                    f"{PROGRESS_EVERY_S:.0f} s says how far it got (a profile without the shrink phase, such as "
                    "'fail-fast', reports the list as found at once)"
                )
            return
        self.attempts += 1
        if failed is not None:
            self.fewest_steps = min(self.fewest_steps or steps, steps)
        if now - self.last_line >= PROGRESS_EVERY_S:
            self.last_line = now
            self.write(
                f"{self.name}: still shrinking after {now - self.first_failure:.0f} s: {self.attempts} variant(s) "
                f"replayed, the shortest failing one has {self.fewest_steps} rule(s)"
            )

    def write(self, line: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(f"[kvstate.testing] {line}\n")
        stream.flush()
