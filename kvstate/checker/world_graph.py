"""The worlds the scheduler refinement found, as a graph, and the search for a livelock on it.

Liveness (LIVE-DONE): once arrivals and faults stop (every budgeted action spends a budget the fingerprint counts,
so none lies on a cycle), only steps, early completions and early landings move a world, and every infinite run of
them is one an executor may follow under F1-F4 (copies are due within `copy_delay` passes, outputs land when they
must, consensus follows the landing of the output that announced the pause). So a cycle through a world with an
unfinished request is a livelock.

The graph is a quotient: worlds are identified without the no-progress detector's counter (A4), which only decides
when `schedule()` raises `SchedulerStalled` (`kvstate.checker.world`). `NoProgressCounts` keeps, per world, the
largest count it was reached with, so a stall reachable in the worlds with their counters is reachable here too.
"""

from __future__ import annotations

from collections import deque

from kvstate.checker.explore import tarjan
from kvstate.checker.search import path_indices


class NoProgressCounts:
    """The largest no-progress count (A4) each world of a `WorldGraph` was reached with, and the visits that reached
    it: visit 0 is the initial world's; visit `v` reached world `world[v]` from visit `parent[v]` by `via[v]`,
    firing `fired[v]`, with the detector's counter at `count[v]`.

    Invariants: `best[j]` is the count of the last visit of world `j`, and counts of successive visits of a world
    strictly increase; a visit's parent chain is a path the scheduler really took, with exactly that count.
    """

    def __init__(self) -> None:
        self.best: list[int] = [0]
        self.world: list[int] = [0]
        self.parent: list[int] = [-1]
        self.via: list[tuple] = [()]
        self.fired: list[list[str]] = [[]]

    def first(self, world: int, parent: int, action: tuple, fired: list[str], count: int) -> int:
        """Record the visit that first reached `world` (a new world of the graph); the visit's index."""
        self.best.append(count)
        return self._visit(world, parent, action, fired)

    def raised(self, world: int, parent: int, action: tuple, fired: list[str], count: int) -> int | None:
        """Record a visit reaching `world` again with a larger count than any before (the world must be expanded
        again: its stall may be nearer); None when the count is no larger."""
        if count <= self.best[world]:
            return None
        self.best[world] = count
        return self._visit(world, parent, action, fired)

    def _visit(self, world: int, parent: int, action: tuple, fired: list[str]) -> int:
        self.world.append(world)
        self.parent.append(parent)
        self.via.append(action)
        self.fired.append(fired)
        return len(self.world) - 1

    def path_to(self, visit: int) -> list[tuple[tuple, list[str]]]:
        """(action, transitions it fired) along the path that made `visit`."""
        return [(self.via[v], self.fired[v]) for v in path_indices(self.parent, visit)]

    def worlds_before(self, visit: int) -> set[int]:
        """The worlds on the path that made `visit`, its own included."""
        worlds = set()
        while visit != -1:
            worlds.add(self.world[visit])
            visit = self.parent[visit]
        return worlds


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
