"""Refinement of the real `Scheduler` against the spec, by exhaustive exploration of scheduler + sim states.

The world is a real `Scheduler` (an observing subclass that only records and checks) driven by a real
`SimExecutor`. Environment nondeterminism at every point between iterations: the next request arrives
(requests arrive in the bound's order), one iteration runs (`SimExecutor.step`: consensus, schedule, copies,
compute), a request is cancelled (at most `env_cancels` per run) or a suspended request loses its host copy (at
most `env_host_losses` per run). Each branch deep-copies the world; worlds are identified by a canonical
fingerprint (request states, token lists, block tables, free lists, KV contents of held blocks, admission
order, environment budget; iteration numbers, plan ids and statistics counters are left out).

Checked on every action: every transition the scheduler fires (collected with its `on_transition` listener)
is a spec edge, and the checker's own table with the real guards resolves the same edge just before it fires
(its guard held); `Scheduler.check_invariants` (pool, RES-STATE, OUT-DISJOINT, OUT-STATE; run by the sim);
VICTIM-ONCE; generated tokens only grow (GEN-APPEND); outputs equal `reference_output` (OUT-EQUIV: a finished
request's whole output, a cancelled or unfinished one a prefix of it); the abstraction of the world satisfies
every state predicate of the abstract model and, when the abstract model's reachable set is given, is one of
its states (REFINES: the scheduler never reaches a state the spec does not allow).

Liveness (LIVE-DONE): the scheduler is deterministic given the environment, so once arrivals, cancellations and
losses stop only `step` moves the world: the step edges form a functional graph, and a cycle in it through a
world with an unfinished request is a livelock (a stall, or a suspend/resume ping-pong). There must be none.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstate.checker.bounds import Bound
from kvstate.checker.explore import HOLDS, INCOMPLETE, VIOLATED
from kvstate.checker.invariants import STATE_PREDICATES
from kvstate.checker.search import SearchBudget, path_indices
from kvstate import policy
from kvstate.checker.model import ABSENT, COMPUTED, IN_FLIGHT, NONE, PREFILL, STATE, AbstractModel, AState
from kvstate.config import RequestRejected, SchedulerConfig
from kvstate.errors import InvariantViolation, KVStateError
from kvstate.lifecycle import TransitionTable
from kvstate.scheduler import Scheduler, SchedulerStalled
from kvstate.semantics import GUARDS
from kvstate.sim import SimExecutor, reference_output
from kvstate.spec import Spec, load_spec


def prompt_of(index: int, length: int) -> list[int]:
    """The concrete prompt of request `index` of a bound (distinct per request)."""
    return [(index * 31 + k * 7) % 97 + 1 for k in range(length)]


class ObservedScheduler(Scheduler):
    """The real scheduler plus observation: a transition log, a guard cross-check and VICTIM-ONCE."""

    def __init__(self, config: SchedulerConfig, spec: Spec, checker_table: TransitionTable) -> None:
        super().__init__(config, spec, on_transition=self._record)
        self.checker_table = checker_table
        self.transition_log: list[tuple[object, str, str, str]] = []
        self.victims_this_pass: set = set()

    def _record(self, request, transition) -> None:
        self.transition_log.append((request.request_id, transition.source, transition.event, transition.dest))

    def schedule(self):
        """The real pass, then its step simulation: the pass must be one the spec's policy allows from the
        state it started in (VICTIM-*, PROMOTE-GATE, ADMIT-ORDER, ADMIT-HOLD, WORK-CONSERVE; `kvstate.policy`)."""
        self.victims_this_pass = set()
        before = policy.snapshot(self)
        out = super().schedule()
        policy.check_pass(self.spec, before, self.last_pass.record, out)
        return out

    def _preempt(self, victim, step) -> None:
        if victim.request_id in self.victims_this_pass:
            raise InvariantViolation("VICTIM-ONCE", f"request {victim.request_id!r} chosen as a victim twice in "
                                     f"pass {self.iteration}")
        self.victims_this_pass.add(victim.request_id)
        return super()._preempt(victim, step)

    def _fire(self, request, event):
        expected = self.checker_table.resolve(request, event, self._pass)
        before = request.state
        transition = super()._fire(request, event)
        if expected is None or (expected.source, expected.dest) != (transition.source, transition.dest):
            want = "no edge (its guard does not hold)" if expected is None else f"{expected.source} -> {expected.dest}"
            raise InvariantViolation("SPEC-EDGE", f"request {request.request_id!r} took {event} {before} -> "
                                     f"{transition.dest}; the spec with the real guards gives {want}")
        return transition


@dataclass
class World:
    scheduler: ObservedScheduler
    sim: SimExecutor
    submitted: int = 0
    cancels_left: int = 0
    losses_left: int = 0


@dataclass
class RefinementResult:
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
    """Explores the scheduler worlds of one bound."""

    def __init__(self, bound: Bound, spec: Spec | None = None, reachable: set | None = None,
                 scheduler_class: type = ObservedScheduler) -> None:
        self.bound = bound
        self.spec = spec if spec is not None else load_spec()
        self.table = TransitionTable(self.spec, GUARDS)
        self.edges = {(t.source, t.event, t.dest) for t in self.spec.transitions}
        self.model = AbstractModel(bound, self.spec)
        self.reachable = reachable
        self.scheduler_class = scheduler_class
        budgets = {name: getattr(bound, name) for name in ("max_batch_size", "max_num_tokens")
                   if getattr(bound, name) is not None}  # left out of the bound: the config's defaults
        self.config = SchedulerConfig(
            gpu_blocks=bound.gpu_blocks, host_blocks=bound.host_blocks, block_size=bound.block_size,
            prefill_chunk_size=bound.chunk_size, pipeline_stages=bound.pipeline_stages,
            enable_recompute_pause=bound.recompute_pause, **budgets,
        )
        self.prompts = [prompt_of(i, p) for i, (p, _) in enumerate(bound.requests)]
        self.references = [reference_output(self.prompts[i], m) for i, (_, m) in enumerate(bound.requests)]

    # ---- worlds
    def initial(self) -> World:
        scheduler = self.scheduler_class(self.config, self.spec, self.table)
        return World(scheduler, SimExecutor(scheduler), 0, self.bound.env_cancels, self.bound.env_host_losses)

    def clone(self, world: World) -> World:
        s = world.scheduler
        memo = {id(x): x for x in (s.lifecycle, s.spec, s.config, self.table, self.spec)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return copy.deepcopy(world, memo)

    def actions(self, world: World) -> list[tuple]:
        s = world.scheduler
        out: list[tuple] = []
        if world.submitted < len(self.bound.requests):
            out.append(("submit", world.submitted))
        out.append(("step",))
        if world.cancels_left:
            out += [("cancel", rid) for rid in sorted(s.requests)]
        if world.losses_left:
            out += [("lose_host_copy", r.request_id) for r in s.suspended]
        return out

    def apply(self, world: World, action: tuple) -> None:
        """Carry out `action` on `world` (in place); raises InvariantViolation on any failed check."""
        s = world.scheduler
        before = {rid: list(r.generated) for rid, r in s.requests.items()}
        s.transition_log.clear()
        try:
            if action[0] == "submit":
                i = action[1]
                s.submit(self.prompts[i], self.bound.requests[i][1], request_id=i)
                world.submitted += 1
            elif action[0] == "step":
                world.sim.step()
            elif action[0] == "cancel":
                s.cancel(action[1])
                world.cancels_left -= 1
            elif action[0] == "lose_host_copy":
                s.lose_host_copy(action[1])
                world.losses_left -= 1
            else:
                raise ValueError(f"unknown action {action!r}")
        except InvariantViolation:
            raise
        except SchedulerStalled as err:
            raise InvariantViolation("LIVE-DONE", str(err)) from err
        except KVStateError as err:
            raise InvariantViolation("SPEC-EDGE", f"{type(err).__name__}: {err}") from err
        for rid, source, event, dest in s.transition_log:
            if (source, event, dest) not in self.edges:
                raise InvariantViolation("SPEC-EDGE", f"request {rid!r} took {source} -{event}-> {dest}, not a spec edge")
        for rid, old in before.items():
            now = s.get(rid).generated
            if now[:len(old)] != old:
                raise InvariantViolation("GEN-APPEND", f"request {rid!r} generated {old} then {now}")
        for rid, r in list(s.requests.items()) + list(s.finished.items()):
            ref = self.references[rid]
            if r.done_reason == "finished" and list(r.generated) != ref:
                raise InvariantViolation("OUT-EQUIV", f"request {rid!r} finished with {r.generated}, alone it gives {ref}")
            if list(r.generated) != ref[:len(r.generated)]:
                raise InvariantViolation("OUT-EQUIV", f"request {rid!r} generated {r.generated}, not a prefix of {ref}")
        abstract = self.abstraction(world)
        for inv_id, predicate in STATE_PREDICATES.items():
            message = predicate(self.model, abstract)
            if message:
                raise InvariantViolation(inv_id, f"abstraction of the scheduler state: {message}")
        if self.reachable is not None and not any(v in self.reachable for v in self._variants(abstract)):
            raise InvariantViolation("REFINES", "the scheduler reached a state whose abstraction the spec's model does "
                                     f"not reach: {self.describe_abstract(abstract)}")

    def abstraction(self, world: World) -> AState:
        """The abstract spec state of a world (the mapping the refinement is checked through)."""
        s = world.scheduler
        reqs = []
        for i in range(len(self.bound.requests)):
            group = self.bound.group_of(i)
            r = s.requests.get(i) or s.finished.get(i)
            if r is None:
                reqs.append((group, ABSENT, 0, 0, 0, 0, NONE, self.bound.requests[i][0], 0))
            elif r.state in self.model.terminal:
                reqs.append((group, r.state, 0, 0, r.num_gpu_blocks, r.num_host_blocks, NONE, 0, 0))
            else:
                reqs.append((group, r.state, r.num_computed_tokens, len(r.generated), r.num_gpu_blocks,
                             r.num_host_blocks, r.termination_reason or NONE, len(r.prefill_tokens), 0))
        pool = s.pool
        return (tuple(sorted(reqs)), pool.gpu_free_blocks, pool.host_free_blocks, len(pool.gpu.fenced),
                len(pool.host.fenced))

    def _variants(self, state: AState) -> list[AState]:
        """The abstract states a world may stand for: a request awaiting consensus after a decode step may or may
        not still have that step in the pipeline (`in_flight`); the synchronous sim never has, the model allows both."""
        reqs, rest = state[0], state[1:]
        pending = self.model.pending_reset
        options = [[r] if r[STATE] != pending or r[COMPUTED] < r[PREFILL] else [r, r[:IN_FLIGHT] + (1,)] for r in reqs]
        out = [()]
        for choice in options:
            out = [prefix + (r,) for prefix in out for r in choice]
        return [(tuple(sorted(v)), *rest) for v in out]

    def describe_abstract(self, state: AState) -> str:
        return "; ".join(self.model.describe_request(r) for r in state[0]) + "; " + self.model.describe_pool(state)

    def fingerprint(self, world: World) -> tuple:
        s, sim = world.scheduler, world.sim
        pool = s.pool
        active = []
        for rid in sorted(s.requests):
            r = s.requests[rid]
            gpu, host = pool.gpu_blocks(rid), pool.host_blocks(rid)
            active.append((rid, r.state, r.num_computed_tokens, tuple(r.generated), r.prefill_tokens, gpu, host,
                           r.termination_reason, tuple(tuple(sim.gpu[b]) for b in gpu),
                           tuple(tuple(sim.host[b]) for b in host)))
        finished = tuple(sorted((rid, r.done_reason, tuple(r.generated)) for rid, r in s.finished.items()))
        plans = tuple(sorted((p.request_id, p.direction, p.pairs) for p in pool.in_flight.values()))
        return (tuple(active), finished, tuple(r.request_id for r in s.admitted), tuple(sorted(pool.gpu._free)),
                tuple(sorted(pool.host._free)), tuple(sorted(pool.gpu.fenced)), tuple(sorted(pool.host.fenced)),
                plans, world.submitted, world.cancels_left, world.losses_left, s.host_tier_fallback)

    def check_refusal(self) -> None:
        """LIVE-REFUSE: a request that can never fit alone is refused at submission."""
        scheduler = Scheduler(self.config, self.spec)
        too_long = self.bound.gpu_blocks * self.bound.block_size
        try:
            scheduler.submit([1] * too_long, 1)
        except RequestRejected:
            return
        raise InvariantViolation("LIVE-REFUSE", f"a request of {too_long} + 1 tokens was accepted by a GPU tier of "
                                 f"{too_long} tokens")

    # ---- search
    def explore(self, *, max_states: int | None = None, time_limit: float | None = None,
                progress: Callable[[int, int], None] | None = None) -> RefinementResult:
        start = time.perf_counter()
        budget = SearchBudget(max_states, time_limit, check_every=32)
        result = RefinementResult(self.bound, HOLDS, abstract_checked=self.reachable is not None)
        parent: list[int] = [-1]
        via: list[tuple] = [()]
        fired: list[list[str]] = [[]]
        final: list[bool] = [True]
        step_next: list[int] = [-1]

        def path_to(j: int) -> list[tuple[tuple, list[str]]]:
            return [(via[i], fired[i]) for i in path_indices(parent, j)]

        def done(verdict: str) -> RefinementResult:
            result.verdict, result.states, result.seconds = verdict, len(parent), time.perf_counter() - start
            return result

        try:
            self.check_refusal()
        except InvariantViolation as err:
            result.violation_id, result.message = err.invariant_id, str(err)
            return done(VIOLATED)
        first = self.initial()
        index = {self.fingerprint(first): 0}
        worlds: dict[int, World] = {0: first}
        i = 0
        while i < len(parent):
            if progress is not None and i & 31 == 0:
                progress(len(parent), result.edges)
            if (reason := budget.stop_reason(len(parent))) is not None:
                result.stop_reason = reason
                return done(INCOMPLETE)
            world = worlds.pop(i)
            for action in self.actions(world):
                result.edges += 1
                nxt = self.clone(world)
                try:
                    self.apply(nxt, action)
                except InvariantViolation as err:
                    result.violation_id, result.message = err.invariant_id, str(err)
                    result.path = path_to(i) + [(action, self._log(nxt))]
                    return done(VIOLATED)
                key = self.fingerprint(nxt)
                j = index.get(key)
                if j is None:
                    j = len(parent)
                    index[key] = j
                    parent.append(i)
                    via.append(action)
                    fired.append(self._log(nxt))
                    final.append(not nxt.scheduler.has_unfinished)
                    step_next.append(-1)
                    worlds[j] = nxt
                if action == ("step",):
                    step_next[i] = j
            i += 1
        if progress is not None:
            progress(len(parent), result.edges)
        # LIVE-DONE: a cycle of step edges through an unfinished world is a livelock
        color = [0] * len(parent)  # 0 new, 1 on the current walk, 2 done
        for root in range(len(parent)):
            walk = []
            v = root
            while v != -1 and color[v] == 0:
                color[v] = 1
                walk.append(v)
                v = step_next[v]
            if v != -1 and color[v] == 1:
                cycle = walk[walk.index(v):]
                if not all(final[c] for c in cycle):
                    result.violation_id = "LIVE-DONE"
                    result.message = (f"livelock: once arrivals stop, {len(cycle)} scheduler step(s) repeat forever "
                                      "with an unfinished request")
                    prefix = path_to(v)
                    result.path = prefix + [(("step",), fired[c]) for c in cycle[1:]] + [(("step",), ["(back to the loop start)"])]
                    result.loop_start = len(prefix)
                    return done(VIOLATED)
            for w in walk:
                color[w] = 2
        return done(HOLDS)

    @staticmethod
    def _log(world: World) -> list[str]:
        return [f"{rid}: {source} -{event}-> {dest}" for rid, source, event, dest in world.scheduler.transition_log]


def replay_refinement(bound: Bound | dict, actions: list[tuple], *, invariant: str | None = None,
                      spec_path: str | None = None) -> None:
    """Replay a refinement counterexample; raises (AssertionError) when the violation is still there."""
    if isinstance(bound, dict):
        bound = Bound.from_dict(bound)
    refinement = Refinement(bound, load_spec(spec_path) if spec_path else None)
    world = refinement.initial()
    refinement.check_refusal()
    for action in actions:
        refinement.apply(world, tuple(action))
    if invariant == "LIVE-DONE":
        for _ in range(1000):
            if not world.scheduler.has_unfinished:
                return
            refinement.apply(world, ("step",))
        raise InvariantViolation("LIVE-DONE", "requests still unfinished after 1000 scheduler steps")
