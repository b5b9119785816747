"""Refinement of the real `Scheduler` against the spec, by exhaustive exploration of scheduler + sim states.

The world is a real `Scheduler` (an observing subclass that only records and checks) driven by a real
`SimExecutor`. Environment nondeterminism at every point between iterations: the next request arrives
(requests arrive in the bound's order), one iteration runs (`SimExecutor.step`: consensus, schedule, copies,
compute), a request is cancelled (at most `env_cancels` per run) or a suspended request loses its host copy (at
most `env_host_losses` per run). Each branch deep-copies the world; worlds are identified by a canonical
fingerprint (request states, token lists, block tables, free lists, KV contents of held blocks, admission
order, environment budget; iteration numbers, plan ids and statistics counters are left out).

Checked on every action: every transition the scheduler fires (collected with its `on_transition` listener)
is a spec edge, and every decision the scheduler takes (an edge, or a refusal when no guard holds) is the one
the checker's own table with the real guards resolves on the same view just before (SPEC-EDGE);
`Scheduler.check_invariants` (pool, RES-STATE, OUT-DISJOINT, OUT-STATE; run by the sim); VICTIM-ONCE; generated
tokens only grow (GEN-APPEND); outputs equal `reference_output` (OUT-EQUIV: a finished request's whole output, a
cancelled or unfinished one a prefix of it); the abstraction of the world satisfies every state predicate of the
abstract model and, when the abstract model's reachable set is given, is one of
its states (REFINES: the scheduler never reaches a state the spec does not allow).

With `micro_batches` > 1 the sim keeps that many outputs in flight (`SimExecutor`): a step lands the oldest output
when it must (`Scheduler.must_land`) before it schedules, so cancellations and lost host copies also hit requests
whose step is in flight, and a request preempted while its decode step is in flight receives its token suspended
or awaiting consensus (the deferred finish). The abstraction shows a request whose step is in flight as it was
before that step (`AbstractModel` computes a step atomically): the blocks allocated for the step count as free.

Liveness (LIVE-DONE): the scheduler is deterministic given the environment, so once arrivals, cancellations and
losses stop only `step` moves the world: the step edges form a functional graph, and a cycle in it through a
world with an unfinished request is a livelock (a stall, or a suspend/resume ping-pong). There must be none.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from kvstate import policy
from kvstate.checker.bounds import Bound
from kvstate.checker.explore import HOLDS, INCOMPLETE, VIOLATED
from kvstate.checker.invariants import STATE_PREDICATES
from kvstate.checker.model import ABSENT, NONE, AbstractModel, AbstractRequest, AbstractState
from kvstate.checker.search import SearchBudget, path_indices
from kvstate.config import RequestRejected, SchedulerConfig
from kvstate.errors import InvariantViolation, KVStateError
from kvstate.lifecycle import TransitionTable
from kvstate.scheduler import Scheduler, SchedulerStalled
from kvstate.semantics import GUARDS
from kvstate.sim import SimExecutor, reference_output
from kvstate.spec import Spec, load_spec


def bound_index(request_id: Hashable) -> int:
    """The index in its bound of a request the refinement submitted (it submits request `i` with id `i`)."""
    if not isinstance(request_id, int):
        raise TypeError(f"request id {request_id!r}: the refinement submits the bound's requests with ids 0, 1, ...")
    return request_id


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
        done = self.last_pass
        if done is None:  # schedule() keeps every pass it completes in last_pass
            raise KVStateError("Scheduler.schedule() returned without keeping its pass in last_pass")
        policy.check_pass(self.spec, before, done.record, out)
        return out

    def _preempt(self, victim, step) -> None:
        if victim.request_id in self.victims_this_pass:
            raise InvariantViolation(
                "VICTIM-ONCE", f"request {victim.request_id!r} chosen as a victim twice in pass {self.iteration}"
            )
        self.victims_this_pass.add(victim.request_id)
        return super()._preempt(victim, step)

    def _try_fire(self, request, event, pass_):
        """Every decision the scheduler takes, cross-checked: the edge it took (or its refusal: no guard held) is
        the one the checker's table resolves with the real guards on the same view (SPEC-EDGE)."""
        expected = self.checker_table.resolve(request, event, self._view(pass_))
        before = request.state
        transition = super()._try_fire(request, event, pass_)
        taken = None if transition is None else (transition.source, transition.dest)
        if taken != (None if expected is None else (expected.source, expected.dest)):
            want = "no edge (its guard does not hold)" if expected is None else f"{expected.source} -> {expected.dest}"
            got = "no edge" if transition is None else f"{before} -> {transition.dest}"
            raise InvariantViolation(
                "SPEC-EDGE",
                f"request {request.request_id!r} took {event}: {got}; the spec with the real guards gives {want}",
            )
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

    def __init__(
        self,
        bound: Bound,
        spec: Spec | None = None,
        reachable: set | None = None,
        scheduler_class: type = ObservedScheduler,
    ) -> None:
        self.bound = bound
        self.spec = spec if spec is not None else load_spec()
        self.table = TransitionTable(self.spec, GUARDS)
        self.edges = {(t.source, t.event, t.dest) for t in self.spec.transitions}
        self.model = AbstractModel(bound, self.spec)
        self.reachable = reachable
        self.scheduler_class = scheduler_class
        budgets = {
            name: getattr(bound, name)
            for name in ("max_batch_size", "max_num_tokens")
            if getattr(bound, name) is not None
        }  # left out of the bound: the config's defaults
        self.config = SchedulerConfig(
            gpu_blocks=bound.gpu_blocks,
            host_blocks=bound.host_blocks,
            block_size=bound.block_size,
            prefill_chunk_size=bound.chunk_size,
            pipeline_stages=bound.pipeline_stages,
            enable_recompute_pause=bound.recompute_pause,
            **budgets,
        )
        self.prompts = [prompt_of(i, p) for i, (p, _) in enumerate(bound.requests)]
        self.references = [reference_output(self.prompts[i], m) for i, (_, m) in enumerate(bound.requests)]

    # ---- worlds
    def initial(self) -> World:
        scheduler = self.scheduler_class(self.config, self.spec, self.table)
        sim = SimExecutor(scheduler, micro_batches=self.bound.micro_batches)
        return World(scheduler, sim, 0, self.bound.env_cancels, self.bound.env_host_losses)

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
            out += [("cancel", rid) for rid in sorted(s.requests, key=bound_index)]
        if world.losses_left:
            out += [("lose_host_copy", r.request_id) for r in s.suspended]
        return out

    def apply(self, world: World, action: tuple) -> None:
        """Carry out `action` on `world` (in place); raises InvariantViolation on any failed check."""
        s = world.scheduler
        before = {rid: list(r.generated) for rid, r in s.requests.items()}
        s.transition_log.clear()
        self._act(world, action)
        self._check_world(world, before)

    def _act(self, world: World, action: tuple) -> None:
        """Carry out `action`; a scheduler error is the violation it stands for."""
        s = world.scheduler
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

    def _check_world(self, world: World, before: dict[Hashable, list[int]]) -> None:
        """The checks after every action: spec edges, GEN-APPEND and OUT-EQUIV against `before` (each request's
        tokens before the action), the state invariants of the abstraction and, with the abstract model's
        reachable states at hand, REFINES."""
        s = world.scheduler
        for rid, source, event, dest in s.transition_log:
            if (source, event, dest) not in self.edges:
                raise InvariantViolation(
                    "SPEC-EDGE", f"request {rid!r} took {source} -{event}-> {dest}, not a spec edge"
                )
        for rid, old in before.items():
            now = s.get(rid).generated
            if now[: len(old)] != old:
                raise InvariantViolation("GEN-APPEND", f"request {rid!r} generated {old} then {now}")
        for rid, r in list(s.requests.items()) + list(s.finished.items()):
            ref = self.references[bound_index(rid)]
            if r.done_reason == "finished" and list(r.generated) != ref:
                raise InvariantViolation(
                    "OUT-EQUIV", f"request {rid!r} finished with {r.generated}, alone it gives {ref}"
                )
            if list(r.generated) != ref[: len(r.generated)]:
                raise InvariantViolation("OUT-EQUIV", f"request {rid!r} generated {r.generated}, not a prefix of {ref}")
        abstract = self.abstraction(world)
        for inv_id, predicate in STATE_PREDICATES.items():
            message = predicate(self.model, abstract)
            if message:
                raise InvariantViolation(inv_id, f"abstraction of the scheduler state: {message}")
        if self.reachable is not None and not any(v in self.reachable for v in self._variants(abstract)):
            raise InvariantViolation(
                "REFINES",
                "the scheduler reached a state whose abstraction the spec's model does "
                f"not reach: {self.describe_abstract(abstract)}",
            )

    def abstraction(self, world: World) -> AbstractState:
        """The abstract spec state of a world (the mapping the refinement is checked through)."""
        s = world.scheduler
        pool = s.pool
        gpu_free, host_free = pool.gpu_free_blocks, pool.host_free_blocks
        reqs = []
        for i in range(len(self.bound.requests)):
            group = self.bound.group_of(i)
            r = s.requests.get(i) or s.finished.get(i)
            if r is None:
                reqs.append(AbstractRequest(group, ABSENT, 0, 0, 0, 0, NONE, self.bound.requests[i][0], 0))
            elif r.state in self.model.terminal:
                reqs.append(AbstractRequest(group, r.state, 0, 0, r.num_gpu_blocks, r.num_host_blocks, NONE, 0, 0))
            else:
                gpu, host = r.num_gpu_blocks, r.num_host_blocks
                step = s.in_flight.get(i, 0) if r.num_gpu_blocks or r.num_host_blocks else 0  # its step's blocks
                if host:  # suspended since: its host copy holds the step's blocks (its GPU blocks are free)
                    host, host_free = host - step, host_free + step
                else:
                    gpu, gpu_free = gpu - step, gpu_free + step
                reqs.append(
                    AbstractRequest(
                        group,
                        r.state,
                        r.num_computed_tokens,
                        len(r.generated),
                        gpu,
                        host,
                        r.termination_reason or NONE,
                        len(r.prefill_tokens),
                        0,
                    )
                )
        return AbstractState(tuple(sorted(reqs)), gpu_free, host_free, len(pool.gpu.fenced), len(pool.host.fenced))

    def _variants(self, state: AbstractState) -> list[AbstractState]:
        """The abstract states a world may stand for: a request awaiting consensus after a decode step may or may
        not still have that step in the pipeline (`in_flight`); the synchronous sim never has, the model allows both."""
        pending = self.model.pending_reset
        options = [
            [r] if r.state != pending or r.computed < r.prefill else [r, r._replace(in_flight=1)]
            for r in state.requests
        ]
        out: list[tuple[AbstractRequest, ...]] = [()]
        for choice in options:
            out = [(*prefix, r) for prefix in out for r in choice]
        return [state._replace(requests=tuple(sorted(v))) for v in out]

    def describe_abstract(self, state: AbstractState) -> str:
        requests = "; ".join(self.model.describe_request(r) for r in state.requests)
        return f"{requests}; {self.model.describe_pool(state)}"

    def fingerprint(self, world: World) -> tuple:
        s, sim = world.scheduler, world.sim
        pool = s.pool
        active = []
        for rid in sorted(s.requests, key=bound_index):
            r = s.requests[rid]
            gpu, host = pool.gpu_blocks(rid), pool.host_blocks(rid)
            active.append(
                (
                    rid,
                    r.state,
                    r.num_computed_tokens,
                    tuple(r.generated),
                    r.prefill_tokens,
                    gpu,
                    host,
                    r.termination_reason,
                    tuple(tuple(sim.gpu[b]) for b in gpu),
                    tuple(tuple(sim.host[b]) for b in host),
                )
            )
        finished = tuple(sorted((rid, r.done_reason, tuple(r.generated)) for rid, r in s.finished.items()))
        plans = tuple(sorted((p.request_id, p.direction, p.pairs) for p in pool.in_flight.values()))
        pipeline = tuple(
            (
                tuple(sorted(step.output.chunk_tokens.items())),
                tuple(sorted(sampled.items())),
                tuple((name, tuple(r.request_id for r in listed)) for name, listed in step.output.lists()),
            )
            for step, sampled in sim.pipeline
        )  # what lands, and which pauses still wait for it
        return (
            tuple(active),
            finished,
            tuple(r.request_id for r in s.admitted),
            tuple(sorted(pool.gpu._free)),
            tuple(sorted(pool.host._free)),
            tuple(sorted(pool.gpu.fenced)),
            tuple(sorted(pool.host.fenced)),
            plans,
            world.submitted,
            world.cancels_left,
            world.losses_left,
            s.host_tier_fallback,
            pipeline,
            tuple(sorted(s.in_flight.items())),
        )

    def check_refusal(self) -> None:
        """LIVE-REFUSE: a request that can never fit alone is refused at submission."""
        scheduler = Scheduler(self.config, self.spec)
        too_long = self.bound.gpu_blocks * self.bound.block_size
        try:
            scheduler.submit([1] * too_long, 1)
        except RequestRejected:
            return
        raise InvariantViolation(
            "LIVE-REFUSE", f"a request of {too_long} + 1 tokens was accepted by a GPU tier of {too_long} tokens"
        )

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
        result = RefinementResult(self.bound, HOLDS, abstract_checked=self.reachable is not None)
        graph = _WorldGraph()

        def done(verdict: str) -> RefinementResult:
            result.verdict, result.states, result.seconds = verdict, graph.size, time.perf_counter() - start
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
        while i < graph.size:
            if progress is not None and i & 31 == 0:
                progress(graph.size, result.edges)
            if (reason := budget.stop_reason(graph.size)) is not None:
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
                    result.path = [*graph.path_to(i), (action, self._log(nxt))]
                    return done(VIOLATED)
                key = self.fingerprint(nxt)
                j = index.get(key)
                if j is None:
                    j = index[key] = graph.add(i, action, self._log(nxt), not nxt.scheduler.has_unfinished)
                    worlds[j] = nxt
                if action == ("step",):
                    graph.step_next[i] = j
            i += 1
        if progress is not None:
            progress(graph.size, result.edges)
        cycle = graph.livelock()
        if cycle is not None:
            result.violation_id = "LIVE-DONE"
            result.message = (
                f"livelock: once arrivals stop, {len(cycle)} scheduler step(s) repeat forever "
                "with an unfinished request"
            )
            prefix = graph.path_to(cycle[0])
            result.path = [
                *prefix,
                *((("step",), graph.fired[c]) for c in cycle[1:]),
                (("step",), ["(back to the loop start)"]),
            ]
            result.loop_start = len(prefix)
            return done(VIOLATED)
        return done(HOLDS)

    @staticmethod
    def _log(world: World) -> list[str]:
        return [f"{rid}: {source} -{event}-> {dest}" for rid, source, event, dest in world.scheduler.transition_log]


