"""The iteration statistics of a scheduler, built from the figures its tally keeps (O(states), never O(requests))."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstate.output import SchedulerOutput
from kvstate.pool import TO_HOST
from kvstate.stats import IterationStats

if TYPE_CHECKING:
    from kvstate.scheduler.core import SchedulerCore

__all__ = ["figures_now", "stats_of"]


def figures_now(scheduler: SchedulerCore, recomputed: int, generated: int, *, iteration: int) -> dict[str, Any]:
    """The `IterationStats` fields of an iteration that `scheduler`'s state gives, read now in O(states):
    `complete_step` takes them on every step, `stats` builds the record only when asked (with what its output
    says: no output is mutated once planned, `SchedulerOutput.amended` makes a new one)."""
    tally, gpu, host = scheduler.tally, scheduler.pool.gpu, scheduler.pool.host
    counts = {**tally.counts, scheduler._ended: len(scheduler.finished)}
    return {
        "iteration": iteration,
        "requests_per_state": counts,
        "num_suspended": counts[scheduler._offloaded],
        "num_recompute_paused": counts[scheduler._dropped] + counts[scheduler._pending_reset],
        "suspended_kv_tokens": tally.kv_tokens[scheduler._offloaded],
        "suspended_gpu_blocks": tally.gpu_blocks[scheduler._offloaded],
        "recompute_paused_kv_tokens": tally.kv_tokens[scheduler._pending_reset],
        "recompute_paused_tokens_to_replay": tally.replay_tokens[scheduler._dropped],
        "recomputed_tokens": recomputed,
        "generated_tokens": generated,
        "gpu_blocks_used": gpu.capacity - gpu.num_free,  # held + fenced (CONS-GPU)
        "gpu_capacity": gpu.capacity,
        "host_blocks_used": host.capacity - host.num_free,
        "host_capacity": host.capacity,
        "host_tier_fallback": scheduler.host_tier_fallback,
    }


def stats_of(out: SchedulerOutput, figures: dict[str, Any], block_bytes: int) -> IterationStats:
    """The `IterationStats` of `out`'s iteration: the `figures` the scheduler took when it completed
    (`figures_now`), and what `out` itself says."""
    blocks = sum(p.num_blocks for p in out.migrations)
    offloaded = sum(p.num_blocks for p in out.migrations if p.direction == TO_HOST)
    return IterationStats(
        **figures,
        suspended_this_iteration=len(out.suspended),
        recompute_paused_this_iteration=len(out.recompute_paused),
        preemptions=len(out.suspended) + len(out.recompute_paused),
        scheduled_tokens=out.num_tokens,
        blocks_migrated=blocks,
        blocks_offloaded=offloaded,
        blocks_onboarded=blocks - offloaded,
        bytes_migrated=blocks * block_bytes,
    )
