"""The worlds the scheduler refinement found, as a graph, and the search for a livelock on it.

Liveness (LIVE-DONE): once arrivals and faults stop (every budgeted action spends a budget the fingerprint counts,
so none lies on a cycle), only steps, early completions and early landings move a world, and every infinite run of
them is one an executor may follow under F1-F4 (copies are due within `copy_delay` passes, outputs land when they
must, consensus follows the landing of the output that announced the pause). So a cycle through a world with an
unfinished request is a livelock.
"""

from __future__ import annotations

from collections import deque

from kvstate.checker.explore import tarjan
from kvstate.checker.search import path_indices


class WorldGraph:
    """The worlds the refinement search found, by index (0: the initial world), as a BFS tree plus the edges that
    spend no budget (steps, early copy completions, early landings: the only edges a cycle can use).

    Invariants: world `j` was first reached from world `parent[j]` by `via[j]`, firing `fired[j]` (the initial
    world: parent -1), so parent pointers give shortest paths; `final[j]`: world `j` has no unfinished request;
    `succ[j]`: (world, action, transitions fired) of every such edge out of `j` found so far.
    """

    def __init__(self) -> None:
        self.parent: list[int] = [-1]
        self.via: list[tuple] = [()]
        self.fired: list[list[str]] = [[]]
        self.final: list[bool] = [True]
        self.succ: list[list[tuple[int, tuple, list[str]]]] = [[]]

    @property
    def size(self) -> int:
        return len(self.parent)

    def add(self, parent: int, action: tuple, fired: list[str], final: bool) -> int:
        """Record a new world reached from `parent` by `action`; its index."""
        self.parent.append(parent)
        self.via.append(action)
        self.fired.append(fired)
        self.final.append(final)
        self.succ.append([])
        return len(self.parent) - 1

    def link(self, i: int, j: int, action: tuple, fired: list[str]) -> None:
        self.succ[i].append((j, action, fired))

    def path_to(self, j: int) -> list[tuple[tuple, list[str]]]:
        """(action, transitions it fired) along the shortest path from the initial world to world `j`."""
        return [(self.via[i], self.fired[i]) for i in path_indices(self.parent, j)]

    def livelock(self) -> list[tuple[tuple, list[str], int]] | None:
        """LIVE-DONE: a cycle through a world with an unfinished request, as (action, transitions fired, world the
        action leaves) from its first world back to it; None when every cycle is final."""
        comp = tarjan(self.size, [[j for j, _, _ in edges] for edges in self.succ])
        members: dict[int, list[int]] = {}
        for v, c in enumerate(comp):
            members.setdefault(c, []).append(v)
        for v in range(self.size):
            c = comp[v]
            if self.final[v]:
                continue
            cyclic = len(members[c]) > 1 or any(j == v for j, _, _ in self.succ[v])
            if cyclic:
                return self._cycle(v, c, comp)
        return None

    def _cycle(self, v: int, c: int, comp: list[int]) -> list[tuple[tuple, list[str], int]]:
        """A shortest cycle inside SCC `c` from `v` back to `v` (one exists: `c` is cyclic)."""
        prev: dict[int, tuple[int, tuple, list[str]]] = {}
        queue = deque([v])
        while queue:
            u = queue.popleft()
            for w, action, fired in self.succ[u]:
                if comp[w] != c or w in prev:
                    continue
                prev[w] = (u, action, fired)
                if w == v:
                    chain, node = [], v
                    while True:
                        u2, a2, f2 = prev[node]
                        chain.append((a2, f2, u2))
                        node = u2
                        if node == v:
                            return chain[::-1]
                queue.append(w)
        raise AssertionError("a cyclic SCC has a cycle through each of its worlds")
