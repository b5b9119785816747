"""Held blocks: the offload of suspended requests' GPU blocks to the host tier, as the storage manager does it.

Invariants kept (OFFLOAD-DEMAND): held blocks move down only for an allocation that needs GPU room, never more than it
needs, least recently held first, each move one `offload` event through the lifecycle; with the policy's `eager`
offload, all of a victim's blocks move in the pass that suspends it. A request with a copy or a step in flight, and
the requester itself, are skipped. An offload's GPU sources are room on its way until its copy completes.
"""

from __future__ import annotations

from kvstate.policy import Offload
from kvstate.request import Request
from kvstate.scheduler.core import SchedulerCore
from kvstate.scheduler.scheduling_pass import SchedulingPass

__all__ = ["HeldBlocks"]


class HeldBlocks(SchedulerCore):
    """The scheduler's offload of held blocks (this module's docstring)."""

    def _offload_for(self, requester: Request, blocks: int, pass_: SchedulingPass) -> int:
        """Offload up to `blocks` held GPU blocks for `requester`'s allocation, least recently held first, skipping
        the requester itself and requests with a copy or a step in flight; their sources become room on its way
        (`pending_free`). Returns the blocks moved."""
        moved = 0
        if not self.pool.host_free_blocks:
            return moved  # no room below (or no host tier): nothing moves
        for owner in self.pool.held_owners():
            if moved >= blocks or not self.pool.host_free_blocks:
                break
            held = self.requests.get(owner)
            if held is None or held is requester or held.copy_in_flight or owner in self.in_flight:
                continue
            before = held.num_gpu_blocks
            pass_.offload_limit = blocks - moved
            fired = self._try_fire(held, "offload", pass_)
            pass_.offload_limit = 0
            if fired is not None:
                count = before - held.num_gpu_blocks
                moved += count
                pass_.pending_free += count
                pass_.record.decisions.append(Offload(requester.request_id, owner, count))
        return moved

    def _offload_for_eagerly(self, victim: Request, requester: Request, pass_: SchedulingPass) -> None:
        """The `eager` offload policy: every block of the just suspended `victim` moves to the host tier now, as far
        as it has room (the requester waits for them as for any offload); a victim whose step is still in flight
        keeps them held until that step lands (later stages still write its KV there)."""
        if victim.request_id in self.in_flight:
            return
        before = victim.num_gpu_blocks
        pass_.offload_limit = before
        fired = self._try_fire(victim, "offload", pass_)
        pass_.offload_limit = 0
        if fired is not None:
            pass_.pending_free += before - victim.num_gpu_blocks
            pass_.record.decisions.append(
                Offload(requester.request_id, victim.request_id, before - victim.num_gpu_blocks)
            )
