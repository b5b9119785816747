"""The scheduler's state, and the one way it changes: a lifecycle event fired on a request.

`SchedulerCore` holds what every part of the scheduler reads (the pool, the requests and their containers, the
tally, the pass under way) and fires events: each guard evaluated once per decision on a `PassView` of the pass
under way, then the edge's effect (`SchedulerEffects`), then the containers and the tally moved with the request.
The parts of the scheduler (preemption, admission, landing a step, copy reports) are classes derived from it, and
`kvstate.scheduler.Scheduler` combines them.

Invariants kept:
* every state change goes through the lifecycle (the `transitions` machine by default, the compiled table when the
  config asks for it); states are found by role (`kvstate.roles`), never by name;
* a transition happens whole or not at all: an effect that raises leaves the request in its old state;
* a request is in the container of its state, in arrival order; `admitted` holds the computing requests in
  admission order; `requests` the active ones, `finished` the ended ones;
* `tally` equals a recount of the active requests (STATS-COUNT);
* any transition ends the decode run and the planned output (`_move`): a repeat never lists a moved request.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from typing import Any

from kvstate.config import SchedulerConfig
from kvstate.errors import KVStateError, TierFull, UnknownRequestId
from kvstate.lifecycle import STATE_ATTRIBUTE, make_lifecycle
from kvstate.output import SchedulerOutput
from kvstate.policy import (
    CHUNK_IN_FLIGHT,
    HOST_TAKES_EVERY_HELD_BLOCK,
    VICTIM_EXCLUSIONS,
    WAIT_FOR_CHUNK_IN_FLIGHT,
)
from kvstate.pool import TO_HOST, MigrationPlan, TieredBlockPool
from kvstate.request import Request
from kvstate.roles import ACTIVE, DROPPED, ENDED, OFFLOADED, PENDING_RESET, RECOMPUTING
from kvstate.scheduler.decode_run import DecodeRun
from kvstate.scheduler.effects import SchedulerEffects
from kvstate.scheduler.queues import BY_ADMISSION, BY_ARRIVAL, insert_ordered, remove_ordered
from kvstate.scheduler.scheduling_pass import SchedulingPass
from kvstate.scheduler.tally import Figures, StateTally
from kvstate.semantics import PassView
from kvstate.spec import Spec, Transition
from kvstate.stats import IterationStats
from kvstate.trace import FiredTransition
from kvstate.untrusted import shown

__all__ = ["SchedulerCore"]


class SchedulerCore:
    """The scheduler's state and its firing of lifecycle events (this module's docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        spec: Spec | None = None,
        on_transition: Callable[[Request, Transition], None] | None = None,
        *,
        record_transitions: bool = False,
    ) -> None:
        """`on_transition(request, transition)` is called after every lifecycle transition, inside the call that
        fired it (an observer: the model checker's refinement, a test). With `record_transitions` every
        transition is also recorded with the figures of its trace line (`snapshot`), for its owner to take after
        each call (`take_fired`), as the engine does: its trace is written outside the scheduler."""
        self.config: SchedulerConfig = config
        self.on_transition = on_transition
        self.fired: list[FiredTransition] | None = [] if record_transitions else None
        self.lifecycle = make_lifecycle(config.lifecycle, spec)
        self.spec = spec = self.lifecycle.spec
        self.policy = spec.policy
        self.pool = TieredBlockPool(config.gpu_blocks, config.host_blocks, config.block_size, config.pipeline_stages)
        self.requests: dict[Hashable, Request] = {}
        self.finished: dict[Hashable, Request] = {}
        self.waiting: list[Request] = []
        self.resident: list[Request] = []  # computing or awaiting consensus; arrival order
        self.suspended: list[Request] = []  # arrival order
        self.paused: list[Request] = []  # recompute-paused; arrival order
        self.admitted: list[Request] = []  # computing, admission order (victims from the tail)
        self.tally = StateTally(  # kept by `_move` (STATS-COUNT): what the statistics read, no walk per step
            (s.name for s in spec.states if not s.terminal),
            (s.name for s in spec.states if not s.terminal and not s.computing),
        )
        self.iteration = 0
        self.host_tier_fallback = False
        self.in_flight: dict[Hashable, int] = {}  # id -> blocks allocated for its step still in the pipeline
        self.micro_batches = 1  # passes whose outputs may be in flight at once (`track_in_flight`)
        self._active, self._recomputing = spec.role(ACTIVE), spec.role(RECOMPUTING)
        self._pending_reset, self._offloaded = spec.role(PENDING_RESET), spec.role(OFFLOADED)
        self._dropped, self._ended = spec.role(DROPPED), spec.role(ENDED)
        self._terminal = frozenset(spec.terminal_states)
        self._computing = spec.computing_states
        self._victim_states = spec.victim_states
        self._chunk_list = {s.name: dict(s.chunk_lists) for s in spec.states if s.computing}
        self._decode_list = self._chunk_list[self._active]["decode"]  # where the steady decode steps are listed
        self._exclusions = [VICTIM_EXCLUSIONS[name] for name in self.policy.victim_exclusions]
        self._landing_exclusions = (  # the other exclusions, when the policy waits for chunks in flight to land
            [VICTIM_EXCLUSIONS[name] for name in self.policy.victim_exclusions if name != CHUNK_IN_FLIGHT]
            if self.policy.no_eligible_victim == WAIT_FOR_CHUNK_IN_FLIGHT
            and CHUNK_IN_FLIGHT in self.policy.victim_exclusions
            else None
        )
        queues = {
            "waiting": self.waiting,
            "resident": self.resident,
            "suspended": self.suspended,
            "paused": self.paused,
        }
        self._containers = {s.name: queues.get(s.container) for s in spec.states}
        self._admission_queues = [(event, self._queue_of(event)) for event in self.policy.admission_classes]
        self._arrivals = itertools.count()
        self._admissions = itertools.count()
        self._auto_ids = itertools.count()
        self._idle = SchedulingPass(config, None)  # the pass that events between passes fire in
        self.last_pass: SchedulingPass | None = None
        # The output of the last pass while no transition has fired since it was planned (`_move` clears it): its
        # decode list is then still active as planned, and `complete_step` lands it without a check per request.
        self._planned: SchedulerOutput | None = None
        # The run of decode-only passes the next pass may repeat (`DecodeRun`; `_move` ends it), and the run the
        # last pass repeated, which `complete_step` carries on when that pass lands undisturbed.
        self._decode_run: DecodeRun | None = None
        self._repeated: DecodeRun | None = None
        self._idle_iterations = 0
        self._last_figures: tuple[SchedulerOutput, dict[str, Any]] | None = None  # of the last iteration
        self._last_stats: IterationStats | None = None  # built from them by the first `stats()` call since

    def _enter_pipeline(self, request_ids: Iterable[Hashable], blocks: Mapping[Hashable, int]) -> None:
        """The steps of `request_ids` enter the pipeline, with `blocks` (what a request allocated for its step in the
        pass): each is in `in_flight`, and its request says so (`step_in_flight`, which the promotion gate reads)."""
        entering = {**dict.fromkeys(request_ids, 0), **blocks}
        self.in_flight.update(entering)
        for request_id in entering:
            request = self.requests.get(request_id)
            if request is not None:
                request.step_in_flight = True

    def _leave_pipeline(self, request_id: Hashable) -> bool:
        """The step of `request_id` lands (its last stage ran): True when it was in the pipeline."""
        if self.in_flight.pop(request_id, None) is None:
            return False
        request = self.requests.get(request_id)
        if request is not None:
            request.step_in_flight = False
        return True

    def not_ready(self) -> Collection[Hashable]:
        """Ids of the resident requests this pass may not schedule: those whose step of an earlier pass is still in
        the pipeline (`in_flight`) and those whose resume copy is still in flight (the forward would read KV not
        written yet). Empty, and built from nothing, in the steady state."""
        copies = self.pool.in_flight
        copying = [p.request_id for p in copies.values() if p.direction != TO_HOST] if copies else None
        if not copying:
            return self.in_flight
        return {*self.in_flight, *copying}

    def head_of_pass(self, pass_: SchedulingPass) -> Request | None:
        """The request `pass_` serves first (SPEC.md 7.2: decode steps before prompt and replay chunks, each in
        arrival order, requests not ready skipped), found once per pass: at the first question, before any computing
        request of the pass changed state."""
        if not pass_.head_known:
            not_ready = self.not_ready()
            ready = [r for r in self.resident if r.state in self._computing and r.request_id not in not_ready]
            pass_.head = min(ready, key=lambda r: r.is_prefilling, default=None)  # stable: the first by arrival
            pass_.head_known = True
        return pass_.head

    def victim_movable(self, candidate: Request, pass_: SchedulingPass) -> bool:
        """The pass can move `candidate` off the GPU if it takes it as a victim (the policy's `cannot_be_moved`):
        recompute-pause is enabled, or `suspend` fires on it and the suspend rule lets it be suspended now."""
        if self.config.enable_recompute_pause:
            return True
        return self._suspension_frees(candidate) and self.suspend_fires(candidate, pass_)

    def suspend_fires(self, request: Request, pass_: SchedulingPass | None = None) -> bool:
        """`suspend` has an edge from `request`'s state and a guard of it holds in `pass_` (between passes: None);
        nothing fires."""
        return "suspend" in self.lifecycle.allowed_events(request.state) and self.lifecycle.can_fire(
            request, "suspend", self._view(self._idle if pass_ is None else pass_)
        )

    def _suspension_frees(self, victim: Request) -> bool:
        """The policy's suspend rule lets `victim` be suspended now (`host_takes_every_held_block`: a host tier can
        take every block suspended requests hold on the GPU, the victim's included; `always`: whatever it frees)."""
        if self.policy.suspend_rule != HOST_TAKES_EVERY_HELD_BLOCK:
            return True
        pool = self.pool
        return pool.has_host_tier and pool.host_free_blocks - pool.gpu_held_blocks >= victim.num_gpu_blocks

    def _queue_of(self, event: str) -> list[Request]:
        """The queue of the one state the admission class `event` leaves."""
        sources = {t.source for t in self.spec.event_by_name[event].transitions}
        if len(sources) != 1:
            raise KVStateError(f"{self.spec.source}: admission class {event!r} must leave exactly one state")
        (source,) = sources
        queue = self._containers[source]
        if queue is None:
            raise KVStateError(
                f"{self.spec.source}: admission class {event!r} leaves state {source!r}, which is kept in no queue; "
                "give that state a container (waiting, resident, suspended or paused)"
            )
        stays = sorted(t.dest for t in self.spec.event_by_name[event].transitions if self._containers[t.dest] is queue)
        if stays:
            raise KVStateError(
                f"{self.spec.source}: admission class {event!r} takes {source!r} to {', '.join(map(repr, stays))}, "
                f"kept in the same queue; an admitted request must leave its queue: give {stays[0]!r} another container"
            )
        return queue

    def _fire(self, request: Request, event: str, pass_: SchedulingPass) -> Transition:
        """Fire `event` on `request` (`_try_fire`); raises `GuardRejected` (nothing changed) when no guard holds."""
        transition = self._try_fire(request, event, pass_)
        if transition is None:
            raise self.lifecycle.rejected(request, event)
        return transition

    def _try_fire(self, request: Request, event: str, pass_: SchedulingPass) -> Transition | None:
        """Fire `event` on `request` in `pass_` (`_idle` between passes) if one of its guards holds, each guard
        evaluated once on a `PassView` of that pass; then run the edge's effect in it, move the request between the
        containers, record the transition (`fired`) and tell `on_transition`. None (nothing changed) when no guard
        holds. A transition happens whole or not at all: every effect checks what can fail before it changes
        anything, so an effect that raises leaves the request in its old state and nothing else changed."""
        before, figures = request.state, self.tally.before(request)
        transition = self.lifecycle.try_fire(request, event, self._view(pass_))
        if transition is None:
            return None
        if transition.effect is not None:
            try:
                getattr(self._effects_in(pass_), transition.effect)(request, transition)
            except BaseException as err:
                setattr(request, STATE_ATTRIBUTE, before)  # the effect refused before changing anything: undo the move
                if isinstance(err, TierFull) and err.edge is None:
                    err.edge = transition  # the edge whose guard let the effect ask for blocks the tier lacks
                    err.request_id = request.request_id
                raise
        self._move(request, before, transition.dest, figures)
        if self.fired is not None:
            self.fired.append(self.snapshot(request, transition))
        if self.on_transition is not None:
            self.on_transition(request, transition)
        return transition

    def _effects_in(self, pass_: SchedulingPass) -> SchedulerEffects:
        """The effect hooks of a transition fired in `pass_`."""
        return SchedulerEffects(self, pass_)

    def _view(self, pass_: SchedulingPass) -> PassView:
        """What the guards read for one decision: the pool's figures and those of `pass_`."""
        return pass_.view(self.pool, self.config)

    def snapshot(self, request: Request, transition: Transition) -> FiredTransition:
        """`transition`, just taken by `request`, with the figures its trace line records, read now."""
        pool = self.pool
        gpu, host = pool.gpu, pool.host
        return FiredTransition(
            self.iteration,
            request,
            transition,
            request.num_gpu_blocks,
            request.num_host_blocks,
            gpu.num_free,
            host.num_free,
            len(gpu.fenced),
            len(host.fenced),
            gpu.capacity,
            host.capacity,
            len(request.generated),
            request.num_computed_tokens,
            request.done_reason if transition.dest in self._terminal else None,
        )

    def take_fired(self) -> list[FiredTransition]:
        """The transitions recorded since the last call (`record_transitions=True`), oldest first; clears them."""
        fired = self.fired
        if fired is None:
            raise KVStateError("this scheduler records no transitions; build it with record_transitions=True")
        self.fired = []
        return fired

    @property
    def active_per_state(self) -> dict[str, int]:
        """Active requests per non-terminal state (the tally's counts, kept on each transition)."""
        return self.tally.counts

    @property
    def peak_per_state(self) -> dict[str, int]:
        """The most requests each state has held at once, taken on every transition (`StateTally.peaks`), so a
        request that entered a state and left it within one step counts; the terminal state's peak is its count."""
        return {**self.tally.peaks, self._ended: len(self.finished)}

    def _move(self, request: Request, old: str, new: str, figures: Figures | None) -> None:
        """Keep the per-state containers and the tally in step with a transition (`figures`: the request's tallied
        figures before it, `StateTally.before`)."""
        self.tally.moved(request, old, figures)
        self._planned = self._decode_run = None
        if old == new:
            return
        source, target = self._containers[old], self._containers[new]
        if source is not target:
            if source is not None:
                remove_ordered(source, request, BY_ARRIVAL)
            if target is not None:
                insert_ordered(target, request, BY_ARRIVAL)
        if old in self._computing and new not in self._computing:
            remove_ordered(self.admitted, request, BY_ADMISSION)
        if new == self._ended:
            del self.requests[request.request_id]
            self.finished[request.request_id] = request

    def _end_copy(self, plan: MigrationPlan) -> None:
        """`plan` completed, failed or was withdrawn: its fences end, and its request has no copy in flight (the
        guards let a request have one at most)."""
        self.pool.complete(plan)
        request = self.requests.get(plan.request_id) or self.finished.get(plan.request_id)
        if request is not None:
            request.copy_in_flight = False

    def _allocate_chunk_blocks(self, request: Request, blocks: int, pass_: SchedulingPass) -> None:
        """Give `request` the `blocks` more GPU blocks its step of this pass writes (RES-STATE: its count follows)."""
        self.pool.allocate(request.request_id, blocks)
        request.num_gpu_blocks += blocks
        pass_.chunk_blocks[request.request_id] = blocks

    def _add_scheduled(self, request: Request, tokens: int, pass_: SchedulingPass) -> None:
        out = pass_.output
        lists = self._chunk_list[request.state]
        getattr(out, lists["prefill" if request.is_prefilling else "decode"]).append(request)
        out.chunk_tokens[request.request_id] = tokens
        pass_.charge(tokens, 1)

    def get(self, request_id: Hashable) -> Request:
        """The active or finished request with this id."""
        found = self.requests.get(request_id) or self.finished.get(request_id)
        if found is None:
            raise UnknownRequestId(f"no request with id {shown(request_id)}; submit it first")
        return found