class _WorldGraph:
    """The worlds the refinement search found, by index (0: the initial world), as a BFS tree plus step edges.

    Invariants: world `j` was first reached from world `parent[j]` by `via[j]`, firing `fired[j]` (the initial
    world: parent -1), so parent pointers give shortest paths; `final[j]`: world `j` has no unfinished request;
    `step_next[j]`: the world the ("step",) action leads to from `j` (-1 until `j` is expanded).
    """

    def __init__(self) -> None:
        self.parent: list[int] = [-1]
        self.via: list[tuple] = [()]
        self.fired: list[list[str]] = [[]]
        self.final: list[bool] = [True]
        self.step_next: list[int] = [-1]

    @property
    def size(self) -> int:
        return len(self.parent)

    def add(self, parent: int, action: tuple, fired: list[str], final: bool) -> int:
        """Record a new world reached from `parent` by `action`; its index."""
        self.parent.append(parent)
        self.via.append(action)
        self.fired.append(fired)
        self.final.append(final)
        self.step_next.append(-1)
        return len(self.parent) - 1

    def path_to(self, j: int) -> list[tuple[tuple, list[str]]]:
        """(action, transitions it fired) along the shortest path from the initial world to world `j`."""
        return [(self.via[i], self.fired[i]) for i in path_indices(self.parent, j)]

    def livelock(self) -> list[int] | None:
        """LIVE-DONE: a cycle of step edges through a world with an unfinished request (its worlds, in step
        order), or None when every cycle of step edges is final."""
        color = [0] * self.size  # 0 new, 1 on the current walk, 2 done
        for root in range(self.size):
            walk = []
            v = root
            while v != -1 and color[v] == 0:
                color[v] = 1
                walk.append(v)
                v = self.step_next[v]
            if v != -1 and color[v] == 1:
                cycle = walk[walk.index(v) :]
                if not all(self.final[c] for c in cycle):
                    return cycle
            for w in walk:
                color[w] = 2
        return None


def replay_refinement(
    bound: Bound | dict, actions: list[tuple], *, invariant: str | None = None, spec_path: str | None = None
) -> None:
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
