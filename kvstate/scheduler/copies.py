"""Copy reports: what the executor tells the scheduler about the copies of its migrations.

Invariants kept: a plan's fenced blocks free only when its copy is reported complete, failed or withdrawn (FENCE);
a failed copy whose request still reads its destinations is undone through the spec's events, atomically; one
nobody reads any more ends its fences as a completion would; the host tier changes only while none of its blocks
are in flight.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvstate.errors import PoolError
from kvstate.output import FailedMigration, SchedulerOutput
from kvstate.pool import TO_HOST, MigrationPlan
from kvstate.request import Request
from kvstate.scheduler.core import SchedulerCore

__all__ = ["CopyReports"]


class CopyReports(SchedulerCore):
    """The scheduler's side of the executor's copies (this module's docstring)."""

    def complete_migrations(self, output: SchedulerOutput) -> None:
        """The executor reports every copy of `output.migrations` complete: end their fences (those it reported
        one by one, `complete_migration`, are skipped)."""
        for plan in output.migrations:
            if plan.plan_id in self.pool.in_flight:
                self._end_copy(plan)

    def complete_migration(self, plan: MigrationPlan) -> None:
        """The executor reports the copies of `plan` complete, at their own time (possibly passes after the pass
        that planned them): its fenced blocks free up and its request may move, or be scheduled, again. Raises
        `PoolError` (nothing changed) when `plan` is not in flight."""
        if plan.plan_id not in self.pool.in_flight:
            raise PoolError(f"migration plan {plan.plan_id} is not in flight; report each copy complete once")
        self._end_copy(plan)

    def needs_undo(self, output: SchedulerOutput, plan: MigrationPlan) -> bool:
        """A failure of `plan`, an in-flight migration of `output`, must be undone by `fail_migration`: its request
        is still in the state the plan left it in (the undoing event has an edge from its state; a resume's request
        is listed resumed in `output`) and still holds the plan's destinations (`copy_in_use`). Otherwise nothing
        will read what the copy writes, and its failure ends its fences as its completion would."""
        request = self.requests.get(plan.request_id)
        event, listed = self._undo_of(plan, output)
        return (
            request is not None
            and (listed is None or request in listed)
            and event in self.lifecycle.allowed_events(request.state)
            and self.copy_in_use(plan)
        )

    def _undo_of(self, plan: MigrationPlan, output: SchedulerOutput) -> tuple[str, list[Request] | None]:
        """The event that undoes a failed `plan`, and the list of `output` its request joined when it was planned
        (None for an offload: it may offload a request suspended passes before)."""
        if plan.direction == TO_HOST:
            return "lose_host_copy", None
        return "recompute_pause", output.resumed

    def copy_in_use(self, plan: MigrationPlan) -> bool:
        """The request of in-flight `plan` still holds the plan's destination blocks, so it will read what the copy
        writes: a failure of the copy must be undone (`fail_migration`). False once it released them (it ended,
        lost its host copy or was preempted since): its copy's failure ends the fences as a completion does."""
        request = self.requests.get(plan.request_id)
        tier = self.pool.host if plan.direction == TO_HOST else self.pool.gpu
        held = set(tier.held(plan.request_id)) if request is not None else set()
        return bool(held) and all(dst in held for _, dst in plan.pairs)

    def lose_host_copy(self, request_id: Hashable) -> Request:
        """The host blocks of a suspended request are unusable (a copy failed, corrupt, tier gone): replay it."""
        request = self.get(request_id)
        self._fire(request, "lose_host_copy", self._idle)
        return request

    def set_host_capacity(self, host_blocks: int) -> list[Request]:
        """Attach, resize or remove (0) the host tier; suspended requests with host blocks lose them first (those
        held wholly on the GPU stay suspended there).

        Removing it is refused (`PoolError`, nothing changed) when recompute-pause is disabled under
        `max_utilization`: without either preemption path the scheduler would stall (LIVE-DONE)."""
        if (
            host_blocks == 0
            and not self.config.enable_recompute_pause
            and self.config.capacity_policy == "max_utilization"
        ):
            raise PoolError(
                "cannot remove the host tier while enable_recompute_pause=False: no victim could then be suspended "
                "or recompute-paused and the scheduler would stall (LIVE-DONE); enable recompute-pause in "
                "SchedulerConfig, or keep a host tier"
            )
        if self.pool.host.fenced:
            raise PoolError(
                f"cannot change the host tier while {len(self.pool.host.fenced)} of its blocks are in flight; "
                "call complete_migrations() for the current output first"
            )
        offloaded = [r for r in self.suspended if r.num_host_blocks] if host_blocks == 0 else []
        lost = [self.lose_host_copy(r.request_id) for r in offloaded]
        self.pool.set_host_capacity(host_blocks)
        if host_blocks == 0:
            self.host_tier_fallback = True
        return lost

    def fail_migration(self, output: SchedulerOutput, plan: MigrationPlan) -> FailedMigration:
        """The executor reports that the copies of `plan`, a migration of `output` (this iteration's, or an earlier
        one's whose copies are still in flight), failed (or that the host copy it would read is corrupt): undo the
        move through spec events, atomically.

        * ``to_host`` (an offload): the host copy is unusable, so the suspended request takes `lose_host_copy` to
          `recompute_paused` (its generated tokens are kept and replayed);
        * ``to_gpu`` (a resume): its GPU blocks never received the KV, so the `running` request (not scheduled while
          its copy is in flight) takes `recompute_pause` (to `recompute_paused`, or `awaiting_consensus` with
          several stages).

        Either way the plan is withdrawn (spec §4.0): it leaves the pool's in-flight set, which frees its fenced
        source blocks, and the request's destination blocks are released. `output` itself is not changed: the
        returned `FailedMigration` is the amendment, and `output.amended(failure)` is the output to carry on with
        (the plan left `migrations`, the request moved from `suspended` / `resumed` to `recompute_paused`, so
        OUT-DISJOINT and OUT-STATE hold and `check_invariants` of it passes). Call it before
        `complete_migrations` and only once the executor no longer touches the plan's blocks. Raises `PoolError`
        (nothing changed) when `plan` is not an in-flight migration of `output`, or there is nothing to undo
        (`needs_undo`: its request left the state the plan left it in, or released the destinations since; such a
        failure ends the plan's fences as its completion does: report it with `complete_migration`).
        """
        if plan not in output.migrations or plan.plan_id not in self.pool.in_flight:
            raise PoolError(
                f"migration plan {plan.plan_id} ({plan.direction}, request {plan.request_id!r}) is not an in-flight "
                "migration of this output; report a failed copy once, before complete_migrations(output)"
            )
        request = self.requests.get(plan.request_id)
        suspend = plan.direction == TO_HOST
        event, _ = self._undo_of(plan, output)
        if request is None or not self.needs_undo(output, plan):
            state = "not active (done or unknown)" if request is None else request.state
            raise PoolError(
                f"cannot fail migration plan {plan.plan_id} ({'an offload' if suspend else 'a resume'}): request "
                f"{plan.request_id!r} is {state}, not waiting for this copy (or no longer holds its destinations); "
                "only an offload or resume whose request still waits for the copy can fail: report a copy nobody "
                "waits for complete (Step.failed does)"
            )
        self._end_copy(plan)  # withdraw: sources free at once, destinations stay with the request until released
        self._fire(request, event, self._idle)
        return FailedMigration(plan, request, event)
