"""The effects of the spec's edges on the scheduler's state: block accounting, request counters and the pass's
migrations. The lifecycle decides the edge; the scheduler then runs its effect here, so nothing calls back into it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstate.errors import KVStateError
from kvstate.pool import MigrationPlan
from kvstate.request import Request
from kvstate.scheduler.queues import BY_ADMISSION, insert_ordered
from kvstate.scheduler.scheduling_pass import SchedulingPass
from kvstate.semantics import first_chunk_blocks, offload_blocks
from kvstate.spec import Transition

if TYPE_CHECKING:
    from kvstate.scheduler.core import SchedulerCore

__all__ = ["SchedulerEffects"]


class SchedulerEffects:
    """The scheduler's implementation of `kvstate.EffectHooks`, for the effects of one transition fired in `pass_`:
    block accounting, request counters, and the pass's migrations (only a pass with a number takes migrations)."""

    __slots__ = ("pass_", "s")

    def __init__(self, scheduler: SchedulerCore, pass_: SchedulingPass) -> None:
        self.s = scheduler
        self.pass_ = pass_

    def _migrations(self) -> list[MigrationPlan]:
        pass_ = self.pass_
        if pass_.number is None:
            raise KVStateError("migrations happen only inside schedule(); suspend and resume are scheduler decisions")
        return pass_.output.migrations

    def _admit(self, request: Request, event: str) -> None:
        """Put `request` among the computing requests in admission order; a fresh admission number unless the
        policy says this readmission keeps its own (a replay keeps it: spec policy)."""
        if request.admission < 0 or event not in self.s.policy.readmissions_keeping_admission:
            request.admission = next(self.s._admissions)
        insert_ordered(self.s.admitted, request, BY_ADMISSION)

    def allocate_first_chunk(self, request: Request, transition: Transition) -> None:
        blocks = first_chunk_blocks(request, self.pass_.view(self.s.pool, self.s.config))
        self.s.pool.allocate(request.request_id, blocks)
        request.num_gpu_blocks = blocks
        self._admit(request, transition.event)

    def hold_blocks(self, request: Request, transition: Transition) -> None:
        self.s.pool.hold(request.request_id)
        request.num_suspensions += 1
        request.suspended_in_pass = self.pass_.number

    def offload_held_blocks(self, request: Request, transition: Transition) -> None:
        migrations = self._migrations()  # before the pool changes: a refusal changes nothing
        plan = self.s.pool.offload(
            request.request_id, offload_blocks(request, self.pass_.view(self.s.pool, self.s.config))
        )
        migrations.append(plan)
        request.copy_in_flight = True
        request.num_gpu_blocks -= plan.num_blocks
        request.num_host_blocks += plan.num_blocks

    def lock_and_onboard(self, request: Request, transition: Transition) -> None:
        migrations = self._migrations()  # before the pool changes: a refusal changes nothing
        plan = self.s.pool.onboard(request.request_id)
        if plan is not None:
            migrations.append(plan)
            request.copy_in_flight = True
        request.num_gpu_blocks, request.num_host_blocks = request.num_gpu_blocks + request.num_host_blocks, 0
        self._admit(request, transition.event)

    def release_kv_and_reset(self, request: Request, transition: Transition) -> None:
        self.s.pool.release(request.request_id)
        request.reset_for_replay()

    def hold_for_consensus(self, request: Request, transition: Transition) -> None:
        """Blocks stay; the request leaves `admitted` (not a victim) and the resident loop skips it."""

    def release_kv_and_terminate(self, request: Request, transition: Transition) -> None:
        self.s.pool.release(request.request_id)
        request.num_gpu_blocks = request.num_host_blocks = 0
        request.done_reason = transition.done_reason or request.termination_reason

    def defer_termination(self, request: Request, transition: Transition) -> None:
        request.termination_reason = request.termination_reason or transition.done_reason
