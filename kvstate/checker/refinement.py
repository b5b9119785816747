"""Refinement of the real `Scheduler` against the spec, by exhaustive exploration of scheduler + executor states.

A world (`kvstate.checker.world`) is a real `Scheduler` (an observing subclass that only records and checks:
`kvstate.checker.observed`) driven by a real `SimExecutor`. From every world the search takes every choice the
executor and the environment have between two iterations (`kvstate.checker.environment`), each on a deep copy of the
world, and checks it (`kvstate.checker.refinement_checks`); worlds are identified by their fingerprint
(`kvstate.checker.world.fingerprint`).

Liveness (LIVE-DONE): a cycle through a world with an unfinished request is a livelock
(`kvstate.checker.world_graph`), reported as a lasso at its loop; worlds are identified without the no-progress
detector's counter (A4), so a loop of passes without progress is such a cycle. The detector's stall is a verdict of
its own: each world is expanded again when a larger count reaches it, so a stall is found exactly when a run of the
scheduler reaches it (a stall that a loop of worlds leads to is reported as that loop). There must be neither.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstate.checker.bounds import Bound
from kvstate.checker.environment import BUDGETED, Environment, NotEnabled
from kvstate.checker.explore import HOLDS, INCOMPLETE, VIOLATED
from kvstate.checker.model import AbstractModel
from kvstate.checker.observed import ObservedScheduler
from kvstate.checker.refinement_checks import RefinementChecks
from kvstate.checker.search import SearchBudget
from kvstate.checker.world import BoundRequests, World, bound_spec, fingerprint, scheduler_config
from kvstate.checker.world_graph import NoProgressCounts, WorldGraph
from kvstate.errors import InvariantViolation, SchedulerStalled
from kvstate.lifecycle import TransitionTable
from kvstate.semantics import GUARDS
from kvstate.sim import SimExecutor
from kvstate.spec import Spec, default_spec


@dataclass
class RefinementResult:
    """What one refinement search gave: its verdict, the worlds (`states`) and actions (`edges`) it explored and,
    when violated, the invariant, its message and the path to it (`loop_start`: where a lasso's loop begins)."""

    bound: Bound
    verdict: str
    states: int = 0
    edges: int = 0
    seconds: float = 0.0
    violation_id: str | None = None
    message: str = ""
    path: list[tuple[tuple, list[str]]] = field(default_factory=list)  # (action, transitions it fired)
    loop_start: int | None = None
    stop_reason: str = ""
    abstract_checked: bool = False

    @property
    def rate(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else float(self.states)


class Refinement:
    """Explores the scheduler worlds of one bound: every world reachable from the initial one by the environment's
    choices, each checked as it is reached.

    Invariants kept: a world is found once per fingerprint, in breadth-first order, so the path reported to a
    violation other than a stall is a shortest one (a world is expanded again only when a larger no-progress count
    reaches it, which changes no successor but a stall); the objects every world shares (the spec, the tables, the
    checks) are never copied with a world.
    """

    def __init__(
        self,
        bound: Bound,
        spec: Spec | None = None,
        reachable: set | None = None,
        scheduler_class: type = ObservedScheduler,
    ) -> None:
        """`reachable`: the abstract model's reachable states, which every world's abstraction must be one of
        (REFINES), or None; `scheduler_class`: the observed scheduler to drive (a subclass plants a bug)."""
        self.bound = bound
        self.spec = bound_spec(bound, spec if spec is not None else default_spec())
        self.table = TransitionTable(self.spec, GUARDS)
        self.scheduler_class = scheduler_class
        self.config = scheduler_config(bound)
        requests = BoundRequests.of(bound)
        self.environment = Environment(bound, requests)
        self.checks = RefinementChecks(bound, AbstractModel(bound, self.spec), self.config, requests, reachable)

    # ---- worlds
    def initial(self) -> World:
        scheduler = self.scheduler_class(self.config, self.spec, self.table)
        scheduler.transition_check = self.checks.transition
        sim = SimExecutor(scheduler, micro_batches=self.bound.micro_batches, copy_delay=self.bound.copy_delay)
        b = self.bound
        return World(scheduler, sim, 0, b.env_cancels, b.env_host_losses, b.env_aborts, b.env_copy_failures)

    def clone(self, world: World) -> World:
        s = world.scheduler
        shared = (s.lifecycle, s.spec, s.config, self.table, self.spec, self.checks)
        memo = {id(x): x for x in shared}  # shared by every world, not copied
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return copy.deepcopy(world, memo)

    def apply(self, world: World, action: tuple) -> None:
        """Carry out `action` on `world` (in place); raises InvariantViolation on any failed check, `NotEnabled`
        when the action cannot be taken there."""
        s = world.scheduler
        before = {rid: list(r.generated) for rid, r in s.requests.items()}
        abstract_before = self.checks.abstraction.in_bound_order(world)
        s.transition_log.clear()
        self.environment.act(world, action)
        self.checks.world(world, before)
        self.checks.step(world, action, abstract_before)
        world.scheduler.last_pass = world.sim.last_step = None  # observed; no part of the world (nor copied with it)

    # ---- search
    def explore(
        self,
        *,
        max_states: int | None = None,
        time_limit: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> RefinementResult:
        start = time.perf_counter()
        result = RefinementResult(self.bound, HOLDS, abstract_checked=self.checks.reachable is not None)
        # the clock at every state: a world (a deep copy, every check) costs far more than reading it
        search = _Search(self, result, SearchBudget(max_states, time_limit, check_every=1))
        try:
            self.checks.refusal()
        except InvariantViolation as err:
            result.violation_id, result.message = err.invariant_id, str(err)
            result.verdict = VIOLATED
        else:
            result.verdict = search.run(progress)
        result.states, result.seconds = search.graph.size, time.perf_counter() - start
        return result

    @staticmethod
    def report_livelock(result: RefinementResult, graph: WorldGraph, cycle: list[tuple[tuple, list[str], int]]) -> None:
        """LIVE-DONE violated by a cycle through an unfinished world: the path to it, then the cycle."""
        steps = sum(1 for action, _, _ in cycle if action[0] == "step")
        result.violation_id = "LIVE-DONE"
        result.message = (
            f"livelock: once arrivals stop, a cycle of {steps} scheduler step(s) repeats forever with an unfinished "
            "request (every cycle is a run the executor timing of the bound allows: copies complete within "
            "copy_delay passes, micro-batches land, consensus follows)"
        )
        prefix = graph.path_to(cycle[0][2])
        loop = [(action, fired) for action, fired, _ in cycle]
        loop[-1] = (loop[-1][0], [*loop[-1][1], "(back to the loop start)"])
        result.path = [*prefix, *loop]
        result.loop_start = len(prefix)

    def report_stall(self, result: RefinementResult, err: InvariantViolation, path: list) -> None:
        """LIVE-DONE violated by the no-progress detector (A4) at the end of `path` (no loop of worlds leads there:
        a run without progress longer than the detector's limit)."""
        result.violation_id, result.message, result.path = "LIVE-DONE", str(err), path
        result.loop_start = self.stall_loop_start(path)

    def stall_loop_start(self, path: list[tuple[tuple, list[str]]]) -> int | None:
        """Where the path to a stall (the no-progress detector fired: LIVE-DONE) first comes back to a world it
        passed (worlds are identified without the detector's counter): the steps from there repeat until the
        detector stops them. None when the path has no such repeat."""
        world = self.initial()
        seen = {fingerprint(world): 0}
        for n, (action, _) in enumerate(path[:-1], 1):
            try:
                self.apply(world, action)
            except (InvariantViolation, NotEnabled):
                return None
            key = fingerprint(world)
            if key in seen:
                return seen[key]
            seen[key] = n
        return None

    @staticmethod
    def fired(world: World) -> list[str]:
        """The transitions the last action on `world` fired, as a counterexample lists them."""
        return [f"{rid}: {source} -{event}-> {dest}" for rid, source, event, dest in world.scheduler.transition_log]


class _Search:
    """One breadth-first search of the worlds of a `Refinement`, stopped at the first violation.

    Invariants: `graph` holds every world found, identified by its fingerprint (`index`), with the edges of its
    first expansion; `counts` the largest no-progress count each world was reached with; `waiting[j]` is the visit
    and the world object with which world `j` is still to be expanded (first, or again with a larger count), and
    `queue` holds each waiting world once, in the order it was found or raised.
    """

    def __init__(self, refinement: Refinement, result: RefinementResult, budget: SearchBudget) -> None:
        self.refinement, self.result, self.budget = refinement, result, budget
        self.graph, self.counts = WorldGraph(), NoProgressCounts()
        first = refinement.initial()
        self.index = {fingerprint(first): 0}
        self.waiting: dict[int, tuple[int, World]] = {0: (0, first)}
        self.queue: deque[int] = deque([0])
        self.expanded: set[int] = set()

    def run(self, progress: Callable[[int, int], None] | None) -> str:
        """Search to the end, a violation or the budget; the verdict (`result` holds the violation, if any)."""
        graph, result, popped = self.graph, self.result, 0
        while self.queue:
            if progress is not None and popped & 31 == 0:
                progress(graph.size, result.edges)
            popped += 1
            if (reason := self.budget.stop_reason(graph.size)) is not None:
                result.stop_reason = reason
                return INCOMPLETE
            i = self.queue.popleft()
            visit, world = self.waiting.pop(i)
            if self.expand(i, visit, world):
                return VIOLATED
        if progress is not None:
            progress(graph.size, result.edges)
        return VIOLATED if self.livelock() else HOLDS

    def expand(self, i: int, visit: int, world: World) -> bool:
        """Take every action out of world `i` (reached by `visit`); True on a violation (`result` holds it)."""
        r, graph, result = self.refinement, self.graph, self.result
        first_time = i not in self.expanded
        self.expanded.add(i)
        for action in r.environment.actions(world):
            nxt = r.clone(world)
            try:
                r.apply(nxt, action)
            except NotEnabled:
                continue
            except InvariantViolation as err:
                result.edges += int(first_time)
                self.violation(i, visit, action, nxt, err)
                return True
            key, fired = fingerprint(nxt), r.fired(nxt)
            count, closed = nxt.scheduler.idle_iterations, False
            j = self.index.get(key)
            if j is None:
                j = self.index[key] = graph.add(i, action, fired, not nxt.scheduler.has_unfinished)
                self.wait(j, self.counts.first(j, visit, action, fired, count), nxt)
            elif (again := self.counts.raised(j, visit, action, fired, count)) is not None:
                self.wait(j, again, nxt)
                closed = j in self.counts.worlds_before(visit)  # the count rose around a loop of worlds
            if first_time:
                result.edges += 1
                if action[0] not in BUDGETED:
                    graph.link(i, j, action, fired)
            if closed and self.livelock():
                return True
        return False

    def wait(self, j: int, visit: int, world: World) -> None:
        """Expand world `j` with `world` (reached by `visit`): in place of a waiting one, or queued."""
        if j not in self.waiting:
            self.queue.append(j)
        self.waiting[j] = (visit, world)

    def violation(self, i: int, visit: int, action: tuple, nxt: World, err: InvariantViolation) -> None:
        """Record the violation `action` raised out of world `i`: a stall of the no-progress detector is reported
        as the livelock it closes when the graph has one, else with the path that made it; any other violation with
        the shortest path to it."""
        r, result = self.refinement, self.result
        step = (action, r.fired(nxt))
        if isinstance(err.__cause__, SchedulerStalled):
            if not self.livelock():
                r.report_stall(result, err, [*self.counts.path_to(visit), step])
            return
        result.violation_id, result.message = err.invariant_id, str(err)
        result.path = [*self.graph.path_to(i), step]
        if err.invariant_id == "LIVE-DONE":
            result.loop_start = r.stall_loop_start(result.path)

    def livelock(self) -> bool:
        """Record the livelock of the graph found so far, if it has one (its edges are real: the lasso is)."""
        cycle = self.graph.livelock()
        if cycle is None:
            return False
        Refinement.report_livelock(self.result, self.graph, cycle)
        return True
