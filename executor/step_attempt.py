"""How far one engine step got (`StepAttempt`), and settling a step that an exception interrupted
(`settle_interrupted`).

What it keeps true:
* once a step is settled, every fence of it has completed, the copy stream is drained, and every migration of the
  iteration is completed, or failed through `Scheduler.fail_migration`: nothing is in flight;
* settling names what keeps the engine's state from being consistent (`complete_step` had applied part of the
  iteration, the scheduler's invariants no longer hold, a migration is still in flight, settling itself failed),
  and names nothing when the state is consistent.
"""

from __future__ import annotations

from operator import attrgetter

from executor.host_tier import HostTier
from executor.kv_cache import Fence, PagedKVCache
from kvstate.output import SchedulerOutput
from kvstate.pool import TO_GPU
from kvstate.scheduler import Scheduler, Step


class StepAttempt:
    """How far one step got, so that a failure can settle it: the phase, the `Step` (its output, the fence of each
    issued plan, the plans already waited on; None before `schedule()` returned), and the scheduled requests'
    progress before `complete_step` (None until then)."""

    __slots__ = ("phase", "progress", "step")

    def __init__(self) -> None:
        self.phase = "start"
        self.step: Step[Fence] | None = None
        self.progress: list[tuple[int, str]] | None = None


def step_progress(out: SchedulerOutput) -> list[tuple[int, str]]:
    """What `complete_step` changes of every scheduled request it applies (each advances its computed tokens)."""
    return list(map(_PROGRESS, out.scheduled))


_PROGRESS = attrgetter("num_computed_tokens", "state")


def settle_interrupted(
    attempt: StepAttempt, scheduler: Scheduler, cache: PagedKVCache, host_tier: HostTier
) -> str | None:
    """Settle the step `attempt` records after an exception interrupted it: wait on every fence, drain the copy
    stream and carry every migration of the iteration to its end (`HostTier.settle`). Returns what keeps the state
    from being consistent, or None when it is."""
    problem = None
    try:
        step = attempt.step
        for fence in step.fences.values() if step is not None else ():
            fence.wait()
        cache.drain()
        if step is None and scheduler.pool.in_flight:  # schedule() planned copies, then failed
            step = attempt.step = Step(scheduler, _planned_copies(scheduler))
        if step is not None:
            host_tier.settle(step)
        if (
            step is not None
            and attempt.progress is not None
            and attempt.phase == "complete step"
            and attempt.progress != step_progress(step.output)
        ):
            problem = "complete_step had already applied part of the iteration"
        scheduler.check_invariants()
        if scheduler.pool.in_flight:
            problem = problem or f"{len(scheduler.pool.in_flight)} migrations are still in flight"
    except BaseException as settling:
        problem = f"settling it failed too ({type(settling).__name__}: {settling})"
    return problem


def _planned_copies(scheduler: Scheduler) -> SchedulerOutput:
    """An output carrying the copies a `schedule()` that failed mid-pass had planned, so that they can be settled:
    its in-flight plans, each resume's request listed `resumed` (a failed resume is undone only for a request
    listed there). An offload's request is listed nowhere: it may have been suspended passes before, and the undoing
    of a failed offload reads no list."""
    plans = list(scheduler.pool.in_flight.values())
    resumed = [scheduler.requests[p.request_id] for p in plans if p.direction == TO_GPU]
    return SchedulerOutput(migrations=plans, resumed=resumed)
