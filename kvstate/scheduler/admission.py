"""Admission: new requests and readmissions (resume, replay) in the policy's order.

Invariants kept: admissions follow the policy's classes in order, each by arrival, stopping at the first misfit
(ADMIT-ORDER); no new request in a pass that chose a victim or left a requester waiting (ADMIT-HOLD); a victim of
the pass is not readmitted in it; an admitted request leaves its queue, a skipped one stays where it was.
"""

from __future__ import annotations

from kvstate.policy import HOLD_NEW_AFTER_PREEMPTION_OR_WAIT, NO_READMISSION_OF_VICTIMS, STOP_AT_FIRST_MISFIT
from kvstate.request import Request
from kvstate.scheduler.held_blocks import HeldBlocks
from kvstate.scheduler.scheduling_pass import SchedulingPass
from kvstate.semantics import PassView, first_chunk_blocks, first_chunk_tokens

__all__ = ["Admission"]


class Admission(HeldBlocks):
    """The scheduler's admissions and readmissions (this module's docstring)."""

    def _admit(self, pass_: SchedulingPass) -> None:
        """Readmissions and admissions in the policy's class order, each class in arrival order (ADMIT-ORDER);
        new requests are held back in a pass that chose a victim or left a requester waiting (ADMIT-HOLD)."""
        rules = self.policy.admission_rules
        hold_new = HOLD_NEW_AFTER_PREEMPTION_OR_WAIT in rules and (pass_.preempted or pass_.waited)
        for event, queue in self._admission_queues:
            if event == "admit" and hold_new:
                return
            if not queue:
                continue  # nothing to admit from it, and no misfit to stop at
            if not self._admit_class(event, queue, pass_) and STOP_AT_FIRST_MISFIT in rules:
                return

    def _admit_class(self, event: str, queue: list[Request], pass_: SchedulingPass) -> bool:
        """Admit from `queue` in arrival order; False when a candidate did not fit (admission stops there). The
        queue is read in place, up to where admission stops (no copy of it: under pressure it holds most requests,
        and a pass usually stops at its head): an admitted request leaves it (`_queue_of`), a skipped one stays."""
        no_victims = NO_READMISSION_OF_VICTIMS in self.policy.admission_rules
        position = 0  # of the next candidate: those before it were skipped
        while position < len(queue):
            request = queue[position]
            if no_victims and id(request) in pass_.victims:
                position += 1
                continue  # never readmit a victim of this very pass
            if self.config.capacity_policy == "guaranteed_no_evict" and not self._reservable(request):
                return False
            if not self._admit_one(request, event, pass_):
                return False
        return True

    def _admit_one(self, request: Request, event: str, pass_: SchedulingPass) -> bool:
        if pass_.slots_left == 0 or request.request_id in self.in_flight:
            return False  # no slot, or its step of an earlier pass has not landed yet (it lost its host copy since)
        out = pass_.output
        if request.state == self._offloaded:
            # a resume locks its held blocks, copies its host blocks up and computes once they are back (refused
            # while a copy of it is in flight)
            view = self._view(pass_)
            if not self._fire_admission(request, event, pass_, view):
                self._make_admission_room(request, pass_, view)
                return False
            out.resumed.append(request)
            pass_.slots_left -= 1
            return True
        if pass_.tokens_left == 0:
            return False
        view = self._view(pass_)
        if not self._fire_admission(request, event, pass_, view):
            self._make_admission_room(request, pass_, view)  # nothing changed since `view` was built
            return False
        self._add_scheduled(request, first_chunk_tokens(request, self._view(pass_)), pass_)
        return True

    def _fire_admission(self, request: Request, event: str, pass_: SchedulingPass, view: PassView) -> bool:
        """Fire the admission class `event` on `request` if one of its guards holds (`view`: the pass as it is now).
        The spec's guards are asked first (`can_fire`, nothing fires): a candidate that does not fit, under memory
        pressure the head of its queue on every pass, is refused without an event fired through the lifecycle, and
        `view` still holds after a refusal."""
        return self.lifecycle.can_fire(request, event, view) and self._try_fire(request, event, pass_) is not None

    def _make_admission_room(self, request: Request, pass_: SchedulingPass, view: PassView) -> None:
        """A readmission or admission that did not fit (`view`: the pass when it was refused): when GPU room is what
        it lacked beyond the room already on its way, offload held blocks for the shortfall (the storage manager's
        allocation), so it fits once their copies complete. A resume needs its host blocks on the GPU, anything else
        its first chunk's blocks; with no host room nothing can be offloaded (`_offload_for`), so the need is not
        worked out then."""
        if not self.pool.host_free_blocks:
            return
        need = request.num_host_blocks if request.state == self._offloaded else first_chunk_blocks(request, view)
        short = need - self.pool.gpu_free_blocks - pass_.pending_free
        if short > 0:
            self._offload_for(request, short, pass_)

    def _reservable(self, request: Request) -> bool:
        """guaranteed_no_evict: the request's worst case fits beside every resident request's worst case."""
        blocks = self.pool.blocks_for_tokens
        reserved = sum(blocks(len(r.prompt) + r.max_new_tokens) - r.num_gpu_blocks for r in self.resident)
        return blocks(len(request.prompt) + request.max_new_tokens) <= self.pool.gpu_free_blocks - reserved
