"""Refinement of the real `Scheduler` against the spec, by exhaustive exploration of scheduler + executor states.

A world (`kvstate.checker.world`) is a real `Scheduler` (an observing subclass that only records and checks:
`kvstate.checker.observed`) driven by a real `SimExecutor`. From every world the search takes every choice the
executor and the environment have between two iterations (`kvstate.checker.environment`), each on a deep copy of the
world, and checks it (`kvstate.checker.refinement_checks`); worlds are identified by their fingerprint
(`kvstate.checker.world.fingerprint`).

Liveness (LIVE-DONE): a cycle through a world with an unfinished request is a livelock
(`kvstate.checker.world_graph`), and a stall of the no-progress detector (A4) reports one it would otherwise loop
in: there must be neither.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstate.checker.bounds import Bound
from kvstate.checker.environment import BUDGETED, Environment, NotEnabled
from kvstate.checker.explore import HOLDS, INCOMPLETE, VIOLATED
from kvstate.checker.model import AbstractModel
from kvstate.checker.observed import ObservedScheduler
from kvstate.checker.refinement_checks import RefinementChecks
from kvstate.checker.search import SearchBudget
from kvstate.checker.world import BoundRequests, World, bound_spec, fingerprint, scheduler_config, shape
from kvstate.checker.world_graph import WorldGraph
from kvstate.errors import InvariantViolation
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

    Invariants kept: a world is explored once per fingerprint, in breadth-first order, so the path reported to a
    violation is a shortest one; the objects every world shares (the spec, the tables, the checks) are never copied
    with a world.
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
        budget = SearchBudget(max_states, time_limit, check_every=32)
        result = RefinementResult(self.bound, HOLDS, abstract_checked=self.checks.reachable is not None)
        graph = WorldGraph()

        def done(verdict: str) -> RefinementResult:
            result.verdict, result.states, result.seconds = verdict, graph.size, time.perf_counter() - start
            return result

        try:
            self.checks.refusal()
        except InvariantViolation as err:
            result.violation_id, result.message = err.invariant_id, str(err)
            return done(VIOLATED)
        first = self.initial()
        index = {fingerprint(first): 0}
        worlds: dict[int, World] = {0: first}
        i = 0
        while i < graph.size:
            if progress is not None and i & 31 == 0:
                progress(graph.size, result.edges)
            if (reason := budget.stop_reason(graph.size)) is not None:
                result.stop_reason = reason
                return done(INCOMPLETE)
            world = worlds.pop(i)
            for action in self.environment.actions(world):
                nxt = self.clone(world)
                try:
                    self.apply(nxt, action)
                except NotEnabled:
                    continue
                except InvariantViolation as err:
                    result.edges += 1
                    result.violation_id, result.message = err.invariant_id, str(err)
                    result.path = [*graph.path_to(i), (action, self.fired(nxt))]
                    if err.invariant_id == "LIVE-DONE":
                        result.loop_start = self.stall_loop_start(result.path)
                    return done(VIOLATED)
                result.edges += 1
                key, fired = fingerprint(nxt), self.fired(nxt)
                j = index.get(key)
                if j is None:
                    j = index[key] = graph.add(i, action, fired, not nxt.scheduler.has_unfinished)
                    worlds[j] = nxt
                if action[0] not in BUDGETED:
                    graph.link(i, j, action, fired)
            i += 1
        if progress is not None:
            progress(graph.size, result.edges)
        cycle = graph.livelock()
        if cycle is not None:
            self._report_livelock(result, graph, cycle)
            return done(VIOLATED)
        return done(HOLDS)

    @staticmethod
    def _report_livelock(
        result: RefinementResult, graph: WorldGraph, cycle: list[tuple[tuple, list[str], int]]
    ) -> None:
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

    def stall_loop_start(self, path: list[tuple[tuple, list[str]]]) -> int | None:
        """Where the path to a stall (the no-progress detector fired: LIVE-DONE) first comes back to a world it
        passed, counting worlds equal but for the detector's counter: the steps from there repeat until the detector
        stops them. None when the path has no such repeat."""
        world = self.initial()
        seen = {shape(world): 0}
        for n, (action, _) in enumerate(path[:-1], 1):
            try:
                self.apply(world, action)
            except (InvariantViolation, NotEnabled):
                return None
            key = shape(world)
            if key in seen:
                return seen[key]
            seen[key] = n
        return None

    @staticmethod
    def fired(world: World) -> list[str]:
        """The transitions the last action on `world` fired, as a counterexample lists them."""
        return [f"{rid}: {source} -{event}-> {dest}" for rid, source, event, dest in world.scheduler.transition_log]
