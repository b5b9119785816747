"""Breadth-first exploration of the abstract model, SCC-based liveness, coverage, counterexamples.

Fairness assumption (LIVE-DONE on the abstract model). Arrivals stop: each request of the bound arrives at most
once. Cancel, abort and lose_host_copy are environment choices with no fairness: they may never happen. Every
other action - compute steps, fence completion (`complete`), consensus and the scheduler's decisions (admit,
suspend, resume, recompute-pause, replay) - is *strongly fair*: a transition enabled infinitely often is taken
infinitely often. Under this assumption the states a fair run visits infinitely often form a bottom SCC of the
state graph (every edge leaving such a state is taken, so the set is closed); LIVE-DONE therefore holds iff every
reachable bottom SCC consists of final states (every request done). Weak fairness alone is not enough in the
pure spec: the spec lets a scheduler suspend and resume a request forever (a suspend/resume ping-pong cycle)
while compute is enabled only intermittently. Such progress-free cycles are reported as information
(`progress_free_sccs`): ruling them out is the scheduling policy's job, and the scheduler refinement checks that
the real policy has none (no cycle of scheduler steps with an unfinished request once arrivals stop).

Deadlock freedom: every reachable state that is not final has an enabled action leading to another state.

A search stopped by `max_states` or `time_limit` is `incomplete`, never `holds`: liveness and coverage need the
whole graph and are not judged then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvstate.checker.bounds import Bound
from kvstate.checker.invariants import STATE_PREDICATES, STEP_PREDICATES
from kvstate.checker.search import SearchBudget, path_indices
from kvstate.checker.model import AbstractModel, Action, AState
from kvstate.spec import Transition

HOLDS, VIOLATED, INCOMPLETE = "holds", "violated", "incomplete"


@dataclass
class Violation:
    invariant: str
    message: str
    path: list[tuple[Action, AState]]  # (action, state after) from the initial state
    loop_start: int | None = None  # for a lasso: index in path where the repeated cycle starts


@dataclass
class ModelResult:
    bound: Bound
    verdict: str
    states: int = 0
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


def explore(model: AbstractModel, *, max_states: int | None = None, time_limit: float | None = None,
            progress: Callable[[int, int], None] | None = None, keep_states: bool = False,
            state_predicates=STATE_PREDICATES, step_predicates=STEP_PREDICATES) -> ModelResult:
    """Explore every reachable state of `model`; stop at the first violation (its shortest counterexample)."""
    start = time.perf_counter()
    budget = SearchBudget(max_states, time_limit, check_every=256)
    result = ModelResult(model.bound, HOLDS)
    state_checks = [(i, p) for i, p in state_predicates.items() if i in {inv.id for inv in model.spec.invariants}]
    step_checks = [(i, p) for i, p in step_predicates.items() if i in {inv.id for inv in model.spec.invariants}]
    init = model.initial()
    states: list[AState] = [init]
    index: dict[AState, int] = {init: 0}
    parent: list[int] = [-1]
    via: list[Action | None] = [None]
    succ: list[list[int]] = []
    taken: dict[Transition, int] = {}

    def path_to(j: int) -> list[tuple[Action, AState]]:
        return [(via[i], states[i]) for i in path_indices(parent, j)]

    def finish(verdict: str) -> ModelResult:
        result.verdict = verdict
        result.states, result.seconds, result.taken = len(states), time.perf_counter() - start, taken
        return result

    def state_violation(state: AState) -> tuple[str, str] | None:
        for inv_id, predicate in state_checks:
            message = predicate(model, state)
            if message:
                return inv_id, message
        return None

    bad = state_violation(init)
    if bad:
        result.violation = Violation(*bad, [])
        return finish(VIOLATED)
    i = 0
    while i < len(states):
        if progress is not None and i & 255 == 0:
            progress(len(states), result.edges)
        if (reason := budget.stop_reason(len(states))) is not None:
            result.stop_reason = reason
            return finish(INCOMPLETE)
        state = states[i]
        outs: list[int] = []
        for step in model.successors(state):
            result.edges += 1
            for t in step.taken:
                taken[t] = taken.get(t, 0) + 1
            for inv_id, predicate in step_checks:
                message = predicate(model, step)
                if message:
                    nxt = model.canonical(step.after_requests, step.after_pool)
                    result.violation = Violation(inv_id, message, path_to(i) + [(step.action, nxt)])
                    return finish(VIOLATED)
            nxt = model.canonical(step.after_requests, step.after_pool)
            j = index.get(nxt)
            if j is None:
                j = len(states)
                index[nxt] = j
                states.append(nxt)
                parent.append(i)
                via.append(step.action)
                bad = state_violation(nxt)
                if bad:
                    result.violation = Violation(*bad, path_to(j))
                    return finish(VIOLATED)
            if j != i and j not in outs:
                outs.append(j)
        if not outs and not model.is_final(state):
            result.violation = Violation("DEADLOCK", "no enabled action leads anywhere from a state that is not final",
                                         path_to(i))
            return finish(VIOLATED)
        succ.append(outs)
        i += 1
    if progress is not None:
        progress(len(states), result.edges)
    # liveness: bottom SCCs must be final; count progress-free cycles for information
    comp = tarjan(len(states), succ)
    ncomp = max(comp) + 1
    size = [0] * ncomp
    leaves = [False] * ncomp
    final = [True] * ncomp
    for v, c in enumerate(comp):
        size[c] += 1
        if not model.is_final(states[v]):
            final[c] = False
        if any(comp[w] != c for w in succ[v]):
            leaves[c] = True
    result.progress_free_sccs = sum(1 for c in range(ncomp) if size[c] > 1 and not final[c])
    for v, c in enumerate(comp):  # BFS order: the first hit has the shortest prefix
        if not leaves[c] and not final[c]:
            loop = _cycle_in(v, c, comp, succ)
            path = path_to(v)
            result.violation = Violation(
                "LIVE-DONE",
                "a reachable set of states from which no request can ever finish (bottom SCC of "
                f"{size[c]} states that are not final): a fair run loops here forever",
                path + _lasso_actions(model, states, v, [w for _, w in loop]), loop_start=len(path),
            )
            return finish(VIOLATED)
    all_edges = model.spec.transitions
    result.never_enabled = [t for t in all_edges if t not in taken]
    if keep_states:
        result.reachable = set(states)
    return finish(HOLDS)


def _cycle_in(v: int, c: int, comp: list[int], succ: list[list[int]]) -> list[tuple[Action, int]]:
    """A path inside SCC `c` from v back to v (empty when v is alone without a self-loop): (action, node) pairs.

    Actions are not kept per edge, so the lasso names the states only; the action slot holds ("loop", None, None).
    """
    from collections import deque

    prev = {v: None}
    queue = deque([v])
    while queue:
        u = queue.popleft()
        for w in succ[u]:
            if comp[w] != c:
                continue
            if w == v:
                chain = [u]
                while prev[chain[-1]] is not None:
                    chain.append(prev[chain[-1]])
                nodes = chain[::-1][1:] + [v]
                return [(("loop", None, None), n) for n in nodes]
            if w not in prev:
                prev[w] = u
                queue.append(w)
    return []


def _lasso_actions(model: AbstractModel, states: list[AState], start: int, nodes: list[int]) -> list[tuple[Action, AState]]:
    """Name the action of every edge of the loop start -> nodes[0] -> ... (recomputed: edges keep no labels)."""
    out, current = [], states[start]
    for node in nodes:
        target = states[node]
        for step in model.successors(current):
            if model.canonical(step.after_requests, step.after_pool) == target:
                out.append((step.action, target))
                break
        current = target
    return out


def coverage_line(result: ModelResult, total: Iterable[Transition]) -> str:
    total = list(total)
    return f"coverage {len(total) - len(result.never_enabled)}/{len(total)} transitions"
