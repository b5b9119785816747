"""What the breadth-first searches share: their limits (a search that hits one is `incomplete`) and the
reconstruction of a shortest path from parent pointers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SearchBudget:
    """`stop_reason(n)` says why a search holding `n` states must stop, or None while it may go on.

    The clock is read only every `check_every` calls, so the check costs nothing measurable per state.
    """

    max_states: int | None = None
    time_limit: float | None = None
    check_every: int = 64
    _deadline: float | None = field(init=False, default=None)
    _calls: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._deadline = time.perf_counter() + self.time_limit if self.time_limit else None

    def stop_reason(self, states: int) -> str | None:
        if self.max_states is not None and states > self.max_states:
            return f"--max-states {self.max_states} reached"
        self._calls += 1
        if self._deadline is not None and self._calls % self.check_every == 0 and time.perf_counter() > self._deadline:
            return f"time limit {self.time_limit:g} s reached"
        return None


def path_indices(parent: list[int], j: int) -> list[int]:
    """The indices of the states on the BFS path from the initial state (excluded) to state `j` (included);
    `parent[i]` is the index of the state `i` was first reached from, -1 for the initial state."""
    path = []
    while parent[j] != -1:
        path.append(j)
        j = parent[j]
    return path[::-1]
