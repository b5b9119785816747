"""The scheduler: one `schedule()` call per iteration decides who computes, who moves and who is preempted.

Invariants kept (ids from the spec):
* every state change goes through the compiled lifecycle table; effects run in `_Effects`;
* victims are taken tail-first by admission order among requests not yet scheduled in the pass, never twice
  in a pass, never one about to produce its final token, never one awaiting consensus, never one past the
  preemption cap (VICTIM-TAIL, VICTIM-ONCE, VICTIM-NOT-FINAL, PP-HOLD);
* a victim is suspended only when the host tier exists and has room, otherwise recompute-paused; a request
  suspended earlier in the pass is promoted only with a host tier (PROMOTE-GATE);
* no new request is admitted in a pass that preempted; output lists are disjoint (OUT-DISJOINT);
* requests' block counts mirror the pool (RES-STATE), checked by `check_invariants`.
Steady-state decode costs O(1) per running request: no lifecycle event fires unless a state changes.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence

from kvstate.config import RequestRejected, SchedulerConfig, normalize_stop_token_ids
from kvstate.errors import InvariantViolation, KVStateError, PoolError
from kvstate.lifecycle import STATE_ATTRIBUTE, TransitionTable
from kvstate.output import COMPUTING_STATES, LIST_STATES, SchedulerOutput
from kvstate.pool import TO_HOST, MigrationPlan, TieredBlockPool
from kvstate.request import Request, new_request
from kvstate.spec import Spec, Transition
from kvstate.stats import IterationStats


class SchedulerStalled(KVStateError, RuntimeError):
    """No request made progress for `no_progress_limit` iterations; the message names requests and pool state."""


class UnknownRequestId(KVStateError, KeyError, ValueError):
    """An API call named a request id the scheduler does not know or has already finished."""

    def __str__(self) -> str:
        return str(self.args[0])


def _by_arrival(request: Request) -> int:
    return request.arrival


class _Pass:
    """Book-keeping of one scheduling pass."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.output = SchedulerOutput()
        self.tokens_left = config.max_num_tokens
        self.slots_left = config.max_batch_size
        self.victims: set[int] = set()
        self.scheduled: set[int] = set()
        self.pending_free = 0
        self.preempted = False


