"""Breadth-first exploration of the abstract model, SCC-based liveness, coverage, counterexamples.

Liveness on the abstract model (SPEC.md section 6). Arrivals stop: each request of the bound arrives at most once.
The spec's environment events (`origin = "environment"`: cancel, abort, lose_host_copy) have no fairness: they may
never happen, so they are never a way out of a loop. The model is explored with every request in its own slot
(`AbstractModel(symmetry=False)`), so each action (`Action`: its kind, its request and its event) keeps its
identity from state to state, and three properties are computed on the *fair graph* (the state graph without
environment edges):

* DEADLOCK: every reachable state that is not final has an action other than an environment event leading to
  another state (a self-loop is not a way on: a state whose only action returns to it is stuck);
* no trap (LIVE-DONE violated under every fairness): from every reachable state all-done is reachable; a
  reachable bottom SCC of the fair graph with an unfinished request is a set no run leaves once in it, so no
  fairness assumption could make its requests finish (a counterexample of LIVE-DONE, with its lasso);
* weak fairness (F1-F3 as SPEC.md states them, every non-environment action weakly fair): a *fair lasso* is a
  cycle through an SCC with an unfinished request in which every action enabled in all of its states is taken.
  The policy-free model has such lassos wherever a victim may be chosen again and again (a request replays, is
  recompute-paused, replays again): the scheduling policy (A1-A4, P1) is what excludes them, and the scheduler
  refinement checks that the real scheduler has no livelock under every executor timing of its bound. So a fair
  lasso here is information (`ModelResult.fair_lasso`: the shortest found, a run that really is weakly fair), not a
  violation.

Reachability itself uses every edge: a state the environment leads to must be live too. A search stopped by
`max_states` or `time_limit` is `incomplete`, never `holds`: liveness and coverage need the whole graph and are
not judged then.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstate.checker.bounds import Bound
from kvstate.checker.invariants import STATE_PREDICATES, STEP_PREDICATES
from kvstate.checker.model import AbstractModel
from kvstate.checker.records import AbstractState, Action
from kvstate.checker.search import SearchBudget, path_indices
from kvstate.spec import Transition

HOLDS, VIOLATED, INCOMPLETE = "holds", "violated", "incomplete"
SKIPPED = "not run"  # the abstract model of a bound with `abstract_model = false`: no verdict of its own


@dataclass
class Violation:
    invariant: str
    message: str
    path: list[tuple[Action, AbstractState]]  # (action, state after) from the initial state
    loop_start: int | None = None  # for a lasso: index in path where the repeated cycle starts


@dataclass
class ModelResult:
    bound: Bound
    verdict: str
    states: int = 0
    depth: int = 0  # states on the longest of the shortest paths from the initial state (TLC's search depth)
    edges: int = 0
    seconds: float = 0.0
    taken: dict[Transition, int] = field(default_factory=dict)
    never_enabled: list[Transition] = field(default_factory=list)
    violation: Violation | None = None
    progress_free_sccs: int = 0
    fair_lasso: Violation | None = None  # a weakly fair run that never finishes (information: no policy here)
    symmetric_states: int = 0  # distinct states up to permutations of interchangeable requests
    stop_reason: str = ""
    reachable: set | None = None  # sorted (symmetry-reduced) states, kept for the refinement check

    @property
    def rate(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else float(self.states)


def tarjan(num: int, succ: list[list[int]]) -> list[int]:
    """Iterative Tarjan: the SCC index of every node (SCCs numbered in reverse topological order)."""
    index = [-1] * num
    low = [0] * num
    comp = [-1] * num
    on_stack = [False] * num
    stack: list[int] = []
    counter = 0
    ncomp = 0
    for root in range(num):
        if index[root] != -1:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            recurse = False
            edges = succ[v]
            while i < len(edges):
                w = edges[i]
                i += 1
                if index[w] == -1:
                    work.append((v, i))
                    work.append((w, 0))
                    recurse = True
                    break
                if on_stack[w]:
                    low[v] = min(low[v], index[w])
            if recurse:
                continue
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = ncomp
                    if w == v:
                        break
                ncomp += 1
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return comp


def explore(
    model: AbstractModel,
    *,
    max_states: int | None = None,
    time_limit: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    keep_states: bool = False,
    state_predicates=STATE_PREDICATES,
    step_predicates=STEP_PREDICATES,
) -> ModelResult:
    """Explore every reachable state of `model`; stop at the first violation (its shortest counterexample)."""
    search = _Search(model, _checks(state_predicates, model), _checks(step_predicates, model))
    result = search.result
    result.verdict = search.run(SearchBudget(max_states, time_limit, check_every=256), progress)
    if result.verdict == HOLDS:
        result.never_enabled = [t for t in model.spec.transitions if t not in search.taken]
    reduced = {s._replace(requests=tuple(sorted(s.requests))) for s in search.states}
    result.reachable = reduced if keep_states and result.verdict == HOLDS else None
    result.symmetric_states = len(reduced)
    result.states, result.seconds, result.taken = len(search.states), time.perf_counter() - search.start, search.taken
    result.depth = search.depth()
    return result


class _Search:
    """One breadth-first search of an abstract model, stopped at the first violation.

    Invariants: `states[j]` was first reached from `states[parent[j]]` by `via[j]` (the initial state: parent -1),
    so parent pointers give shortest paths; `index` maps every state found to its position; `succ[i]` lists the
    other states the fair (non-environment) edges of every expanded state `i` lead to, and `fair[i]` every such
    edge as (state, action), self-loops included; `taken` counts the spec transitions the edges seen so far took.
    """

    def __init__(
        self, model: AbstractModel, state_checks: list[tuple[str, Callable]], step_checks: list[tuple[str, Callable]]
    ) -> None:
        self.model, self.state_checks, self.step_checks = model, state_checks, step_checks
        self.start = time.perf_counter()
        self.result = ModelResult(model.bound, HOLDS)
        init = model.initial()
        self.states: list[AbstractState] = [init]
        self.index: dict[AbstractState, int] = {init: 0}
        self.parent: list[int] = [-1]
        self.via: list[Action] = [Action("initial", None, None)]  # never read: no path leads to the initial state
        self.succ: list[list[int]] = []
        self.fair: list[list[tuple[int, Action]]] = []
        self.taken: dict[Transition, int] = {}
        self.environment = model.spec.environment_events

    def depth(self) -> int:
        """States on the longest shortest path found (1: the initial state alone); parents precede children."""
        level = [1] * len(self.parent)
        for j in range(1, len(level)):
            level[j] = level[self.parent[j]] + 1
        return max(level)

    def path_to(self, j: int) -> list[tuple[Action, AbstractState]]:
        return [(self.via[i], self.states[i]) for i in path_indices(self.parent, j)]

    def run(self, budget: SearchBudget, progress: Callable[[int, int], None] | None) -> str:
        """Search to the end, a violation or the budget; the verdict (`result` holds the violation, if any)."""
        result, states = self.result, self.states
        bad = _first_violation(self.state_checks, self.model, states[0])
        if bad:
            result.violation = Violation(*bad, [])
            return VIOLATED
        i = 0
        while i < len(states):
            if progress is not None and i & 255 == 0:
                progress(len(states), result.edges)
            if (reason := budget.stop_reason(len(states))) is not None:
                result.stop_reason = reason
                return INCOMPLETE
            if (violation := self.expand(i)) is not None:
                result.violation = violation
                return VIOLATED
            i += 1
        if progress is not None:
            progress(len(states), result.edges)
        result.violation, result.progress_free_sccs = _liveness(self.model, states, self.succ, self.path_to)
        if result.violation is None:
            result.fair_lasso = weakly_fair_lasso(self.model, states, self.fair, self.path_to)
        return HOLDS if result.violation is None else VIOLATED

    def expand(self, i: int) -> Violation | None:
        """Follow every edge out of state `i`, adding the states not seen yet; the first violation found."""
        model, states, index, taken = self.model, self.states, self.index, self.taken
        outs: list[int] = []  # fair successors: environment edges are no way out (module docstring)
        fair: list[tuple[int, Action]] = []
        for edge in model.successors(states[i]):
            self.result.edges += 1
            for t in edge.taken:
                taken[t] = taken.get(t, 0) + 1
            nxt = model.canonical(edge.after_requests, edge.after_pool)
            j = index.get(nxt)
            if j is None:  # a new state's invariants first, then the edge's (TLC's order too)
                j = index[nxt] = len(states)
                states.append(nxt)
                self.parent.append(i)
                self.via.append(edge.action)
                if (bad := _first_violation(self.state_checks, model, nxt)) is not None:
                    return Violation(*bad, self.path_to(j))
            if (bad := _first_violation(self.step_checks, model, edge)) is not None:
                return Violation(*bad, [*self.path_to(i), (edge.action, nxt)])
            if is_environment(edge.action, self.environment):
                continue
            fair.append((j, Action(*edge.action)))
            if j != i and j not in outs:
                outs.append(j)
        if (message := deadlock(model, states[i], outs)) is not None:
            return Violation("DEADLOCK", message, self.path_to(i))
        self.succ.append(outs)
        self.fair.append(fair)
        return None


def _checks(predicates: dict[str, Callable], model: AbstractModel) -> list[tuple[str, Callable]]:
    """The (invariant id, predicate) pairs of `predicates` whose invariant the model's spec states."""
    ids = {inv.id for inv in model.spec.invariants}
    return [(inv_id, predicate) for inv_id, predicate in predicates.items() if inv_id in ids]


