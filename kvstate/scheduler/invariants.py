"""The spec's invariants of a scheduler's state, checked against the pool and a recount of the requests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstate.errors import InvariantViolation
from kvstate.output import SchedulerOutput, check_output
from kvstate.spec import RESIDENCY_TIERS

if TYPE_CHECKING:
    from kvstate.scheduler.core import SchedulerCore

__all__ = ["check_scheduler"]


def check_scheduler(scheduler: SchedulerCore, output: SchedulerOutput | None = None) -> None:
    """Raise `InvariantViolation` unless `scheduler`'s pool, requests and `output` satisfy the spec's invariants."""
    scheduler.pool.check_invariants()
    for request in scheduler.requests.values():
        if request.state not in scheduler.tally.counts:
            raise InvariantViolation(
                "STATS-COUNT",
                f"request {request.request_id!r} is active but in state {request.state!r}, which is not an "
                f"active state ({', '.join(scheduler.tally.counts)}): a transition was half applied",
            )
        gpu = len(scheduler.pool.gpu_blocks(request.request_id))
        host = len(scheduler.pool.host_blocks(request.request_id))
        tiers = RESIDENCY_TIERS[scheduler.spec.residency(request.state)]  # where its state lets it hold blocks
        if (gpu, host) != (request.num_gpu_blocks, request.num_host_blocks):
            raise InvariantViolation(
                "RES-STATE",
                f"request {request.request_id!r} records {request.num_gpu_blocks}"
                f"/{request.num_host_blocks} blocks, the pool says {gpu}/{host}",
            )
        if (gpu and "gpu" not in tiers) or (host and "host" not in tiers):
            raise InvariantViolation(
                "RES-STATE",
                f"request {request.request_id!r} in {request.state} holds {gpu} GPU and {host} host blocks",
            )
        if host and not scheduler.pool.has_host_tier:
            raise InvariantViolation(
                "NO-HOST-NO-OFFLOAD", f"request {request.request_id!r} holds {host} host blocks without a host tier"
            )
        if request.step_in_flight != (request.request_id in scheduler.in_flight):
            raise InvariantViolation(
                "PROMOTE-GATE",
                f"request {request.request_id!r} says its step is {'' if request.step_in_flight else 'not '}in "
                "the pipeline, the scheduler's in_flight says otherwise (the promotion gate reads the request)",
            )
        offloadable = "host" in tiers  # its GPU blocks are held: the pool may offload them
        if scheduler.pool.is_held(request.request_id) != (offloadable and gpu > 0):
            raise InvariantViolation(
                "RES-STATE",
                f"request {request.request_id!r} in {request.state} with {gpu} GPU blocks is "
                f"{'' if scheduler.pool.is_held(request.request_id) else 'not '}held by the pool",
            )
    kept, recount = scheduler.tally.to_dict(), scheduler.tally.recount(scheduler.requests.values()).to_dict()
    if recount != kept:
        raise InvariantViolation("STATS-COUNT", f"a recount of the requests gives {recount}, the tally {kept}")
    for request in scheduler.finished.values():
        if scheduler.pool.gpu_blocks(request.request_id) or scheduler.pool.host_blocks(request.request_id):
            raise InvariantViolation("RES-STATE", f"finished request {request.request_id!r} still holds blocks")
    if output is not None:
        check_output(output, scheduler.spec)