class Scheduler:
    """Continuous batching over a `TieredBlockPool` with suspend and recompute-pause preemption."""

    def __init__(
        self,
        config: SchedulerConfig,
        spec: Spec | None = None,
        on_transition: Callable[[Request, Transition], None] | None = None,
    ) -> None:
        """`on_transition(request, transition)` is called after every lifecycle transition (e.g. a tracer)."""
        self.config = config
        self.on_transition = on_transition
        self.lifecycle = TransitionTable(spec)
        self.spec = self.lifecycle.spec
        self.pool = TieredBlockPool(config.gpu_blocks, config.host_blocks, config.block_size, config.pipeline_stages)
        self.requests: dict[Hashable, Request] = {}
        self.finished: dict[Hashable, Request] = {}
        self.waiting: list[Request] = []
        self.resident: list[Request] = []  # running, replaying, awaiting_consensus; arrival order
        self.suspended: list[Request] = []  # arrival order
        self.paused: list[Request] = []  # recompute_paused; arrival order
        self.admitted: list[Request] = []  # running and replaying, admission order (victims from the tail)
        self.iteration = 0
        self.host_tier_fallback = False
        self._arrivals = itertools.count()
        self._admissions = itertools.count()
        self._auto_ids = itertools.count()
        self._effects = _Effects(self)
        self._pass: _Pass | None = None
        self._idle_iterations = 0
        self._last_stats = IterationStats(iteration=0)

    # ------------------------------------------------------------------------------------------ submission
    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        stop_token_ids: Iterable[int] = (),
        request_id: Hashable | None = None,
    ) -> Request:
        """Queue a new request; raises `RequestRejected` (nothing changed) when it is invalid or can never fit."""
        stop = normalize_stop_token_ids(stop_token_ids)
        self.config.check_submission(prompt, max_new_tokens, stop)
        if request_id is None:
            request_id = self._next_free_id()
        elif not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            raise RequestRejected(f"request_id must be a str or an int, got {type(request_id).__name__}")
        if request_id in self.requests or request_id in self.finished:
            raise RequestRejected(f"request id {request_id!r} is already in use; pick a fresh id or pass None")
        request = new_request(request_id, prompt, max_new_tokens, stop_token_ids=stop,
                              arrival=next(self._arrivals), block_size=self.config.block_size)
        self.lifecycle.start(request)
        self.requests[request_id] = request
        self.waiting.append(request)
        return request

    def _next_free_id(self) -> int:
        while (rid := next(self._auto_ids)) in self.requests or rid in self.finished:
            pass
        return rid

    def get(self, request_id: Hashable) -> Request:
        """The active or finished request with this id."""
        found = self.requests.get(request_id) or self.finished.get(request_id)
        if found is None:
            raise UnknownRequestId(f"no request with id {request_id!r}; submit it first")
        return found

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------------------------------- termination
    def cancel(self, request_id: Hashable) -> Request:
        """Cancel an active request from any state (deferred while it awaits consensus)."""
        return self._terminate(request_id, "cancel")

    def abort(self, request_id: Hashable) -> Request:
        """Abort an active request (engine-side failure) from any state."""
        return self._terminate(request_id, "abort")

    def _terminate(self, request_id: Hashable, event: str) -> Request:
        request = self.requests.get(request_id)
        if request is None:
            where = "has already finished" if request_id in self.finished else "is unknown"
            raise UnknownRequestId(f"cannot {event} request {request_id!r}: it {where}; only active requests can be ended")
        self._fire(request, event)
        return request

    # -------------------------------------------------------------------------------------------- firing
    def _fire(self, request: Request, event: str) -> Transition:
        before = request.state
        transition = self.lifecycle.fire(request, event, self.pool, self._effects)
        self._move(request, before, transition.dest)
        if self.on_transition is not None:
            self.on_transition(request, transition)
        return transition

    def _move(self, request: Request, old: str, new: str) -> None:
        """Keep the per-state containers in step with a transition."""
        if old == new:
            return
        containers = self._containers()
        source, target = containers.get(old), containers.get(new)
        if source is not target:
            if source is not None:
                source.remove(request)
            if target is not None:
                bisect.insort(target, request, key=_by_arrival)
        if old in COMPUTING_STATES and new not in COMPUTING_STATES:
            self.admitted.remove(request)
        if new == "done":
            del self.requests[request.request_id]
            self.finished[request.request_id] = request

    def _containers(self) -> dict[str, list[Request]]:
        return {
            "waiting": self.waiting,
            "running": self.resident,
            "replaying": self.resident,
            "awaiting_consensus": self.resident,
            "suspended": self.suspended,
            "recompute_paused": self.paused,
        }

    # -------------------------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one iteration. Raises `SchedulerStalled` after `no_progress_limit` passes without progress."""
        self.iteration += 1
        self._pass = step = _Pass(self.config)
        step.pending_free = self._room_on_its_way()
        try:
            decoding, continuing = [], []
            for request in self.resident:
                (continuing if request.num_computed_tokens < len(request.prefill_tokens) else decoding).append(request)
            self._schedule_decoding(decoding, step)
            for request in continuing:  # then prompt and replay chunks, in arrival order
                if step.slots_left == 0 or step.tokens_left == 0:
                    break
                if id(request) not in step.victims and getattr(request, STATE_ATTRIBUTE) in COMPUTING_STATES:
                    self._schedule_resident(request, step)
            if self.config.capacity_policy == "max_utilization":
                self._admit_resumes(step)
                self._admit_replays(step)
            if not step.preempted:
                self._admit_new(step)
        finally:
            self._pass = None
        out = step.output
        out.num_fitting_requests = len(out.scheduled)
        self._watch_progress(out)
        return out

    def _room_on_its_way(self) -> int:
        """GPU blocks that free without further preemption: fenced by copies, or held awaiting consensus."""
        held = sum(r.num_gpu_blocks for r in self.resident if getattr(r, STATE_ATTRIBUTE) == "awaiting_consensus")
        return len(self.pool.gpu.fenced) + held

    def _schedule_decoding(self, decoding: list[Request], step: _Pass) -> None:
        """Generation requests in arrival order. The steady state — a running request whose last block still
        has room — costs a few attribute reads: no lifecycle event, no pool call."""
        out, block_size = step.output, self.config.block_size
        for request in decoding:
            if step.slots_left == 0 or step.tokens_left == 0:
                return
            if id(request) in step.victims or getattr(request, STATE_ATTRIBUTE) != "running":
                continue
            if request.num_computed_tokens < request.num_gpu_blocks * block_size:
                out.generation.append(request)
                out.chunk_tokens[request.request_id] = 1
                step.scheduled.add(id(request))
                step.tokens_left -= 1
                step.slots_left -= 1
            else:
                self._schedule_resident(request, step)

    def _schedule_resident(self, request: Request, step: _Pass) -> None:
        tokens = 1 if not request.is_prefilling else min(
            self.config.prefill_chunk_size, request.next_step_tokens, step.tokens_left
        )
        need = self.pool.blocks_for_tokens(request.num_computed_tokens + tokens) - request.num_gpu_blocks
        if need > self.pool.gpu_free_blocks:
            if self.config.capacity_policy == "guaranteed_no_evict":
                return
            self._make_room(request, need, step)
            if request.state not in COMPUTING_STATES or need > self.pool.gpu_free_blocks:
                return  # preempted itself, or the freed room is fenced until the copies complete
        if need:
            self.pool.allocate(request.request_id, need)
            request.num_gpu_blocks += need
        self._add_scheduled(request, tokens, step)

    def _add_scheduled(self, request: Request, tokens: int, step: _Pass) -> None:
        out = step.output
        if request.state == "replaying":
            out.replay.append(request)
        elif request.is_prefilling:
            out.context.append(request)
        else:
            out.generation.append(request)
        out.chunk_tokens[request.request_id] = tokens
        step.scheduled.add(id(request))
        step.tokens_left -= tokens
        step.slots_left -= 1

    # ------------------------------------------------------------------------------------------ preemption
    def _make_room(self, request: Request, need: int, step: _Pass) -> None:
        while self.pool.gpu_free_blocks + step.pending_free < need:
            victim = self._pick_victim(request, step)
            if victim is None:
                protected = request.about_to_finish or self._capped(request)
                if protected and (step.scheduled or step.pending_free):
                    return  # wait: requests scheduled in this pass, or pending copies, will free room
                self._preempt(request, step)
                return
            self._preempt(victim, step)

    def _capped(self, request: Request) -> bool:
        cap = self.config.max_preemptions_per_request
        return cap is not None and request.num_suspensions + request.num_recompute_pauses >= cap

    def _victim_eligible(self, candidate: Request, step: _Pass) -> bool:
        return (
            id(candidate) not in step.victims
            and id(candidate) not in step.scheduled
            and not candidate.about_to_finish
            and not self._capped(candidate)
        )

    def _pick_victim(self, requester: Request, step: _Pass) -> Request | None:
        """The most recently admitted eligible request other than `requester` (VICTIM-TAIL)."""
        for candidate in reversed(self.admitted):
            if candidate is not requester and self._victim_eligible(candidate, step):
                return candidate
        return None

    def _preempt(self, victim: Request, step: _Pass) -> None:
        """Suspend the victim if the host tier takes it (promoting if worth it), else recompute-pause it.
        Blocks that free only after a copy or a consensus count as `pending_free` for this pass."""
        step.victims.add(id(victim))
        suspendable = victim.state == "running" and self.pool.has_host_tier
        if self.lifecycle.can_fire(victim, "suspend", self.pool) or (suspendable and self._promote_for(victim, step)):
            step.pending_free += victim.num_gpu_blocks
            self._fire(victim, "suspend")
            step.output.suspended.append(victim)
        elif self.config.enable_recompute_pause:
            held = victim.num_gpu_blocks
            self._fire(victim, "recompute_pause")
            if victim.state == "awaiting_consensus":
                step.pending_free += held
            step.output.recompute_paused.append(victim)
        else:
            return
        step.preempted = True

    def _promote_for(self, victim: Request, step: _Pass) -> bool:
        """Promote requests suspended earlier in this pass to recompute-pause (tail-first) to make host room
        for `victim`, when a host tier exists and the promoted KV is worth less than the victim's."""
        if not self.pool.has_host_tier or not self.config.enable_recompute_pause:
            return False
        missing = victim.num_gpu_blocks - self.pool.host_free_blocks
        chosen, freed, worth = [], 0, 0
        for candidate in reversed(step.output.suspended):
            if freed >= missing:
                break
            chosen.append(candidate)
            freed += candidate.num_host_blocks
            worth += candidate.num_computed_tokens
        if freed < missing or worth >= victim.num_computed_tokens or victim.num_gpu_blocks > self.pool.host.capacity:
            return False
        for candidate in chosen:
            self._abandon_migration(candidate, step)
            self._fire(candidate, "recompute_pause")
            step.output.suspended.remove(candidate)
            step.output.recompute_paused.append(candidate)
        return True

    def _abandon_migration(self, request: Request, step: _Pass) -> None:
        """Drop the not-yet-issued copy plan of a request suspended in this pass; its GPU sources free at once."""
        for plan in [p for p in step.output.migrations if p.request_id == request.request_id]:
            step.output.migrations.remove(plan)
            self.pool.complete(plan)
            step.pending_free -= plan.num_blocks

    # ------------------------------------------------------------------------------------------- admission
    def _admit_resumes(self, step: _Pass) -> None:
        for request in list(self.suspended):
            if id(request) in step.victims:
                continue  # never resume a victim of this very pass
            if step.slots_left == 0 or self._in_flight(request):
                break
            if not self.lifecycle.can_fire(request, "resume", self.pool):
                break
            self._fire(request, "resume")
            step.output.resumed.append(request)
            step.slots_left -= 1

    def _in_flight(self, request: Request) -> bool:
        return any(plan.request_id == request.request_id for plan in self.pool.in_flight.values())

    def _admit_replays(self, step: _Pass) -> None:
        for request in list(self.paused):
            if id(request) in step.victims:
                continue  # never replay a victim of this very pass
            if not self._admit_chunked(request, "replay", step):
                break

    def _admit_new(self, step: _Pass) -> None:
        for request in list(self.waiting):
            if self.config.capacity_policy == "guaranteed_no_evict" and not self._reservable(request):
                break
            if not self._admit_chunked(request, "admit", step):
                break

    def _admit_chunked(self, request: Request, event: str, step: _Pass) -> bool:
        if step.slots_left == 0 or step.tokens_left == 0:
            return False
        request.planned_chunk = min(self.config.prefill_chunk_size, request.next_step_tokens, step.tokens_left)
        if not self.lifecycle.can_fire(request, event, self.pool):
            return False
        self._fire(request, event)
        self._add_scheduled(request, request.planned_chunk, step)
        return True

    def _reservable(self, request: Request) -> bool:
        """guaranteed_no_evict: the request's worst case fits beside every resident request's worst case."""
        blocks = self.pool.blocks_for_tokens
        reserved = sum(blocks(len(r.prompt) + r.max_new_tokens) - r.num_gpu_blocks for r in self.resident)
        return blocks(len(request.prompt) + request.max_new_tokens) <= self.pool.gpu_free_blocks - reserved

    # --------------------------------------------------------------------------------------- after compute
    def complete_migrations(self, output: SchedulerOutput) -> None:
        """The executor reports every copy of `output.migrations` complete: end their fences."""
        for plan in output.migrations:
            if plan.plan_id in self.pool.in_flight:
                self.pool.complete(plan)

    def complete_step(self, output: SchedulerOutput, sampled: Mapping[Hashable, int]) -> list[Request]:
        """Apply a forward pass: advance computed tokens, append each produced token (`sampled[id]`),
        fire catch_up and finish. Returns the requests that produced a token."""
        produced = []
        recomputed = generated = 0
        for request in output.scheduled:
            if request.state not in COMPUTING_STATES:
                continue  # cancelled or aborted since the output was planned
            tokens = output.chunk_tokens[request.request_id]
            request.num_computed_tokens += tokens
            if request.state == "replaying":
                request.num_recomputed_tokens += tokens
                recomputed += tokens
            if request.is_prefilling:
                continue
            request.append_token(sampled[request.request_id])
            generated += 1
            produced.append(request)
            if request.state == "replaying":
                self._fire(request, "catch_up")
            if request.final_token_produced:
                self._fire(request, "finish")
        self._last_stats = self._stats(output, recomputed, generated)
        if produced or recomputed:
            self._idle_iterations = 0
        return produced

    # ------------------------------------------------------------------------------- pipeline, host tier
    def reach_consensus(self, request_ids: Collection[Hashable] | None = None) -> list[Request]:
        """Every stage agreed on these pending recompute-pauses (default: all of them): reset them for replay,
        or terminate them if they finished or were cancelled while waiting."""
        pending = [r for r in self.resident if r.state == "awaiting_consensus"
                   and (request_ids is None or r.request_id in request_ids)]
        for request in pending:
            self._fire(request, "consensus")
        return pending

    def lose_host_copy(self, request_id: Hashable) -> Request:
        """The host copy of a suspended request is unusable (copy failed, corrupt, tier gone): replay it."""
        request = self.get(request_id)
        self._fire(request, "lose_host_copy")
        return request

    def set_host_capacity(self, host_blocks: int) -> list[Request]:
        """Attach, resize or remove (0) the host tier; suspended requests lose their host copies first.

        Removing it is refused (`PoolError`, nothing changed) when recompute-pause is disabled under
        `max_utilization`: without either preemption path the scheduler would stall (LIVE-DONE)."""
        if host_blocks == 0 and not self.config.enable_recompute_pause \
                and self.config.capacity_policy == "max_utilization":
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
        lost = [self.lose_host_copy(r.request_id) for r in list(self.suspended)] if host_blocks == 0 else []
        self.pool.set_host_capacity(host_blocks)
        if host_blocks == 0:
            self.host_tier_fallback = True
        return lost

    def fail_migration(self, output: SchedulerOutput, plan: MigrationPlan) -> Request:
        """The executor reports that the copies of `plan`, a migration of this iteration's `output`, failed
        (or that the host copy it would read is corrupt): undo the move through spec events, atomically.

        * ``to_host`` (a suspend of this pass): the host copy is unusable, so the suspended request takes
          `lose_host_copy` to `recompute_paused` (its generated tokens are kept and replayed);
        * ``to_gpu`` (a resume of this pass): its GPU blocks never received the KV, so the now `running`
          request takes `recompute_pause` (to `recompute_paused`, or `awaiting_consensus` with several stages).

        Either way the plan is withdrawn (spec §4.0): it leaves `output.migrations` and the pool's in-flight set,
        which frees its fenced source blocks, and the request's destination blocks are released; the request
        moves from `output.suspended` / `output.resumed` to `output.recompute_paused`, so OUT-DISJOINT and
        OUT-STATE hold and `check_invariants(output)` passes. Call it before `complete_migrations(output)` and
        only once the executor no longer touches the plan's blocks. Raises `PoolError` (nothing changed) when
        `plan` is not an in-flight migration of `output`, or its request is not in the state the plan left it.
        """
        if plan not in output.migrations or plan.plan_id not in self.pool.in_flight:
            raise PoolError(
                f"migration plan {plan.plan_id} ({plan.direction}, request {plan.request_id!r}) is not an in-flight "
                "migration of this output; report a failed copy once, before complete_migrations(output)"
            )
        request = self.requests.get(plan.request_id)
        suspend = plan.direction == TO_HOST
        event, listed = ("lose_host_copy", output.suspended) if suspend else ("recompute_pause", output.resumed)
        if request is None or request not in listed or not self.lifecycle.can_fire(request, event, self.pool):
            state = "not active (done or unknown)" if request is None else request.state
            raise PoolError(
                f"cannot fail migration plan {plan.plan_id}: request {plan.request_id!r} is {state} and "
                f"{'not ' if request is None or request not in listed else ''}listed as "
                f"{'suspended' if suspend else 'resumed'} in this output; only a suspend or resume of the current "
                "iteration can fail"
            )
        output.migrations.remove(plan)
        self.pool.complete(plan)  # withdraw: sources free at once, destinations stay with the request until released
        self._fire(request, event)
        listed.remove(request)
        output.recompute_paused.append(request)
        return request

    # -------------------------------------------------------------------------------------------- progress
    def _watch_progress(self, out: SchedulerOutput) -> None:
        if out.scheduled or out.migrations or not self.requests:
            return
        self._idle_iterations += 1
        if self._idle_iterations >= self.config.no_progress_limit:
            listing = ", ".join(f"{r.request_id!r}:{r.state}" for r in list(self.requests.values())[:20])
            raise SchedulerStalled(
                f"no request made progress for {self._idle_iterations} iterations; requests {listing}; "
                f"pool {self.pool.usage()}; in-flight copies {len(self.pool.in_flight)} (complete them with "
                "complete_migrations), or raise gpu_blocks / enable recompute-pause"
            )

    # ---------------------------------------------------------------------------------------- observation
    def stats(self) -> IterationStats:
        """Statistics of the last completed iteration."""
        return self._last_stats

    def _stats(self, out: SchedulerOutput, recomputed: int, generated: int) -> IterationStats:
        counts = {s.name: 0 for s in self.spec.states}
        for request in self.requests.values():
            counts[request.state] += 1
        counts["done"] = len(self.finished)
        blocks = sum(p.num_blocks for p in out.migrations)
        usage = self.pool.usage()
        return IterationStats(
            iteration=self.iteration,
            requests_per_state=counts,
            suspended_kv_tokens=sum(r.num_computed_tokens for r in self.suspended),
            recompute_paused_tokens_to_replay=sum(len(r.prefill_tokens) for r in self.paused),
            suspended_this_iteration=len(out.suspended),
            recompute_paused_this_iteration=len(out.recompute_paused),
            preemptions=len(out.suspended) + len(out.recompute_paused),
            scheduled_tokens=out.num_tokens,
            recomputed_tokens=recomputed,
            generated_tokens=generated,
            blocks_migrated=blocks,
            bytes_migrated=blocks * self.config.block_bytes,
            gpu_blocks_used=usage["gpu_held"] + usage["gpu_fenced"],
            gpu_capacity=usage["gpu_capacity"],
            host_blocks_used=usage["host_held"] + usage["host_fenced"],
            host_capacity=usage["host_capacity"],
            host_tier_fallback=self.host_tier_fallback,
        )

    def check_invariants(self, output: SchedulerOutput | None = None) -> None:
        """Raise `InvariantViolation` unless the pool, every request and `output` satisfy the spec's invariants."""
        self.pool.check_invariants()
        for request in self.requests.values():
            gpu = len(self.pool.gpu_blocks(request.request_id))
            host = len(self.pool.host_blocks(request.request_id))
            residency = self.spec.residency(request.state)
            if (gpu, host) != (request.num_gpu_blocks, request.num_host_blocks):
                raise InvariantViolation("RES-STATE", f"request {request.request_id!r} records {request.num_gpu_blocks}"
                                         f"/{request.num_host_blocks} blocks, the pool says {gpu}/{host}")
            if (residency != "gpu" and gpu) or (residency != "host" and host):
                raise InvariantViolation("RES-STATE", f"request {request.request_id!r} in {request.state} holds "
                                         f"{gpu} GPU and {host} host blocks")
            if request.state == "suspended" and not self.pool.has_host_tier:
                raise InvariantViolation("NO-HOST-NO-SUSPEND", f"request {request.request_id!r} is suspended without a host tier")
        for request in self.finished.values():
            if self.pool.gpu_blocks(request.request_id) or self.pool.host_blocks(request.request_id):
                raise InvariantViolation("RES-STATE", f"finished request {request.request_id!r} still holds blocks")
        if output is not None:
            check_output(output)