def _first_violation(checks: list[tuple[str, Callable]], model: AbstractModel, subject) -> tuple[str, str] | None:
    """(invariant id, message) of the first check that `subject` (a state or an edge) fails, else None."""
    for inv_id, predicate in checks:
        message = predicate(model, subject)
        if message:
            return inv_id, message
    return None


def _liveness(
    model: AbstractModel,
    states: list[AbstractState],
    succ: list[list[int]],
    path_to: Callable[[int], list[tuple[Action, AbstractState]]],
) -> tuple[Violation | None, int]:
    """LIVE-DONE on the whole graph: bottom SCCs of the fair graph must be final (the lasso of the first one that
    is not, else None), and the number of progress-free cycles, for information."""
    environment = model.spec.environment_events
    comp = tarjan(len(states), succ)
    sccs = SccSummary(model, states, succ, comp)
    v = non_final_bottom_scc(sccs)
    if v is None:
        return None, sccs.progress_free
    c = comp[v]
    loop = _cycle_in(v, c, comp, succ)
    path = path_to(v)
    violation = Violation(
        "LIVE-DONE",
        f"a reachable set of {sccs.size[c]} states that are not final, from which no request can ever finish: "
        f"no action leaves it other than environment events ({', '.join(sorted(environment))}), which "
        "fairness does not assume; a fair run loops here forever",
        path + _lasso_actions(model, states, v, [w for _, w in loop], environment),
        loop_start=len(path),
    )
    return violation, sccs.progress_free


