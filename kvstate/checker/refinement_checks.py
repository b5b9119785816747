"""The checks of the scheduler refinement: on every transition the real scheduler takes, and after every action.

Checked on every action: every transition the scheduler fires (collected with its `on_transition` listener) is a
spec edge, and every decision the scheduler takes (an edge, or a refusal when no guard holds) is the one the
checker's own table with the real guards resolves on the same view just before (SPEC-EDGE, `ObservedScheduler`); the
step invariants on every transition it takes (RESET-*, PROMOTE-GATE with the real pass clauses, RESUME-COPY on the
real copy plans, PP-TERMINATE with the first deferred reason kept, FENCE on the pool); `Scheduler.check_invariants`
(pool, RES-STATE, OUT-DISJOINT, OUT-STATE; run by the sim); VICTIM-ONCE; generated tokens only grow (GEN-APPEND);
outputs equal `reference_output` (OUT-EQUIV: a finished request's whole output, a cancelled or unfinished one a
prefix of it); the abstraction of the world satisfies every state predicate of the abstract model; the abstraction
after the action is reached from the one before by a sequence of abstract actions (`StepMatcher`: step refinement)
and, when the abstract model's reachable set is given, is one of its states (REFINES: the scheduler never reaches a
state the spec does not allow). A crash of the scheduler is the SPEC-EDGE violation of a transition not taken whole,
except an allocation beyond a tier's free blocks, which is OWN-EXCL naming the edge that let it happen
(`Environment.act`).
"""

from __future__ import annotations

from collections.abc import Hashable

from kvstate.checker.abstraction import Abstraction
from kvstate.checker.bounds import Bound
from kvstate.checker.invariants import STATE_PREDICATES, STEP_PREDICATES, promotion_gate_clauses
from kvstate.checker.model import AbstractModel
from kvstate.checker.observed import ObservedScheduler, RealFields
from kvstate.checker.records import NONE, AbstractRequest, AbstractState, Action, Edge, PoolCounts
from kvstate.checker.stepmatch import StepMatcher
from kvstate.checker.world import BoundRequests, World, bound_index
from kvstate.config import RequestRejected, SchedulerConfig
from kvstate.errors import InvariantViolation
from kvstate.pool import TO_GPU
from kvstate.request import Request
from kvstate.scheduler import Scheduler
from kvstate.spec import Transition