def check_output(output: SchedulerOutput) -> None:
    """OUT-DISJOINT and OUT-STATE for one output, right after the pass that produced it."""
    seen: dict[int, str] = {}
    for name, requests in output.lists():
        for request in requests:
            if id(request) in seen:
                raise InvariantViolation("OUT-DISJOINT", f"request {request.request_id!r} is in both "
                                         f"{seen[id(request)]!r} and {name!r}")
            seen[id(request)] = name
            if request.state not in LIST_STATES[name] and request.state != "done":
                raise InvariantViolation("OUT-STATE", f"request {request.request_id!r} in list {name!r} is "
                                         f"{request.state}, expected one of {LIST_STATES[name]}")


class _Effects:
    """The scheduler's implementation of `kvstate.EffectHooks`: block accounting and request counters."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    def _migrations(self) -> list:
        step = self.s._pass
        if step is None:
            raise KVStateError("migrations happen only inside schedule(); suspend and resume are scheduler decisions")
        return step.output.migrations

    def allocate_first_chunk(self, request: Request, transition: Transition) -> None:
        blocks = request.blocks_for_first_chunk
        self.s.pool.allocate(request.request_id, blocks)
        request.num_gpu_blocks = blocks
        request.admission = next(self.s._admissions)
        self.s.admitted.append(request)

    def migrate_to_host(self, request: Request, transition: Transition) -> None:
        plan = self.s.pool.suspend(request.request_id)
        self._migrations().append(plan)
        request.num_gpu_blocks, request.num_host_blocks = 0, plan.num_blocks
        request.num_suspensions += 1

    def migrate_to_gpu(self, request: Request, transition: Transition) -> None:
        plan = self.s.pool.resume(request.request_id)
        self._migrations().append(plan)
        request.num_gpu_blocks, request.num_host_blocks = plan.num_blocks, 0
        request.admission = next(self.s._admissions)
        self.s.admitted.append(request)

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