def weakly_fair_lasso(
    model: AbstractModel,
    states: list[AbstractState],
    fair: list[list[tuple[int, Action]]],
    path_to: Callable[[int], list[tuple[Action, AbstractState]]],
) -> Violation | None:
    """A run that is weakly fair (every non-environment action, enabled in every state it visits infinitely often,
    is taken infinitely often) and never finishes, as a lasso: the path to its loop, then a loop that visits enough
    of its SCC for that to hold of the loop itself; None when there is none.

    An SCC of the fair graph carries such a run iff it has a cycle, an unfinished request, and every action enabled
    in all of its states is taken on one of its edges (weak fairness needs no smaller sets: a subset only keeps
    more actions enabled throughout and takes fewer). The SCC nearest the initial state is chosen."""
    n = len(states)
    comp = tarjan(n, [[j for j, _ in edges] for edges in fair])
    ncomp = max(comp, default=-1) + 1
    always: list[set[Action] | None] = [None] * ncomp
    taken: list[set[Action]] = [set() for _ in range(ncomp)]
    unfinished, first = [False] * ncomp, [-1] * ncomp
    for v in range(n):  # BFS order: first[c] is the member of c nearest the initial state
        c = comp[v]
        if first[c] < 0:
            first[c] = v
        enabled = {a for _, a in fair[v]}
        prev = always[c]
        always[c] = enabled if prev is None else prev & enabled
        taken[c].update(a for j, a in fair[v] if comp[j] == c)
        unfinished[c] = unfinished[c] or not model.is_final(states[v])
    chosen = [c for c in range(ncomp) if taken[c] and unfinished[c] and (always[c] or set()) <= taken[c]]
    if not chosen:
        return None
    c = min(chosen, key=first.__getitem__)
    v = first[c]
    loop = _fair_loop(v, comp, fair)
    prefix = path_to(v)
    kinds = sorted({a.name or a.kind for a, _ in loop})
    return Violation(
        "LIVE-DONE",
        f"under weak fairness alone a run of the policy-free model never finishes: it loops through {len(loop)} "
        f"steps ({', '.join(kinds)}), taking every action that stays enabled; LIVE-DONE needs the scheduling "
        "policy (A1-A4, P1), which the scheduler refinement checks",
        prefix + [(a, states[w]) for a, w in loop],
        loop_start=len(prefix),
    )


def _fair_loop(v: int, comp: list[int], fair: list[list[tuple[int, Action]]]) -> list[tuple[Action, int]]:
    """A closed walk from `v` inside its SCC along which every action enabled at all of its states is taken: a
    shortest cycle, extended by detours (to an edge taking a missing action, or to a state where it is disabled)."""
    c = comp[v]

    def route(start: int, *, to: int | None = None, taking: Action | None = None) -> list[tuple[Action, int]]:
        """A shortest path inside the SCC from `start` along an edge into `to`, or along an edge taking `taking`."""
        prev: dict[int, tuple[int, Action]] = {}
        queue, seen = deque([start]), {start}
        while queue:
            u = queue.popleft()
            for w, a in fair[u]:
                if comp[w] != c:
                    continue
                if w == to or a == taking:
                    return [*_unwind(prev, start, u), (a, w)]
                if w not in seen:
                    seen.add(w)
                    prev[w] = (u, a)
                    queue.append(w)
        raise AssertionError("the SCC of a fair lasso is strongly connected")

    walk = route(v, to=v)
    while True:
        nodes = {v, *(w for _, w in walk)}
        enabled = set.intersection(*({a for _, a in fair[u]} for u in nodes))
        missing = sorted(enabled - {a for a, _ in walk}, key=_action_order)
        if not missing:
            return walk
        action = missing[0]
        disabled = next((u for u in range(len(fair)) if comp[u] == c and all(a != action for _, a in fair[u])), None)
        there = route(v, taking=action) if disabled is None else route(v, to=disabled)
        walk += there + route(there[-1][1], to=v)


