"""Preemption: freeing GPU blocks for a requester by taking them from a victim.

Invariants kept (ids from the spec; the policy's rules are the spec's `[policy]`, given meaning in `kvstate.policy`):
* victims are taken tail-first by admission order among requests not yet scheduled in the pass, never twice in a
  pass, never one about to produce its final token, never one awaiting consensus, never one past the preemption cap
  unless the requester is the head of the pass, the request it serves first, never one the pass cannot move
  (recompute-pause disabled and no suspension allowed now) (VICTIM-TAIL, VICTIM-ONCE, VICTIM-NOT-FINAL, VICTIM-CAP,
  PP-HOLD): the exclusions the spec's policy names; a requester the pass cannot move waits instead of preempting
  itself;
* suspension copies nothing: a suspended request's GPU blocks are held, and GPU room comes from the offload of held
  blocks to the host tier, which an allocation asks for when it needs room, exactly as many blocks as it needs,
  least recently held first (OFFLOAD-DEMAND; with the policy's `eager` offload, all of a victim's blocks at its
  suspension); an offload's GPU sources free once its copy completes, so the requester waits for them;
* a victim is suspended as the policy's suspend rule allows (`host_takes_every_held_block`: the host tier can take
  every held block, its own included, so held blocks never block an allocation: SUSPEND-ROOM), else, promoting
  requests suspended earlier in the same pass (most recent first, while their KV is worth less than the victim's:
  PROMOTE-GATE), suspended after promotion, else recompute-paused;
* a requester that counts on room on its way (fenced blocks, blocks awaiting consensus) reserves it, so the next
  requester takes a victim instead of counting the same blocks (WORK-CONSERVE).
"""

from __future__ import annotations

from kvstate.errors import KVStateError
from kvstate.policy import (
    CHUNK_IN_FLIGHT,
    EAGER,
    HOST_TAKES_EVERY_HELD_BLOCK,
    VICTIM_EXCLUSIONS,
    Promotion,
    Victim,
    Wait,
    preemption_capped,
)
from kvstate.pool import MigrationPlan
from kvstate.request import Request
from kvstate.scheduler.held_blocks import HeldBlocks
from kvstate.scheduler.scheduling_pass import SchedulingPass
from kvstate.semantics import promotion_saves_kv

__all__ = ["Preemption"]


