"""The real scheduler under observation: what the scheduler refinement adds to a `Scheduler` to check it.

`ObservedScheduler` takes every decision the real scheduler takes, unchanged; it only records and checks. It logs
every transition it fires, cross-checks every decision against the checker's own table with the real guards
(SPEC-EDGE), checks every pass against the spec's policy (`kvstate.policy`), refuses a victim chosen twice in one
pass (VICTIM-ONCE) and hands every transition it takes, with the request's fields just before it (`RealFields`),
to the refinement's step invariants (`transition_check`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstate import policy
from kvstate.config import SchedulerConfig
from kvstate.errors import InvariantViolation, KVStateError
from kvstate.lifecycle import TransitionTable
from kvstate.pool import TieredBlockPool
from kvstate.request import Request
from kvstate.scheduler import Scheduler
from kvstate.spec import Spec, Transition

TransitionCheck = Callable[["ObservedScheduler", Request, "RealFields", Transition, tuple[dict, dict]], None]


class ObservedScheduler(Scheduler):
    """The real scheduler plus observation; every decision it takes is the real scheduler's own.

    Invariants kept: `transition_log` lists every transition fired since the refinement last cleared it, in order;
    `victims_this_pass` holds the victims of the pass under way; a decision the spec's table with the real guards
    does not give, a victim chosen twice in one pass, or a pass the spec's policy does not allow raises
    `InvariantViolation`; once the refinement sets `transition_check`, it sees every transition taken.
    """

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
        fields = RealFields.of(request, self.pool, pass_.number)
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
    """What the step invariants read of a real request, taken just before a transition: its fields, its block tables
    and copies in flight (RESUME-COPY), its suspension's pass, the pass under way (None between passes) and whether
    a step of it is in the pipeline (PROMOTE-GATE)."""

    state: str
    computed: int
    generated: int
    gpu: int
    host: int
    termination_reason: str | None
    prefill: int
    suspended_in_pass: int | None = None
    pass_number: int | None = None
    gpu_table: tuple[int, ...] = ()
    host_table: tuple[int, ...] = ()
    plans: frozenset[int] = frozenset()
    step_in_flight: bool = False

    @classmethod
    def of(cls, r: Request, pool: TieredBlockPool | None = None, pass_number: int | None = None) -> RealFields:
        """`r`'s fields now; with its `pool`, also its block tables and the ids of its copies in flight."""
        rid = r.request_id
        return cls(
            r.state,
            r.num_computed_tokens,
            len(r.generated),
            r.num_gpu_blocks,
            r.num_host_blocks,
            r.termination_reason,
            len(r.prefill_tokens),
            r.suspended_in_pass,
            pass_number,
            () if pool is None else pool.gpu_blocks(rid),
            () if pool is None else pool.host_blocks(rid),
            frozenset(() if pool is None else (p.plan_id for p in pool.in_flight.values() if p.request_id == rid)),
            r.step_in_flight,
        )