def _action_order(action: Action) -> tuple:
    """A total order on actions, whose optional fields may be None."""
    return tuple((value is not None, value) for value in action)


def _unwind(prev: dict[int, tuple[int, Action]], start: int, node: int) -> list[tuple[Action, int]]:
    """The BFS path from `start` to `node` recorded in `prev` (node -> (predecessor, action)), as (action, node)."""
    path = []
    while node != start:
        before, action = prev[node]
        path.append((action, node))
        node = before
    return path[::-1]


def is_environment(action: Action, environment: frozenset[str]) -> bool:
    """True when `action` is a spec event the environment decides (no fairness: never a way out of a loop)."""
    kind, _, name = action[:3]
    return kind == "event" and name in environment


def deadlock(model: AbstractModel, state: AbstractState, fair_successors: list) -> str | None:
    """The DEADLOCK check: why `state` is stuck (not final, and no action but environment events leaves it).
    `fair_successors`: the other states that actions other than environment events lead to from `state`."""
    if fair_successors or model.is_final(state):
        return None
    return (
        "no enabled action leads anywhere from a state that is not final (environment events such as a "
        "cancellation may never come, so they do not count)"
    )


class SccSummary:
    """Per SCC of the fair graph (`comp[v]` = SCC of state v): its size, whether every state in it is final, and
    whether a fair edge leaves it (`leaves`; a bottom SCC has none)."""

    __slots__ = ("comp", "final", "leaves", "size")

    def __init__(
        self, model: AbstractModel, states: list[AbstractState], succ: list[list[int]], comp: list[int]
    ) -> None:
        ncomp = max(comp) + 1
        self.comp, self.size, self.final, self.leaves = comp, [0] * ncomp, [True] * ncomp, [False] * ncomp
        for v, c in enumerate(comp):
            self.size[c] += 1
            if not model.is_final(states[v]):
                self.final[c] = False
            if any(comp[w] != c for w in succ[v]):
                self.leaves[c] = True

    @property
    def progress_free(self) -> int:
        """Non-trivial SCCs with an unfinished request (information: strong fairness excludes those that leave)."""
        return sum(1 for c, n in enumerate(self.size) if n > 1 and not self.final[c])


def non_final_bottom_scc(sccs: SccSummary) -> int | None:
    """The bottom-SCC check (LIVE-DONE): the first state in BFS order (so the shortest prefix) that lies in a
    bottom SCC of the fair graph with an unfinished request; None when every bottom SCC is final."""
    for v, c in enumerate(sccs.comp):
        if not sccs.leaves[c] and not sccs.final[c]:
            return v
    return None


def _cycle_in(v: int, c: int, comp: list[int], succ: list[list[int]]) -> list[tuple[Action, int]]:
    """A path inside SCC `c` from v back to v (empty when v is alone without a self-loop): (action, node) pairs.

    Actions are not kept per edge, so the lasso names the states only; the action slot holds ("loop", None, None).
    """
    prev: dict[int, int | None] = {v: None}
    queue = deque([v])
    while queue:
        u = queue.popleft()
        for w in succ[u]:
            if comp[w] != c:
                continue
            if w == v:
                chain = [u]
                while (before := prev[chain[-1]]) is not None:
                    chain.append(before)
                nodes = [*chain[::-1][1:], v]
                return [(Action("loop", None, None), n) for n in nodes]
            if w not in prev:
                prev[w] = u
                queue.append(w)
    return []


def _lasso_actions(
    model: AbstractModel, states: list[AbstractState], start: int, nodes: list[int], environment: frozenset[str]
) -> list[tuple[Action, AbstractState]]:
    """Name the fair action of every edge of the loop start -> nodes[0] -> ... (recomputed: edges keep no labels)."""
    out, current = [], states[start]
    for node in nodes:
        target = states[node]
        for edge in model.successors(current):
            if (
                not is_environment(edge.action, environment)
                and model.canonical(edge.after_requests, edge.after_pool) == target
            ):
                out.append((edge.action, target))
                break
        current = target
    return out