class Preemption(HeldBlocks):
    """The scheduler's victim choice and preemption (this module's docstring)."""

    def _make_room(self, request: Request, need: int, pass_: SchedulingPass) -> bool:
        """Free `need` GPU blocks for `request`: True when they are free now; False when it preempted itself or
        waits for room on its way (which it then reserves: WORK-CONSERVE)."""
        if self.config.max_preemptions_per_request is not None:
            self.head_of_pass(pass_)  # the cap spares the head's victims: find it before any victim changes state
        pool = self.pool
        while (free := pool.gpu_free_blocks) < need:
            short = need - free
            if pass_.pending_free < short:  # held blocks move down first: their sources free once copied
                self._offload_for(request, short - pass_.pending_free, pass_)
            if pass_.pending_free >= short:
                self._wait(request, short, pass_)
                return False
            pass_.requester = request
            victim = self._pick_victim(pass_)
            if victim is None:
                protected = request.about_to_finish or self._capped(request)
                if protected and (pass_.output.chunk_tokens or pass_.pending_free):
                    self._wait(request, min(short, pass_.pending_free), pass_)
                    return False  # requests scheduled in this pass, or pending copies, will free room
                if self._victim_lands(pass_):
                    self._wait(request, 0, pass_)
                    return False  # a victim once its chunk in flight lands (P1: no mutual self-preemption)
                if not self.victim_movable(request, pass_):  # it cannot even evict itself: it waits for nothing
                    self._wait(request, 0, pass_)
                    return False
                self._preempt(request, pass_)
                return False
            self._preempt(victim, pass_)
        return True

    def _wait(self, request: Request, reserved: int, pass_: SchedulingPass) -> None:
        """`request` waits for `reserved` blocks on their way; it is no victim for the rest of the pass."""
        pass_.pending_free -= reserved
        pass_.waited = True
        pass_.waiting.add(id(request))
        pass_.record.decisions.append(Wait(request.request_id, reserved))

    def _capped(self, request: Request) -> bool:
        return preemption_capped(request, self.config.max_preemptions_per_request)

    def _victim_eligible(self, candidate: Request, pass_: SchedulingPass) -> bool:
        """`candidate` is in a victim state and no exclusion of the spec's policy (`victim_exclusions`) applies."""
        if candidate.state not in self._victim_states:
            return False
        for excluded in self._exclusions:  # noqa: SIM110 (a loop, not `all` over a generator: it runs per candidate)
            if excluded(self, candidate, pass_):
                return False
        return True

    def _victim_lands(self, pass_: SchedulingPass) -> bool:
        """The policy's `no_eligible_victim` rule waits (`wait_for_chunk_in_flight`) and some request that only
        `chunk_in_flight` excludes could give up its blocks once that chunk lands."""
        if self._landing_exclusions is None:
            return False
        return any(
            candidate.state in self._victim_states
            and VICTIM_EXCLUSIONS[CHUNK_IN_FLIGHT](self, candidate, pass_)
            and not any(excluded(self, candidate, pass_) for excluded in self._landing_exclusions)
            for candidate in self.admitted
        )

    def _pick_victim(self, pass_: SchedulingPass) -> Request | None:
        """The most recently admitted eligible request (VICTIM-TAIL), or None."""
        for candidate in reversed(self.admitted):
            if self._victim_eligible(candidate, pass_):
                return candidate
        return None

    def _preempt(self, victim: Request, pass_: SchedulingPass) -> None:
        """Suspend the victim if the suspend rule lets it (promoting if worth it), else recompute-pause it, to make
        room for `pass_.requester` (set before: the victim itself when it evicts itself). Blocks that free only
        after a copy or a consensus count as `pending_free` for this pass; a suspension frees room only through the
        offload of held blocks (at once with the `eager` offload policy)."""
        requester = pass_.requester
        if requester is None:
            raise KVStateError("a victim is chosen only for a requester: set pass_.requester before preempting")
        pass_.victims.add(id(victim))
        held = victim.num_gpu_blocks
        suspendable = "suspend" in self.lifecycle.allowed_events(victim.state)
        if suspendable and (
            (self._suspension_frees(victim) and self._try_fire(victim, "suspend", pass_))
            or (self._promote_for(victim, pass_) and self._try_fire(victim, "suspend", pass_))
        ):
            pass_.suspended.append(victim)
            pass_.output.suspended.append(victim)
            event = "suspend"
        elif self.config.enable_recompute_pause:
            self._fire(victim, "recompute_pause", pass_)
            if victim.state == self._pending_reset:
                pass_.pending_free += held
            pass_.output.recompute_paused.append(victim)
            event = "recompute_pause"
        else:
            pass_.unmoved_victims += 1
            return
        pass_.preempted = True
        pass_.record.decisions.append(Victim(requester.request_id, victim.request_id, event))
        if event == "suspend" and self.policy.offload == EAGER:
            self._offload_for_eagerly(victim, requester, pass_)

    def _promote_for(self, victim: Request, pass_: SchedulingPass) -> bool:
        """Promote requests suspended earlier in this pass to recompute-pause, most recent first, so that the suspend
        rule lets `victim` be suspended: the shortest such group that makes the host room, only while its KV is
        worth less than the victim's, only when the spec's promotion gate lets each one go (it refuses one whose step
        is still in the pipeline), and only when `suspend` would then fire on the victim (not while a copy of the
        victim is in flight, SPEC.md 7.3): a promotion is never wasted. A promoted request frees its host blocks and
        its held GPU blocks, which no longer wait for host room."""
        pool = self.pool
        if (
            not self.config.enable_recompute_pause
            or self.policy.suspend_rule != HOST_TAKES_EVERY_HELD_BLOCK
            or not pool.has_host_tier
            or victim.num_gpu_blocks > pool.host.capacity
        ):
            return False
        missing = victim.num_gpu_blocks - (pool.host_free_blocks - pool.gpu_held_blocks)
        group, freed = [], 0
        for candidate in reversed(pass_.suspended):
            if freed >= missing:
                break
            group.append(candidate)
            freed += candidate.num_host_blocks + candidate.num_gpu_blocks
        if freed < missing or not promotion_saves_kv(sum(c.kv_tokens for c in group), victim.kv_tokens):
            return False
        if not self.lifecycle.can_fire(victim, "suspend", self._view(pass_)):
            return False
        worth, pass_.promotion_worth = pass_.promotion_worth, victim.kv_tokens
        view = self._view(pass_)  # the gate refuses, among others, a request whose step is still in the pipeline
        if not all(self.lifecycle.can_fire(c, "recompute_pause", view) for c in group):
            pass_.promotion_worth = worth
            return False
        for candidate in group:
            plans = [p for p in pass_.output.migrations if p.request_id == candidate.request_id]
            self._fire(candidate, "recompute_pause", pass_)
            pass_.promotion_worth -= candidate.kv_tokens
            self._abandon_migrations(plans, pass_)
            pass_.suspended.remove(candidate)
            pass_.output.suspended.remove(candidate)
            pass_.output.recompute_paused.append(candidate)
            pass_.record.decisions.append(Promotion(victim.request_id, candidate.request_id))
        return True

    def _abandon_migrations(self, plans: list[MigrationPlan], pass_: SchedulingPass) -> None:
        """Drop not-yet-issued copy plans of a request promoted in this pass; their GPU sources free at once."""
        for plan in plans:
            pass_.output.migrations.remove(plan)
            self._end_copy(plan)
            pass_.pending_free = max(0, pass_.pending_free - plan.num_blocks)  # reserved room: free now
