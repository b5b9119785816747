"""One scheduler step, written once: schedule -> issue copies -> compute -> complete. Every executor (the slot-level
simulator `kvstate.sim.SimExecutor`, the engine `executor.Engine`, and the pipeline runtime's rank 0) carries out a
`SchedulerOutput` through a `Step`, in this order:

1. ``step = Step.begin(scheduler)``: ``scheduler.schedule()``;
2. for each plan of ``step.to_issue()``: start its copies, then ``step.issued(plan, fence)``, or
   ``step.issued(plan, None)`` when they cannot be made: the plan is failed (`Scheduler.fail_migration`) and the
   step carries on with the amended output (``step.output``);
3. the forward pass of ``step.output`` (the executor's own);
4. for each ``(plan, fence)`` of ``step.to_wait()``: wait on the fence, then ``step.waited(plan)``; then
   ``step.complete_migrations()`` (only now may fenced source blocks be reused);
5. ``step.finish(sampled)``: ``complete_step``.

The executor does the work (copies, waits, the forward pass) and reports it; the `Step` decides what the scheduler
is told, and when. It never calls back into the executor, so the phases can be interleaved freely: a pipelined
executor begins micro-batch k+1 before it finishes k (`SimExecutor(micro_batches=)`), and the engine settles a
step a failure interrupted by running 2 and 4 again (each skips what was already done).

Invariants kept by a `Step`:
* `output` is the output being carried out: `schedule()`'s (`scheduled`), amended once per failed plan
  (`SchedulerOutput.amended`); no output is ever mutated;
* a plan is reported issued at most once and waited on at most once; a failed plan is never waited on;
* `complete_migrations` refuses to run before every plan of the output has been waited on or failed.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Generic, TypeVar

from kvstate.errors import PoolError
from kvstate.output import FailedMigration, SchedulerOutput
from kvstate.pool import MigrationPlan
from kvstate.request import Request

if TYPE_CHECKING:
    from kvstate.scheduler.scheduler import Scheduler

__all__ = ["Step"]

F = TypeVar("F")  # the executor's fence, in a `Step`: whatever it waits on


class Step(Generic[F]):
    """One step of `scheduler` in flight: the output being carried out, the fence of each issued plan, the plans
    waited on, and the amendments taken (the phases: this module's docstring)."""

    __slots__ = ("failures", "fences", "output", "scheduled", "scheduler", "waited_on")

    def __init__(self, scheduler: Scheduler, output: SchedulerOutput) -> None:
        """Carry out `output`, an output of `scheduler` (use `begin`, or wrap copies a failed pass left planned)."""
        self.scheduler = scheduler
        self.scheduled = output
        self.output = output
        self.fences: dict[int, F] = {}
        self.waited_on: set[int] = set()
        self.failures: list[FailedMigration] = []

    @classmethod
    def begin(cls, scheduler: Scheduler) -> Step[F]:
        """Phase 1: schedule one iteration."""
        return cls(scheduler, scheduler.schedule())

    def to_issue(self) -> list[MigrationPlan]:
        """Phase 2: the plans of the output not yet reported issued, in order."""
        return [plan for plan in self.output.migrations if plan.plan_id not in self.fences]

    def issued(self, plan: MigrationPlan, fence: F | None) -> None:
        """`plan`'s copies were started (`fence`), or could not be made (None): the plan is then failed through
        `Scheduler.fail_migration` and `output` becomes the amended output."""
        if fence is None:
            failure = self.scheduler.fail_migration(self.output, plan)
            self.output = self.output.amended(failure)
            self.failures.append(failure)
        else:
            self.fences[plan.plan_id] = fence

    def to_wait(self) -> list[tuple[MigrationPlan, F]]:
        """Phase 4: (plan, fence) of every issued plan not yet waited on, in order."""
        fences, done = self.fences, self.waited_on
        return [
            (plan, fences[plan.plan_id])
            for plan in self.output.migrations
            if plan.plan_id in fences and plan.plan_id not in done
        ]

    def waited(self, plan: MigrationPlan) -> None:
        """`plan`'s copies have completed."""
        self.waited_on.add(plan.plan_id)

    def complete(self, plan: MigrationPlan) -> None:
        """Phase 4 for one plan, for an executor whose copies complete at their own time (possibly passes after this
        step): `plan`'s copies completed (`waited` first), and the scheduler is told now
        (`Scheduler.complete_migration`). Raises `PoolError` (nothing told) for a plan not issued or not waited on."""
        if plan.plan_id not in self.fences or plan.plan_id not in self.waited_on:
            raise PoolError(
                f"migration plan {plan.plan_id} of iteration {self.scheduler.iteration} was not issued and waited on; "
                "report it with issued() and waited() before complete()"
            )
        self.scheduler.complete_migration(plan)

    def failed(self, plan: MigrationPlan) -> None:
        """An issued plan's copies failed at their own time (after `issued`, possibly passes after this step): while
        its request still reads their destinations the failure is undone through `Scheduler.fail_migration` and
        `output` becomes the amended output; otherwise (its request released them since) the failure ends the
        plan's fences as a completion would. Raises `PoolError` (nothing told) for a plan not in flight."""
        if plan.plan_id not in self.fences or plan.plan_id in self.waited_on:
            raise PoolError(f"migration plan {plan.plan_id} is not an issued copy in flight; report a failure once")
        if self.scheduler.needs_undo(self.output, plan):
            del self.fences[plan.plan_id]  # a failed plan is never waited on
            failure = self.scheduler.fail_migration(self.output, plan)
            self.output = self.output.amended(failure)
            self.failures.append(failure)
        else:
            self.waited_on.add(plan.plan_id)
            self.scheduler.complete_migration(plan)

    def complete_migrations(self) -> None:
        """Phase 4, last: tell the scheduler every copy of the output completed (their fenced blocks free up).
        Raises `PoolError` (nothing told) while a plan is still to be issued or waited on."""
        left = len(self.to_issue()) + len(self.to_wait())
        if left:
            raise PoolError(
                f"{left} migration plans of iteration {self.scheduler.iteration} are not yet issued or "
                "waited on; report each with issued() and waited() before complete_migrations()"
            )
        self.scheduler.complete_migrations(self.output)

    def finish(self, sampled: Mapping[Hashable, int]) -> list[Request]:
        """Phase 5: apply the forward pass; returns the requests that produced a token."""
        return self.scheduler.complete_step(self.output, sampled)
