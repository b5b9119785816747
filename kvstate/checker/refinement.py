"""Refinement of the real `Scheduler` against the spec, by exhaustive exploration of scheduler + executor states.

The world is a real `Scheduler` (an observing subclass that only records and checks) driven by a real
`SimExecutor`. Nondeterminism of the executor and the environment at every point between iterations (`actions`):
the next request arrives (in the bound's order); one iteration runs (`SimExecutor.step`: land what must land,
consensus, schedule, issue copies, compute, complete the copies that are due), possibly with the k-th copy it issues
failing at once; a copy in flight completes early or fails (copies complete up to `copy_delay` passes late:
`SimExecutor`); the oldest micro-batch in flight lands early (`micro_batches` > 1); a request is cancelled or
aborted; a suspended request loses its host copy — each environment choice at most its budget's times per run, so
arrivals and faults stop (F4). Each branch deep-copies the world; worlds are identified by a canonical fingerprint
(request states, token lists, block tables, free lists, KV contents of held blocks, copies in flight and how long they
may still take, outputs in flight, admission order, what the no-progress detector reads, environment budgets;
iteration numbers, plan ids and statistics counters are left out).

Checked on every action: every transition the scheduler fires (collected with its `on_transition` listener)
is a spec edge, and every decision the scheduler takes (an edge, or a refusal when no guard holds) is the one
the checker's own table with the real guards resolves on the same view just before (SPEC-EDGE); the step invariants
on every transition it takes (RESET-*, PROMOTE-GATE, PP-TERMINATE with the first deferred reason kept, FENCE on the
pool); `Scheduler.check_invariants` (pool, RES-STATE, OUT-DISJOINT, OUT-STATE; run by the sim); VICTIM-ONCE;
generated tokens only grow (GEN-APPEND); outputs equal `reference_output` (OUT-EQUIV: a finished request's whole
output, a cancelled or unfinished one a prefix of it); the abstraction of the world satisfies every state predicate
of the abstract model; the abstraction after the action is reached from the one before by a sequence of abstract
actions (`StepMatcher`: step refinement) and, when the abstract model's reachable set is given, is one of its
states (REFINES: the scheduler never reaches a state the spec does not allow). A crash of the scheduler is the
SPEC-EDGE violation of a transition not taken whole.

With `micro_batches` > 1 a step lands the oldest output when it must (`Scheduler.must_land`) before it schedules, so
cancellations and lost host copies also hit requests whose step is in flight, and a request preempted while its
decode step is in flight receives its token suspended or awaiting consensus (the deferred finish). The abstraction
shows a request whose step is in flight as it was before that step (`AbstractModel` computes a step atomically): the
blocks allocated for the step count as free, also in the copy of a request suspended with it.

Liveness (LIVE-DONE): once arrivals and faults stop (every budgeted action spends a budget the fingerprint counts,
so none lies on a cycle), only steps, early completions and early landings move the world, and every infinite run of
them is one an executor may follow under F1-F4 (copies are due within `copy_delay` passes, outputs land when they
must, consensus follows the landing of the output that announced the pause). So a cycle through a world with an
unfinished request is a livelock, and a stall of the no-progress detector (A4) reports one it would otherwise
loop in: there must be neither.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from kvstate import policy
from kvstate.checker.bounds import Bound
from kvstate.checker.explore import HOLDS, INCOMPLETE, VIOLATED, tarjan
from kvstate.checker.invariants import STATE_PREDICATES, STEP_PREDICATES
from kvstate.checker.model import ABSENT, NONE, AbstractModel, AbstractRequest, AbstractState, Action, Edge, PoolCounts
from kvstate.checker.search import SearchBudget, path_indices
from kvstate.checker.stepmatch import StepMatcher
from kvstate.config import RequestRejected, SchedulerConfig
from kvstate.errors import InvariantViolation, KVStateError
from kvstate.lifecycle import TransitionTable
from kvstate.pool import TO_HOST
from kvstate.request import Request
from kvstate.scheduler import Scheduler, SchedulerStalled
from kvstate.semantics import GUARDS
from kvstate.sim import SimExecutor, reference_output
from kvstate.spec import Spec, Transition, default_spec, load_spec


def bound_index(request_id: Hashable) -> int:
    """The index in its bound of a request the refinement submitted (it submits request `i` with id `i`)."""
    if not isinstance(request_id, int):
        raise TypeError(f"request id {request_id!r}: the refinement submits the bound's requests with ids 0, 1, ...")
    return request_id


def prompt_of(index: int, length: int) -> list[int]:
    """The concrete prompt of request `index` of a bound (distinct per request)."""
    return [(index * 31 + k * 7) % 97 + 1 for k in range(length)]


TransitionCheck = Callable[["ObservedScheduler", Request, "RealFields", Transition, tuple[dict, dict]], None]


class ObservedScheduler(Scheduler):
    """The real scheduler plus observation: a transition log, a guard cross-check, VICTIM-ONCE and, once the
    refinement sets `transition_check`, the step invariants of every transition it takes."""

    def __init__(self, config: SchedulerConfig, spec: Spec, checker_table: TransitionTable) -> None:
        super().__init__(config, spec, on_transition=self._record)
        self.checker_table = checker_table
        self.transition_log: list[tuple[object, str, str, str]] = []
        self.victims_this_pass: set = set()
        self.transition_check: TransitionCheck | None = None

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
        fields = RealFields.of(request)
        fenced = dict(self.pool.gpu.fenced), dict(self.pool.host.fenced)
        transition = super()._try_fire(request, event, pass_)
        taken = None if transition is None else (transition.source, transition.dest)
        if taken != (None if expected is None else (expected.source, expected.dest)):
            want = "no edge (its guard does not hold)" if expected is None else f"{expected.source} -> {expected.dest}"
            got = "no edge" if transition is None else f"{before} -> {transition.dest}"
            raise InvariantViolation(
                "SPEC-EDGE",
                f"request {request.request_id!r} took {event}: {got}; the spec with the real guards gives {want}",
            )
        if transition is not None and self.transition_check is not None:
            self.transition_check(self, request, fields, transition, fenced)
        return transition


@dataclass(frozen=True, slots=True)
class RealFields:
    """What the step invariants read of a real request, taken just before a transition."""

    state: str
    computed: int
    generated: int
    gpu: int
    host: int
    termination_reason: str | None
    prefill: int

    @classmethod
    def of(cls, r: Request) -> RealFields:
        return cls(
            r.state,
            r.num_computed_tokens,
            len(r.generated),
            r.num_gpu_blocks,
            r.num_host_blocks,
            r.termination_reason,
            len(r.prefill_tokens),
        )


@dataclass
class World:
    scheduler: ObservedScheduler
    sim: SimExecutor
    submitted: int = 0
    cancels_left: int = 0
    losses_left: int = 0
    aborts_left: int = 0
    failures_left: int = 0


class NotEnabled(Exception):
    """The action cannot be taken in this world (a copy failure asked of a pass that issues fewer copies)."""


# Actions that spend an environment budget (a world's fingerprint counts what is left), so none lies on a cycle.
BUDGETED = frozenset({"submit", "cancel", "abort", "lose_host_copy", "fail"})


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
        self.spec = spec if spec is not None else default_spec()
        self.table = TransitionTable(self.spec, GUARDS)
        self.edges = {(t.source, t.event, t.dest) for t in self.spec.transitions}
        self.model = AbstractModel(bound, self.spec)
        self.matcher = StepMatcher(self.model)
        self.step_checks = [(i, p) for i, p in STEP_PREDICATES.items() if i not in ("FENCE", "GEN-APPEND")]
        self.reachable = reachable
        self.scheduler_class = scheduler_class
        budgets = {
            option: getattr(bound, name)
            for name, option in (
                ("max_batch_size", "max_batch_size"),
                ("max_num_tokens", "max_num_tokens"),
                ("max_preemptions", "max_preemptions_per_request"),
                ("no_progress_limit", "no_progress_limit"),
            )
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
        self.stops = [
            (reference_output(self.prompts[i], m)[at],) if at >= 0 else ()
            for i, ((_, m), at) in enumerate(
                zip(bound.requests, bound.stop_at or [-1] * len(bound.requests), strict=True)
            )
        ]
        self.references = [
            reference_output(self.prompts[i], m, self.stops[i]) for i, (_, m) in enumerate(bound.requests)
        ]

    # ---- worlds
    def initial(self) -> World:
        scheduler = self.scheduler_class(self.config, self.spec, self.table)
        scheduler.transition_check = self._check_transition
        sim = SimExecutor(scheduler, micro_batches=self.bound.micro_batches, copy_delay=self.bound.copy_delay)
        b = self.bound
        return World(scheduler, sim, 0, b.env_cancels, b.env_host_losses, b.env_aborts, b.env_copy_failures)

    def clone(self, world: World) -> World:
        s = world.scheduler
        memo = {id(x): x for x in (s.lifecycle, s.spec, s.config, self.table, self.spec, self)}  # shared, not copied
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return copy.deepcopy(world, memo)

    def actions(self, world: World) -> list[tuple]:
        """Every choice of the environment in `world`: an arrival (in the bound's order), a scheduler step (with
        the k-th copy it issues failing, while copy failures are left), an in-flight copy completing early or
        failing, the oldest micro-batch in flight landing early, a cancel, an abort, a lost host copy."""
        s, sim = world.scheduler, world.sim
        out: list[tuple] = []
        if world.submitted < len(self.bound.requests):
            out.append(("submit", world.submitted))
        out.append(("step",))
        if world.failures_left:
            out += [("step", "fail", k) for k in range(len(self.bound.requests))]
        copying = sorted((c.plan.request_id for c in sim.copies), key=bound_index)
        out += [("complete", rid) for rid in copying]
        if world.failures_left:
            out += [("fail", rid) for rid in copying]
        if sim.micro_batches > 1 and sim.pipeline:
            out.append(("land",))
        active = sorted(s.requests, key=bound_index) if self.bound.cancel else []  # cancel = false: none ends
        if world.cancels_left:
            out += [("cancel", rid) for rid in active]
        if world.aborts_left:
            out += [("abort", rid) for rid in active]
        if world.losses_left:
            out += [("lose_host_copy", r.request_id) for r in s.suspended]
        return out

    def apply(self, world: World, action: tuple) -> None:
        """Carry out `action` on `world` (in place); raises InvariantViolation on any failed check, `NotEnabled`
        when the action cannot be taken there."""
        s = world.scheduler
        before = {rid: list(r.generated) for rid, r in s.requests.items()}
        abstract_before = self._in_bound_order(world)
        s.transition_log.clear()
        self._act(world, action)
        self._check_world(world, before)
        self._check_step(world, action, abstract_before)
        world.scheduler.last_pass = world.sim.last_step = None  # observed; no part of the world (nor copied with it)

    def _check_transition(
        self,
        scheduler: ObservedScheduler,
        request: Request,
        before: RealFields,
        transition: Transition,
        fenced: tuple[dict, dict],
    ) -> None:
        """The step invariants on one real transition, just taken: the abstract step predicates (RESET-*,
        RESET-TERMINATED, PROMOTE-GATE, PP-TERMINATE) on its before and after, RESET-PROMPT on the tokens
        themselves, FENCE on the pool (no fenced block left its fence during the transition) and PP-TERMINATE's
        first-reason rule (a deferred reason, once recorded, is the one the request ends with)."""
        group = self.bound.group_of(bound_index(request.request_id))

        def record(f: RealFields) -> AbstractRequest:
            reason = f.termination_reason or NONE
            return AbstractRequest(group, f.state, f.computed, f.generated, f.gpu, f.host, reason, f.prefill, 0)

        pool = PoolCounts(0, 0, 0, 0)  # the acting request's own edge: the predicates read its records only
        edge = Edge(
            Action("event", 0, transition.event),
            AbstractState((record(before),), *pool),
            (record(RealFields.of(request)),),
            pool,
            (transition,),
        )
        for inv_id, predicate in self.step_checks:
            if (message := predicate(self.model, edge)) is not None:
                raise InvariantViolation(inv_id, f"request {request.request_id!r}, {transition}: {message}")
        if transition.effect == "release_kv_and_reset" and request.prefill_tokens != request.all_tokens:
            raise InvariantViolation(
                "RESET-PROMPT",
                f"request {request.request_id!r}: replay prompt {request.prefill_tokens} is not its prompt and "
                f"generated tokens {request.all_tokens}",
            )
        first = before.termination_reason
        if first is not None and (request.termination_reason or request.done_reason) != first:
            raise InvariantViolation(
                "PP-TERMINATE",
                f"request {request.request_id!r} deferred {first!r} first, then {transition.event} made it "
                f"{request.termination_reason or request.done_reason!r}: the first recorded reason wins",
            )
        for tier, was in zip((scheduler.pool.gpu, scheduler.pool.host), fenced, strict=True):
            moved = [b for b, plan in was.items() if tier.fenced.get(b) != plan]
            if moved:
                raise InvariantViolation(
                    "FENCE",
                    f"{transition} on request {request.request_id!r} took {tier.name} blocks {sorted(moved)} out "
                    "of their copy's fence; only the copy's completion ends it",
                )

    def _act(self, world: World, action: tuple) -> None:
        """Carry out `action`; a scheduler error is the violation it stands for."""
        s, sim, kind = world.scheduler, world.sim, action[0]
        calls = {  # kind -> (what it does, the budget it spends)
            "complete": (sim.complete_copy, None),
            "fail": (sim.fail_copy, "failures_left"),
            "cancel": (s.cancel, "cancels_left"),
            "abort": (s.abort, "aborts_left"),
            "lose_host_copy": (s.lose_host_copy, "losses_left"),
        }
        if kind not in calls and kind not in ("submit", "step", "land"):
            raise ValueError(f"unknown action {action!r}")
        try:
            if kind == "submit":
                i = action[1]
                s.submit(self.prompts[i], self.bound.requests[i][1], stop_token_ids=self.stops[i], request_id=i)
                world.submitted += 1
            elif kind == "step":
                self._step(world, action)
            elif kind == "land":
                sim.land()
            elif kind in calls:
                call, budget = calls[kind]
                call(action[1])
                if budget is not None:
                    setattr(world, budget, getattr(world, budget) - 1)
        except (InvariantViolation, NotEnabled):
            raise
        except SchedulerStalled as err:
            raise InvariantViolation("LIVE-DONE", str(err)) from err
        except KVStateError as err:
            raise InvariantViolation("SPEC-EDGE", f"{type(err).__name__}: {err}") from err
        except Exception as err:  # a crash inside the scheduler: the transition under way was not taken whole
            raise InvariantViolation(
                "SPEC-EDGE", f"the scheduler crashed with {type(err).__name__}: {err} (a transition not taken whole)"
            ) from err

    @staticmethod
    def _step(world: World, action: tuple) -> None:
        """("step",), or ("step", "fail", k): a step whose k-th copy fails when issued (not enabled when the pass
        issues fewer copies)."""
        if len(action) == 1:
            world.sim.step()
            return
        _, _, k = action
        world.sim.step(fail={k})
        step = world.sim.last_step
        if step is None or not step.failures:
            raise NotEnabled(f"the pass issued no copy number {k}")
        world.failures_left -= 1

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
        canonical = (v._replace(requests=tuple(sorted(v.requests))) for v in self._variants(abstract))
        if self.reachable is not None and not any(v in self.reachable for v in canonical):
            raise InvariantViolation(
                "REFINES",
                "the scheduler reached a state whose abstraction the spec's model does "
                f"not reach: {self.describe_abstract(abstract)}",
            )

    def _check_step(self, world: World, action: tuple, before: AbstractState) -> None:
        """REFINES, step by step: the abstraction of `world` after `action` is reached from `before` (the one
        before it) by a sequence of abstract actions on the requests the action touched (a stutter if none)."""
        after = self._in_bound_order(world)
        fired: dict[int, list[str]] = {}
        for rid, _, event, _ in world.scheduler.transition_log:
            fired.setdefault(bound_index(rid), []).append(event)
        touched = {k for k, (a, b) in enumerate(zip(before.requests, after.requests, strict=True)) if a != b}
        touched |= fired.keys()
        if not touched and before == after:
            return
        events = sum(len(v) for v in fired.values())
        depth = events + len(touched) * (self.bound.micro_batches + 3)
        allowed = self.matcher.allowed(sorted(touched), fired)
        if not self.matcher.match(self._variants(before), self._variants(after), allowed, depth):
            raise InvariantViolation(
                "REFINES",
                f"{' '.join(map(str, action))} took the abstraction from {self.describe_abstract(before)} to "
                f"{self.describe_abstract(after)}, which no sequence of abstract actions on the requests it touched "
                f"({', '.join(f'r{k}' for k in sorted(touched))}) does",
            )

    def abstraction(self, world: World) -> AbstractState:
        """The abstract spec state of a world (the mapping the refinement is checked through), canonical."""
        state = self._in_bound_order(world)
        return state._replace(requests=tuple(sorted(state.requests)))

    def _in_bound_order(self, world: World) -> AbstractState:
        """The abstraction of a world with its requests in bound order (slot k: request k), not canonical."""
        s = world.scheduler
        pool = s.pool
        gpu_free, host_free = pool.gpu_free_blocks, pool.host_free_blocks
        copies = self._copies(pool)
        gpu_fenced = len(pool.gpu.fenced)
        preempted = (self.model.pending_reset, self.model.offloaded)
        reqs = []
        for i in range(len(self.bound.requests)):
            group = self.bound.group_of(i)
            r = s.requests.get(i) or s.finished.get(i)
            fenced_gpu, fenced_host, incoming = copies.get(i, (0, 0, 0))
            if r is None:
                reqs.append(AbstractRequest(group, ABSENT, 0, 0, 0, 0, NONE, self.bound.requests[i][0], 0))
            elif r.state in self.model.terminal:
                reqs.append(
                    AbstractRequest(
                        group, r.state, 0, 0, r.num_gpu_blocks, r.num_host_blocks, NONE, 0, 0, fenced_gpu, fenced_host
                    )
                )
            else:
                gpu, host = r.num_gpu_blocks, r.num_host_blocks
                step = s.in_flight.get(i, 0) if r.num_gpu_blocks or r.num_host_blocks else 0  # its step's blocks
                if host:  # suspended since: its host copy holds the step's blocks (its GPU blocks are free)
                    host, host_free = host - step, host_free + step
                    if incoming:  # and that copy, still in flight, fences their GPU sources
                        fenced_gpu, incoming, gpu_fenced, gpu_free = (
                            fenced_gpu - step,
                            incoming - step,
                            gpu_fenced - step,
                            gpu_free + step,
                        )
                else:
                    gpu, gpu_free = gpu - step, gpu_free + step
                landing = int(i in s.in_flight and r.state in preempted)  # its decode step may still land
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
                        landing,
                        fenced_gpu,
                        fenced_host,
                        incoming,
                    )
                )
        return AbstractState(tuple(reqs), gpu_free, host_free, gpu_fenced, len(pool.host.fenced))

    @staticmethod
    def _copies(pool) -> dict[Hashable, tuple[int, int, int]]:
        """Per request with a copy in flight: the GPU and host blocks its copy fences, and the destinations it still
        holds (the abstract model's `fenced_gpu`, `fenced_host`, `incoming`)."""
        out: dict[Hashable, tuple[int, int, int]] = {}
        for plan in pool.in_flight.values():
            owner = plan.request_id
            dest = pool.host if plan.direction == TO_HOST else pool.gpu
            held = set(dest.held(owner))
            fenced_gpu, fenced_host, incoming = out.get(owner, (0, 0, 0))
            out[owner] = (
                fenced_gpu + len(pool.gpu.fenced_by(plan.plan_id)),
                fenced_host + len(pool.host.fenced_by(plan.plan_id)),
                incoming + sum(1 for _, dst in plan.pairs if dst in held),
            )
        return out

    def _variants(self, state: AbstractState) -> list[AbstractState]:
        """The abstract states a world may stand for: a request awaiting consensus or suspended after a decode step
        whose step is not in the pipeline may stand for the model's request that may still receive it
        (`in_flight`: the model sets it on every such preemption with several stages, and lets it land or not)."""
        preempted = (self.model.pending_reset, self.model.offloaded)
        several = self.bound.pipeline_stages > 1
        options = [
            [r, r._replace(in_flight=1)]
            if several and r.state in preempted and not r.in_flight and r.computed >= r.prefill
            else [r]
            for r in state.requests
        ]
        out: list[tuple[AbstractRequest, ...]] = [()]
        for choice in options:
            out = [(*prefix, r) for prefix in out for r in choice]
        return [state._replace(requests=v) for v in out]  # in the order of `state`'s requests

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
                    r.replay_high_water,  # what the no-progress detector (A4) reads, with idle_iterations below
                    tuple(tuple(sim.gpu[b]) for b in gpu),
                    tuple(tuple(sim.host[b]) for b in host),
                )
            )
        finished = tuple(sorted((rid, r.done_reason, tuple(r.generated)) for rid, r in s.finished.items()))
        plans = tuple(sorted((p.request_id, p.direction, p.pairs) for p in pool.in_flight.values()))
        due = tuple((c.plan.request_id, c.due - s.iteration) for c in sim.copies)  # passes each copy may still take
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
            pool.gpu.free_blocks(),
            pool.host.free_blocks(),
            tuple(sorted(pool.gpu.fenced)),
            tuple(sorted(pool.host.fenced)),
            plans,
            world.submitted,
            world.cancels_left,
            world.losses_left,
            world.aborts_left,
            world.failures_left,
            s.host_tier_fallback,
            pipeline,
            tuple(sorted(s.in_flight.items())),
            due,
            s.idle_iterations,  # what the no-progress detector (A4) reads
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
                nxt = self.clone(world)
                try:
                    self.apply(nxt, action)
                except NotEnabled:
                    continue
                except InvariantViolation as err:
                    result.edges += 1
                    result.violation_id, result.message = err.invariant_id, str(err)
                    result.path = [*graph.path_to(i), (action, self._log(nxt))]
                    if err.invariant_id == "LIVE-DONE":
                        result.loop_start = self._loop_start(result.path)
                    return done(VIOLATED)
                result.edges += 1
                key, fired = self.fingerprint(nxt), self._log(nxt)
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
        result: RefinementResult, graph: _WorldGraph, cycle: list[tuple[tuple, list[str], int]]
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

    def _loop_start(self, path: list[tuple[tuple, list[str]]]) -> int | None:
        """Where the path to a stall (the no-progress detector fired: LIVE-DONE) first comes back to a world it
        passed, counting worlds equal but for the detector's counter: the steps from there repeat until the detector
        stops them. None when the path has no such repeat."""
        world = self.initial()
        seen = {self._shape(world): 0}
        for n, (action, _) in enumerate(path[:-1], 1):
            try:
                self.apply(world, action)
            except (InvariantViolation, NotEnabled):
                return None
            shape = self._shape(world)
            if shape in seen:
                return seen[shape]
            seen[shape] = n
        return None

    def _shape(self, world: World) -> tuple:
        """A world's fingerprint without the no-progress counter."""
        return self.fingerprint(world)[:-1]

    @staticmethod
    def _log(world: World) -> list[str]:
        return [f"{rid}: {source} -{event}-> {dest}" for rid, source, event, dest in world.scheduler.transition_log]


class _WorldGraph:
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