class RefinementChecks:
    """Every check of the scheduler refinement on the worlds of one bound; each raises `InvariantViolation`, named
    by the invariant it found violated, and changes no world.

    `reachable`, when given, is the abstract model's reachable set (canonical states): then every world's
    abstraction must be in it.
    """

    def __init__(
        self,
        bound: Bound,
        model: AbstractModel,
        config: SchedulerConfig,
        requests: BoundRequests,
        reachable: set | None,
    ) -> None:
        self.bound = bound
        self.model = model
        self.config = config
        self.requests = requests
        self.reachable = reachable
        self.abstraction = Abstraction(bound, model)
        self.matcher = StepMatcher(model)
        self.edges = {(t.source, t.event, t.dest) for t in model.spec.transitions}
        # checked on the real transition's own terms below (FENCE on the pool, RESUME-COPY on the plans) or after
        # the whole action (GEN-APPEND)
        self.step_checks = [
            (i, p) for i, p in STEP_PREDICATES.items() if i not in ("FENCE", "GEN-APPEND", "RESUME-COPY")
        ]

    def refusal(self) -> None:
        """LIVE-REFUSE: a request that can never fit alone is refused at submission."""
        scheduler = Scheduler(self.config, self.model.spec)
        too_long = self.bound.gpu_blocks * self.bound.block_size
        try:
            scheduler.submit([1] * too_long, 1)
        except RequestRejected:
            return
        raise InvariantViolation(
            "LIVE-REFUSE", f"a request of {too_long} + 1 tokens was accepted by a GPU tier of {too_long} tokens"
        )

    def transition(
        self,
        scheduler: ObservedScheduler,
        request: Request,
        before: RealFields,
        transition: Transition,
        fenced: tuple[dict, dict],
    ) -> None:
        """The step invariants on one real transition, just taken: the abstract step predicates (RESET-*,
        RESET-TERMINATED, PP-TERMINATE) on its before and after, RESET-PROMPT on the tokens themselves, FENCE on the
        pool (no fenced block left its fence during the transition), PP-TERMINATE's first-reason rule (a deferred
        reason, once recorded, is the one the request ends with), PROMOTE-GATE's pass clauses on the real passes and
        RESUME-COPY on the copies the transition planned."""
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
        self._promotion(scheduler, request, before, transition)
        self._resume_copy(scheduler, request, before, transition)
        for tier, was in zip((scheduler.pool.gpu, scheduler.pool.host), fenced, strict=True):
            moved = [b for b, plan in was.items() if tier.fenced.get(b) != plan]
            if moved:
                raise InvariantViolation(
                    "FENCE",
                    f"{transition} on request {request.request_id!r} took {tier.name} blocks {sorted(moved)} out "
                    "of their copy's fence; only the copy's completion ends it",
                )

    def _promotion(
        self, scheduler: ObservedScheduler, request: Request, before: RealFields, transition: Transition
    ) -> None:
        """PROMOTE-GATE on a real promotion (a held state left by recompute_pause): in a pass, not while a step of it
        is in the pipeline, and one of the pass's own suspensions only while a host tier exists."""
        if transition.event != "recompute_pause" or self.model.spec.residency(transition.source) != "held":
            return
        wrong = promotion_gate_clauses(
            before.suspended_in_pass,
            before.pass_number,
            scheduler.pool.has_host_tier,
            step_in_flight=before.step_in_flight,
        )
        if wrong is not None:
            raise InvariantViolation("PROMOTE-GATE", f"request {request.request_id!r}, {transition}: {wrong}")

    def _resume_copy(
        self, scheduler: ObservedScheduler, request: Request, before: RealFields, transition: Transition
    ) -> None:
        """RESUME-COPY on a real resume (a held state left for a gpu state): one copy up of exactly its host blocks,
        in table order, into GPU blocks placed before its held GPU blocks, which stay where they are; no copy when
        it had no host block."""
        spec = self.model.spec
        if spec.residency(transition.source) != "held" or spec.residency(transition.dest) != "gpu":
            return
        rid, pool = request.request_id, scheduler.pool
        plans = [p for p in pool.in_flight.values() if p.request_id == rid and p.plan_id not in before.plans]
        table = pool.gpu_blocks(rid)
        sources = tuple(src for p in plans for src, _ in p.pairs)
        destinations = tuple(dst for p in plans for _, dst in p.pairs)
        wrong = (
            (len(plans) > 1 or any(p.direction != TO_GPU for p in plans))
            or sources != before.host_table
            or table != destinations + before.gpu_table
            or pool.host_blocks(rid)
        )
        if wrong:
            raise InvariantViolation(
                "RESUME-COPY",
                f"request {rid!r}, {transition}: with host blocks {list(before.host_table)} and held GPU blocks "
                f"{list(before.gpu_table)} it planned {[(p.direction, list(p.pairs)) for p in plans]} and now holds "
                f"GPU blocks {list(table)}, host blocks {list(pool.host_blocks(rid))}: a resume copies exactly its "
                "host blocks up, in one copy placed before its held GPU blocks, which are locked again with no copy",
            )

    def world(self, world: World, before: dict[Hashable, list[int]]) -> None:
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
            ref = self.requests.references[bound_index(rid)]
            if r.done_reason == "finished" and list(r.generated) != ref:
                raise InvariantViolation(
                    "OUT-EQUIV", f"request {rid!r} finished with {r.generated}, alone it gives {ref}"
                )
            if list(r.generated) != ref[: len(r.generated)]:
                raise InvariantViolation("OUT-EQUIV", f"request {rid!r} generated {r.generated}, not a prefix of {ref}")
        abstract = self.abstraction.of(world)
        for inv_id, predicate in STATE_PREDICATES.items():
            message = predicate(self.model, abstract)
            if message:
                raise InvariantViolation(inv_id, f"abstraction of the scheduler state: {message}")
        canonical = (v._replace(requests=tuple(sorted(v.requests))) for v in self.abstraction.variants(abstract))
        if self.reachable is not None and not any(v in self.reachable for v in canonical):
            raise InvariantViolation(
                "REFINES",
                "the scheduler reached a state whose abstraction the spec's model does "
                f"not reach: {self.abstraction.describe(abstract)}",
            )

    def step(self, world: World, action: tuple, before: AbstractState) -> None:
        """REFINES, step by step: the abstraction of `world` after `action` is reached from `before` (the one
        before it) by a sequence of abstract actions on the requests the action touched (a stutter if none)."""
        after = self.abstraction.in_bound_order(world)
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
        if not self.matcher.match(self.abstraction.variants(before), self.abstraction.variants(after), allowed, depth):
            raise InvariantViolation(
                "REFINES",
                f"{' '.join(map(str, action))} took the abstraction from {self.abstraction.describe(before)} to "
                f"{self.abstraction.describe(after)}, which no sequence of abstract actions on the requests it touched "
                f"({', '.join(f'r{k}' for k in sorted(touched))}) does",
            )
