"""Breadth-first exploration of the abstract model, SCC-based liveness, coverage, counterexamples.

Fairness assumption (LIVE-DONE on the abstract model). Arrivals stop: each request of the bound arrives at most
once. The spec's environment events (`origin = "environment"`: cancel, abort, lose_host_copy) are choices with no
fairness: they may never happen, so they are never a way out of a loop - a loop whose only exits are
environment events is a livelock, exactly as one with no exit. Every other action - compute steps, fence
completion (`complete`), consensus and the scheduler's decisions (admit, suspend, resume, recompute-pause,
replay) - is *strongly fair*: a transition enabled infinitely often is taken infinitely often. Under this
assumption the states a fair run visits infinitely often form a bottom SCC of the *fair graph* (the state graph
without environment edges: every fair edge leaving such a set is taken, so the set is closed); LIVE-DONE
therefore holds iff every reachable bottom SCC of the fair graph consists of final states (every request done).
Reachability itself uses every edge: a state the environment leads to must be live too. Weak fairness alone is
not enough in the pure spec: the spec lets a scheduler suspend and resume a request forever (a suspend/resume
ping-pong cycle) while compute is enabled only intermittently. Such progress-free cycles are reported as
information (`progress_free_sccs`): ruling them out is the scheduling policy's job, and the scheduler refinement
checks that the real policy has none (no cycle of scheduler steps with an unfinished request once arrivals stop).

Deadlock freedom (DEADLOCK): every reachable state that is not final has an enabled action other than an
environment event leading to another state (a state only a cancellation could leave is stuck).

A search stopped by `max_states` or `time_limit` is `incomplete`, never `holds`: liveness and coverage need the
whole graph and are not judged then.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstate.checker.bounds import Bound
from kvstate.checker.invariants import STATE_PREDICATES, STEP_PREDICATES
from kvstate.checker.model import AbstractModel, AbstractState, Action
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
    stop_reason: str = ""
    reachable: set | None = None  # canonical states, kept for the refinement check

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
        result.reachable = set(search.states) if keep_states else None
    result.states, result.seconds, result.taken = len(search.states), time.perf_counter() - search.start, search.taken
    result.depth = search.depth()
    return result


class _Search:
    """One breadth-first search of an abstract model, stopped at the first violation.

    Invariants: `states[j]` was first reached from `states[parent[j]]` by `via[j]` (the initial state: parent -1),
    so parent pointers give shortest paths; `index` maps every state found to its position; `succ[i]` lists the
    other states the fair (non-environment) edges of every expanded state `i` lead to; `taken` counts the spec
    transitions the edges seen so far took.
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
        return HOLDS if result.violation is None else VIOLATED

    def expand(self, i: int) -> Violation | None:
        """Follow every edge out of state `i`, adding the states not seen yet; the first violation found."""
        model, states, index, taken = self.model, self.states, self.index, self.taken
        outs: list[int] = []  # fair successors: environment edges are no way out (module docstring)
        for edge in model.successors(states[i]):
            self.result.edges += 1
            for t in edge.taken:
                taken[t] = taken.get(t, 0) + 1
            nxt = model.canonical(edge.after_requests, edge.after_pool)
            if (bad := _first_violation(self.step_checks, model, edge)) is not None:
                return Violation(*bad, [*self.path_to(i), (edge.action, nxt)])
            j = index.get(nxt)
            if j is None:
                j = index[nxt] = len(states)
                states.append(nxt)
                self.parent.append(i)
                self.via.append(edge.action)
                if (bad := _first_violation(self.state_checks, model, nxt)) is not None:
                    return Violation(*bad, self.path_to(j))
            if j != i and j not in outs and not is_environment(edge.action, self.environment):
                outs.append(j)
        if (message := deadlock(model, states[i], outs)) is not None:
            return Violation("DEADLOCK", message, self.path_to(i))
        self.succ.append(outs)
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


def is_environment(action: Action, environment: frozenset[str]) -> bool:
    """True when `action` is a spec event the environment decides (no fairness: never a way out of a loop)."""
    kind, _, name = action
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
