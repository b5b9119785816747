"""The scheduler: one `schedule()` call per iteration decides who computes, who moves and who is preempted; and
`Step`, the one protocol every executor drives it by.

Invariants kept (ids from the spec; the policy's rules are the spec's `[policy]`, given meaning in
`kvstate.policy`, which the model checker's step simulation holds every pass against):
* every state change is fired through the lifecycle (by default the `transitions` machine built from the spec;
  `SchedulerConfig(lifecycle="compiled")` takes the compiled table), each guard evaluated once per decision on
  a `PassView` of the pass under way (`SchedulingPass`); the scheduler then runs the effect of the edge taken
  (`_Effects`) itself, so nothing calls back into it; states are found by role (`kvstate.roles`), never by name;
* victims are taken tail-first by admission order among requests not yet scheduled in the pass, never twice
  in a pass, never one about to produce its final token, never one awaiting consensus, never one past the
  preemption cap (VICTIM-TAIL, VICTIM-ONCE, VICTIM-NOT-FINAL, PP-HOLD);
* a victim is suspended when the host tier has room, else — promoting requests suspended earlier in the same pass,
  most recent first, while their KV is worth less than the victim's (PROMOTE-GATE) — suspended after promotion,
  else recompute-paused;
* a requester that counts on room on its way (fenced blocks, blocks awaiting consensus) reserves it, so the next
  requester takes a victim instead of counting the same blocks (WORK-CONSERVE);
* admissions follow the policy's classes in order, each by arrival, stopping at the first misfit (ADMIT-ORDER);
  no new request in a pass that chose a victim or left a requester waiting (ADMIT-HOLD); output lists are disjoint
  (OUT-DISJOINT); requests' block counts mirror the pool (RES-STATE), checked by `check_invariants`;
* the per-state counts and the token and block sums the statistics report (`StateTally`) are kept on each
  transition and equal a recount of the requests (STATS-COUNT), checked by `check_invariants`.
Steady-state decode costs O(1) per running request: no lifecycle event fires unless a state changes, and a step
walks only the requests it schedules (the statistics of those it leaves alone are kept, not recounted); a pass that
follows a decode-only pass of every resident request, with no transition since, repeats its decode list without a
walk (`DecodeRun`), exactly as the walk would list it.

One scheduler step, written once: schedule -> issue copies -> compute -> complete. Every executor (the slot-level
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

import bisect
import itertools
import operator
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from kvstate.config import RequestRejected, SchedulerConfig, normalize_stop_token_ids
from kvstate.errors import InvariantViolation, KVStateError, PoolError
from kvstate.lifecycle import STATE_ATTRIBUTE, make_lifecycle
from kvstate.output import SCHEDULED_LISTS, FailedMigration, SchedulerOutput, check_output
from kvstate.policy import PassRecord, Promotion, Victim, Wait
from kvstate.pool import TO_HOST, MigrationPlan, TieredBlockPool, ceil_div
from kvstate.request import Request, append_tokens, new_request
from kvstate.roles import ACTIVE, DROPPED, ENDED, OFFLOADED, PENDING_RESET, RECOMPUTING
from kvstate.semantics import PassView, first_chunk_blocks, first_chunk_tokens, promotion_saves_kv
from kvstate.spec import Spec, Transition
from kvstate.stats import IterationStats
from kvstate.trace import FiredTransition
from kvstate.untrusted import shown


class SchedulerStalled(KVStateError, RuntimeError):
    """No request made progress for `no_progress_limit` iterations; the message names requests and pool state."""


class UnknownRequestId(KVStateError, KeyError, ValueError):
    """An API call named a request id the scheduler does not know or has already finished."""

    def __str__(self) -> str:
        return str(self.args[0])


_by_arrival: Callable[[Request], int] = operator.attrgetter("arrival")  # the order of the state containers
_by_admission: Callable[[Request], int] = operator.attrgetter("admission")  # the order of `admitted` (VICTIM-TAIL)


def _remove_ordered(items: list[Request], request: Request, key: Callable[[Request], int]) -> None:
    """Remove `request` from `items`, which is in increasing order of `key` (each request's own number: its arrival
    or admission), by bisection: O(log n) key reads and one move, where `list.remove` compares every request before
    it (a rich comparison per request: about 15 µs at the end of 1,024)."""
    index = bisect.bisect_left(items, key(request), key=key)
    if index == len(items) or items[index] is not request:
        raise KVStateError(
            f"request {request.request_id!r} is not where its order puts it in its container; the scheduler's "
            "containers were changed from outside the scheduler"
        )
    del items[index]


VICTIM_EXCLUSIONS: Mapping[str, Callable[[Scheduler, Request, SchedulingPass], bool]] = {
    "the_requester": lambda s, candidate, pass_: candidate is pass_.requester,
    "scheduled_this_pass": lambda s, candidate, pass_: candidate.request_id in pass_.output.chunk_tokens,
    "waiting_this_pass": lambda s, candidate, pass_: id(candidate) in pass_.waiting,
    "victim_this_pass": lambda s, candidate, pass_: id(candidate) in pass_.victims,
    "about_to_finish": lambda s, candidate, pass_: candidate.about_to_finish,
    "preemption_cap_reached": lambda s, candidate, pass_: s._capped(candidate),
    "chunk_in_flight": lambda s, candidate, pass_: candidate.request_id in s.in_flight and candidate.is_prefilling,
    "ahead_of_requester": lambda s, candidate, pass_: (
        pass_.requester is not None
        and (candidate.is_prefilling, candidate.arrival) < (pass_.requester.is_prefilling, pass_.requester.arrival)
    ),  # ahead in the spec's serve order (SPEC.md 7.2); declared by third-party policies (kvstate.declared)
}  # the scheduler's reading of the spec's `victim_exclusions` (their meaning: kvstate.policy.VOCABULARY)


class SchedulingPass:
    """One scheduling pass: its output, budgets, victims and reservations, and what its guards read of it.

    The lifecycle's guards get a `PassView` of it for each decision (`Scheduler._view`): the pool figures plus
    `number` (None for the pass used between passes) and the worth a promotion may still throw away.
    Invariants: `tokens_left` and `slots_left` never go negative; `pending_free` is the room on its way that no
    requester of this pass has reserved yet; `record` lists victims, promotions and waits in decision order;
    every victim but `unmoved_victims` of them left its state when it was taken (suspended or paused), so a walk
    over the resident requests that skips those not active needs the victims only while some are unmoved.
    """

    def __init__(self, config: SchedulerConfig, number: int | None) -> None:
        self.number = number
        self.output: SchedulerOutput = SchedulerOutput()
        self.tokens_left = config.max_num_tokens
        self.slots_left = config.max_batch_size
        self.victims: set[int] = set()
        self.unmoved_victims = 0  # victims no event moved (suspend refused, recompute-pause disabled)
        self.waiting: set[int] = set()
        self.suspended: list[Request] = []  # suspended in this pass and not promoted, in suspension order
        self.pending_free = 0
        self.preempted = False
        self.waited = False
        self.promotion_worth = 0
        self.requester: Request | None = None  # the request the pass is making room for
        self.chunk_blocks: dict[Hashable, int] = {}  # blocks allocated for a resident request's chunk of this pass
        self.record = PassRecord()

    def charge(self, tokens: int, slots: int) -> None:
        """Spend `tokens` of the token budget and `slots` batch slots on requests scheduled in this pass."""
        self.tokens_left -= tokens
        self.slots_left -= slots


class Holding(Protocol):
    """What the tally reads of a request (`kvstate.Request` is one)."""

    state: str
    num_computed_tokens: int
    num_prefill_tokens: int
    num_gpu_blocks: int


Figures = tuple[int, int, int]  # (num_computed_tokens, num_prefill_tokens, num_gpu_blocks) of one request


def _stats_of(out: SchedulerOutput, figures: dict[str, Any], block_bytes: int) -> IterationStats:
    """The `IterationStats` of `out`'s iteration: the `figures` the scheduler took when it completed
    (`Scheduler._figures_now`), and what `out` itself says."""
    blocks = sum(p.num_blocks for p in out.migrations)
    return IterationStats(
        **figures,
        suspended_this_iteration=len(out.suspended),
        recompute_paused_this_iteration=len(out.recompute_paused),
        preemptions=len(out.suspended) + len(out.recompute_paused),
        scheduled_tokens=out.num_tokens,
        blocks_migrated=blocks,
        bytes_migrated=blocks * block_bytes,
    )


def figures(request: Holding) -> Figures:
    """What `StateTally` sums of `request`."""
    return request.num_computed_tokens, request.num_prefill_tokens, request.num_gpu_blocks


class StateTally:
    """Per-state request counts, and token and block sums of the requests that hold still, kept on every transition
    so that a step's statistics cost O(states), never O(requests held) (STATS-COUNT).

    Invariants kept, checked against `recount` by `Scheduler.check_invariants`:
    * `counts[s]` is the number of active (unfinished) requests in state s, for every non-terminal state s;
    * for every `held` state s (a non-terminal state whose requests do not compute: the spec's `computing` flag
      says which, never a name), `kv_tokens[s]`, `replay_tokens[s]` and `gpu_blocks[s]` are the sums of
      `num_computed_tokens`, `num_prefill_tokens` (`len(prefill_tokens)`) and `num_gpu_blocks` over the requests in
      s. A computing request's figures change on every step, so computing states keep a count only.

    The owner calls `added` for a new request, `moved` after every transition (with the request's figures from
    before it: the edge's effect changes them) and `changed` when a held request's figures change without one (a
    pipelined step that lands after its request was preempted); nothing else changes a held request's figures.
    """

    __slots__ = ("counts", "gpu_blocks", "held", "kv_tokens", "replay_tokens")

    def __init__(self, states: Iterable[str], held: Iterable[str]) -> None:
        self.counts: dict[str, int] = dict.fromkeys(states, 0)
        self.held = frozenset(held)
        if not self.held <= set(self.counts):
            raise ValueError(f"held states {sorted(self.held - set(self.counts))} are not among the tallied states")
        self.kv_tokens: dict[str, int] = dict.fromkeys(self.held, 0)
        self.replay_tokens: dict[str, int] = dict.fromkeys(self.held, 0)
        self.gpu_blocks: dict[str, int] = dict.fromkeys(self.held, 0)

    def before(self, request: Holding) -> Figures | None:
        """What `moved` needs of `request` before a transition: its figures when its state is held, else None."""
        return figures(request) if request.state in self.held else None

    def added(self, request: Holding) -> None:
        self.counts[request.state] += 1
        self._add(request.state, figures(request), 1)

    def moved(self, request: Holding, old: str, before: Figures | None) -> None:
        """`request` left `old` (its figures were `before`) for its present state (terminal: no longer counted)."""
        self.counts[old] -= 1
        if before is not None:
            self._add(old, before, -1)
        if request.state in self.counts:
            self.counts[request.state] += 1
            self._add(request.state, figures(request), 1)

    def changed(self, request: Holding, before: Figures) -> None:
        """A held `request`'s figures changed from `before` without a transition."""
        self._add(request.state, before, -1)
        self._add(request.state, figures(request), 1)

    def _add(self, state: str, of: Figures, sign: int) -> None:
        if state in self.held:
            computed, replay, blocks = of
            self.kv_tokens[state] += sign * computed
            self.replay_tokens[state] += sign * replay
            self.gpu_blocks[state] += sign * blocks

    def recount(self, requests: Iterable[Holding]) -> StateTally:
        """A tally of the same states built from scratch over `requests` (the active ones)."""
        fresh = StateTally(self.counts, self.held)
        for request in requests:
            fresh.added(request)
        return fresh

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {
            "counts": dict(self.counts),
            "kv_tokens": dict(self.kv_tokens),
            "replay_tokens": dict(self.replay_tokens),
            "gpu_blocks": dict(self.gpu_blocks),
        }


class DecodeRun:
    """A run of decode-only passes: the last pass's decode list held every resident request, and no transition has
    fired since (`Scheduler._move` ends the run), so the next pass's walk would list the same requests, one token
    each, in the same order; `Scheduler._repeat_decodes` repeats it without the walk.

    Invariants kept: `requests` is the decode list of the pass the run began with, in arrival order, and every one
    of them is active and done with its prefill; `phases[k]` lists, in that order, the requests whose step in the
    k-th repeat (modulo the block size) opens a new block, which is so while no request holds a block beyond the
    one its next token fills; `passes` counts the repeats so far, `output` is the last one's (None before)."""

    __slots__ = ("chunk_tokens", "output", "passes", "phases", "requests")

    def __init__(self, requests: list[Request], phases: list[list[Request]]) -> None:
        self.requests = requests
        self.chunk_tokens = dict.fromkeys((r.request_id for r in requests), 1)
        self.phases = phases
        self.passes = 0
        self.output: SchedulerOutput | None = None

    @classmethod
    def after(cls, requests: list[Request], block_size: int) -> DecodeRun | None:
        """The run that follows a pass whose decode list, `requests`, is about to land (each request's computed
        tokens one short of what the next pass sees); None when a request holds a spare block, so its openings
        do not follow the block size's period."""
        phases: list[list[Request]] = [[] for _ in range(block_size)]
        for request in requests:
            room = request.num_gpu_blocks * block_size - request.num_computed_tokens - 1  # free slots once landed
            if not 0 <= room < block_size:
                return None
            phases[room].append(request)
        return cls(requests, phases)

    def opening(self, block_size: int) -> list[Request]:
        """The requests whose step in the next repeat opens a new block."""
        return self.phases[self.passes % block_size]


class Scheduler:
    """Continuous batching over a `TieredBlockPool` with suspend and recompute-pause preemption."""

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
        self.config = config
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
            [VICTIM_EXCLUSIONS[name] for name in self.policy.victim_exclusions if name != "chunk_in_flight"]
            if self.policy.no_eligible_victim == "wait_for_chunk_in_flight"
            and "chunk_in_flight" in self.policy.victim_exclusions
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
            raise RequestRejected(f"request id {shown(request_id)} is already in use; pick a fresh id or pass None")
        request = new_request(
            request_id,
            prompt,
            max_new_tokens,
            stop_token_ids=stop,
            arrival=next(self._arrivals),
            block_size=self.config.block_size,
        )
        self.lifecycle.start(request)
        self.requests[request_id] = request
        self.tally.added(request)
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
            raise UnknownRequestId(f"no request with id {shown(request_id)}; submit it first")
        return found

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def idle_iterations(self) -> int:
        """Passes since the last one that made progress (what the no-progress detector, A4, reads)."""
        return self._idle_iterations

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
            raise UnknownRequestId(
                f"cannot {event} request {shown(request_id)}: it {where}; only active requests can be ended"
            )
        self._fire(request, event, self._idle)
        return request

    # -------------------------------------------------------------------------------------------- firing
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
            except BaseException:
                setattr(request, STATE_ATTRIBUTE, before)  # the effect refused before changing anything: undo the move
                raise
        self._move(request, before, transition.dest, figures)
        if self.fired is not None:
            self.fired.append(self.snapshot(request, transition))
        if self.on_transition is not None:
            self.on_transition(request, transition)
        return transition

    def _effects_in(self, pass_: SchedulingPass) -> _Effects:
        """The effect hooks of a transition fired in `pass_`."""
        return _Effects(self, pass_)

    def _view(self, pass_: SchedulingPass) -> PassView:
        """What the guards read for one decision: the pool's figures and those of `pass_`."""
        pool, config = self.pool, self.config
        return PassView(
            pool.gpu_free_blocks,
            pool.host_free_blocks,
            pool.has_host_tier,
            pool.pipeline_stages,
            config.block_size,
            min(config.prefill_chunk_size, pass_.tokens_left),
            pass_.number,
            pass_.promotion_worth,
        )

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
                _remove_ordered(source, request, _by_arrival)
            if target is not None:
                bisect.insort(target, request, key=_by_arrival)
        if old in self._computing and new not in self._computing:
            _remove_ordered(self.admitted, request, _by_admission)
        if new == self._ended:
            del self.requests[request.request_id]
            self.finished[request.request_id] = request

    # -------------------------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one iteration. Raises `SchedulerStalled` after `no_progress_limit` passes without progress."""
        self._watch_progress()
        self.iteration += 1
        pass_ = SchedulingPass(self.config, self.iteration)
        pass_.pending_free = self._room_on_its_way()
        pass_.slots_left = self.slots_per_pass()
        run, self._decode_run, self._repeated = self._decode_run, None, None
        try:
            continuing = [] if run is not None and self._repeat_decodes(run, pass_) else self._schedule_decoding(pass_)
            for request in continuing:  # then prompt and replay chunks, in arrival order
                if pass_.slots_left == 0 or pass_.tokens_left == 0:
                    break
                if id(request) not in pass_.victims and request.state in self._computing:
                    self._schedule_resident(request, pass_)
            if self.config.capacity_policy == "max_utilization":
                self._admit(pass_)
            else:
                self._admit_class("admit", self.waiting, pass_)
        finally:
            self.last_pass = pass_
        out = pass_.output
        out.num_fitting_requests = out.num_scheduled
        self._planned = out
        if self.micro_batches > 1:
            self.in_flight.update(dict.fromkeys(out.chunk_tokens, 0))
            self.in_flight.update(pass_.chunk_blocks)
        return out

    def track_in_flight(self, micro_batches: int) -> None:
        """Let `micro_batches` outputs be in flight at once (pipeline parallelism): from now on a request scheduled
        by a pass stays in `in_flight` until `complete_step` lands that pass's output, later passes skip it, and a
        decoding victim among them keeps the token its step lands (`_land_preempted`); each pass takes at most its
        share of the active requests
        (`slots_per_pass`), so the micro-batches balance. Without this call every output is completed before the
        next pass (one micro-batch in flight) and `in_flight` stays empty."""
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.micro_batches = micro_batches

    def must_land(self, outputs_in_flight: int) -> bool:
        """The oldest of `outputs_in_flight` outputs must land before the next pass: `micro_batches` are in flight,
        or every unfinished request is (the pass would schedule nothing)."""
        return outputs_in_flight > 0 and (
            outputs_in_flight >= self.micro_batches or len(self.in_flight) >= len(self.requests)
        )

    def slots_per_pass(self) -> int:
        """Batch slots of the next pass: `max_batch_size`, and with several micro-batches in flight at most an
        equal share of the active requests (rounded up)."""
        if self.micro_batches == 1:
            return self.config.max_batch_size
        return min(self.config.max_batch_size, max(1, ceil_div(len(self.requests), self.micro_batches)))

    def _room_on_its_way(self) -> int:
        """GPU blocks that free without further preemption: fenced by copies, or held awaiting consensus."""
        return len(self.pool.gpu.fenced) + self.tally.gpu_blocks[self._pending_reset]

    def _schedule_decoding(self, pass_: SchedulingPass) -> list[Request]:
        """Decode steps of the resident requests in arrival order, in one walk that also returns the resident
        requests with prompt or replay tokens left (scheduled next, by the caller, in arrival order; once the budget
        is spent the walk stops, and so would the caller). A request whose step is in flight is skipped. The steady
        state — an active request whose last block still has room — costs a few attribute reads: no lifecycle
        event, no pool call, no Python call; a step that opens a new block takes a free one directly, and only a
        step that finds none goes through `_schedule_resident` (which may preempt)."""
        out, block_size, active, pool = pass_.output, self.config.block_size, self._active, self.pool
        decode_list = getattr(out, self._decode_list)
        chunk_tokens, victims = out.chunk_tokens, pass_.victims  # the pass's own containers, filled in place
        in_flight, continuing = self.not_ready(), []
        decodes = 0  # decode steps taken by the fast path below and not yet charged to the pass's budgets
        opening: list[Request] = []  # decode steps listed that open a new block, not yet given it (`_open_blocks`)
        room = min(pass_.slots_left, pass_.tokens_left)  # decode steps the budgets allow (each takes 1 slot, 1 token)
        unmoved_victims = pass_.unmoved_victims  # victims that may still be active (the others left that state)
        for request in tuple(self.resident):  # a copy: a victim taken on the way leaves `resident`
            if in_flight and request.request_id in in_flight:
                continue  # its step is still in the pipeline (a request is in one micro-batch in flight at most), or
                # its resume copy is: it computes once its KV is back
            computed = request.num_computed_tokens
            if computed < request.num_prefill_tokens:
                continuing.append(request)
                continue
            if decodes == room:
                break
            if request.state != active or (unmoved_victims and id(request) in victims):
                continue
            if computed == request.num_gpu_blocks * block_size:  # its step opens a new block
                if not pool.can_allocate(len(opening) + 1):  # none is left: room is made, or waited for, by the
                    self._open_blocks(opening, pass_)  # general path, once the pass's blocks and budgets are exact
                    opening = []
                    pass_.charge(decodes, decodes)
                    decodes = 0
                    self._schedule_resident(request, pass_)
                    room = min(pass_.slots_left, pass_.tokens_left)
                    unmoved_victims = pass_.unmoved_victims
                    continue
                opening.append(request)
            decode_list.append(request)
            chunk_tokens[request.request_id] = 1
            decodes += 1
        self._open_blocks(opening, pass_)
        pass_.charge(decodes, decodes)
        return continuing

    def _open_blocks(self, opening: list[Request], pass_: SchedulingPass) -> None:
        """Give each decode step of `opening` the new block it writes, in one pool call (the blocks, and their
        order, `_allocate_chunk_blocks(request, 1, pass_)` for each in turn would give)."""
        if not opening:
            return
        self.pool.allocate_one_each([request.request_id for request in opening])
        chunk_blocks = pass_.chunk_blocks
        for request in opening:
            request.num_gpu_blocks += 1
            chunk_blocks[request.request_id] = 1

    def _repeat_decodes(self, run: DecodeRun, pass_: SchedulingPass) -> bool:
        """List `run`'s decode steps in `pass_`, as `_schedule_decoding`'s walk would (`DecodeRun`), giving the
        steps that open a block their blocks; False (nothing changed) when the walk must decide: the budgets (a
        share of the requests, once several micro-batches may be in flight) or the free blocks no longer take every
        step."""
        requests = run.requests
        opening = run.opening(self.config.block_size)
        if len(requests) > min(pass_.slots_left, pass_.tokens_left) or not self.pool.can_allocate(len(opening)):
            return False
        out = pass_.output
        getattr(out, self._decode_list).extend(requests)
        out.chunk_tokens.update(run.chunk_tokens)
        self._open_blocks(opening, pass_)
        pass_.charge(len(requests), len(requests))
        run.passes += 1
        run.output, self._repeated = out, run
        return True

    def _next_run(self, output: SchedulerOutput) -> DecodeRun | None:
        """The run of decode-only passes that `output`, planned undisturbed and about to land, begins or carries
        on: its decode list holds every resident request, nothing else is scheduled or moved, and no step is in
        flight (with several micro-batches, `output`'s own steps are). A copy in flight changes no decode list: a
        request whose resume copy is in flight is resident but not listed, and one that completes or fails late
        frees blocks (the next repeat checks the free blocks) or fires a transition (which ends the run). None
        otherwise."""
        if self.in_flight:
            return None
        decodes = getattr(output, self._decode_list)
        if not decodes or len(decodes) != len(self.resident) or len(output.chunk_tokens) != len(decodes):
            return None  # a resident request was skipped, or a prompt or replay chunk was scheduled (admitted)
        if output.resumed or output.suspended or output.recompute_paused or output.migrations:
            return None
        repeated = self._repeated
        if repeated is not None and repeated.output is output:
            return repeated
        return DecodeRun.after(list(decodes), self.config.block_size)

    def not_ready(self) -> Collection[Hashable]:
        """Ids of the resident requests this pass may not schedule: those whose step of an earlier pass is still in
        the pipeline (`in_flight`) and those whose resume copy is still in flight (the forward would read KV not
        written yet). Empty, and built from nothing, in the steady state."""
        copying = [p.request_id for p in self.pool.in_flight.values() if p.direction != TO_HOST]
        if not copying:
            return self.in_flight
        return {*self.in_flight, *copying}

    def _schedule_resident(self, request: Request, pass_: SchedulingPass) -> None:
        tokens = (
            1
            if not request.is_prefilling
            else min(self.config.prefill_chunk_size, request.next_step_tokens, pass_.tokens_left)
        )
        need = max(0, self.pool.blocks_for_tokens(request.num_computed_tokens + tokens) - request.num_gpu_blocks)
        if need > self.pool.gpu_free_blocks:
            if self.config.capacity_policy == "guaranteed_no_evict":
                return
            if not self._make_room(request, need, pass_):
                return  # preempted itself, or waits for the room on its way
        if need:
            self._allocate_chunk_blocks(request, need, pass_)
        self._add_scheduled(request, tokens, pass_)

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

    # ------------------------------------------------------------------------------------------ preemption
    def _make_room(self, request: Request, need: int, pass_: SchedulingPass) -> bool:
        """Free `need` GPU blocks for `request`: True when they are free now; False when it preempted itself or
        waits for room on its way (which it then reserves: WORK-CONSERVE)."""
        while self.pool.gpu_free_blocks < need:
            short = need - self.pool.gpu_free_blocks
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
                self._preempt(request, pass_)
                if request.state in self._computing:  # it could not even evict itself: it waits for nothing
                    self._wait(request, 0, pass_)
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
        cap = self.config.max_preemptions_per_request
        return cap is not None and request.num_suspensions + request.num_recompute_pauses >= cap

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
            and VICTIM_EXCLUSIONS["chunk_in_flight"](self, candidate, pass_)
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
        """Suspend the victim if the host tier takes it (promoting if worth it), else recompute-pause it, to make
        room for `pass_.requester` (set before: the victim itself when it evicts itself).
        Blocks that free only after a copy or a consensus count as `pending_free` for this pass."""
        requester = pass_.requester
        if requester is None:
            raise KVStateError("a victim is chosen only for a requester: set pass_.requester before preempting")
        pass_.victims.add(id(victim))
        held = victim.num_gpu_blocks
        # without a host tier nothing is ever suspended (NO-HOST-NO-SUSPEND): neither suspend nor a promotion that
        # would make host room for it is asked for; with one, suspend's guard decides
        suspendable = self.pool.has_host_tier and "suspend" in self.lifecycle.allowed_events(victim.state)
        if suspendable and (
            self._try_fire(victim, "suspend", pass_)
            or (self._promote_for(victim, pass_) and self._try_fire(victim, "suspend", pass_))
        ):
            pass_.pending_free += held
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

    def _promote_for(self, victim: Request, pass_: SchedulingPass) -> bool:
        """Promote requests suspended earlier in this pass to recompute-pause, most recent first, to make host room
        for `victim`: the shortest such group that makes room, only while its KV is worth less than the victim's
        (the spec's promotion gate decides each one; the group is checked against the same rule first), and only
        when `suspend` would then fire on the victim (its guard holds on the pool with the group's host blocks
        free: not while a copy of the victim is in flight, SPEC.md 7.3): a promotion is never wasted. Only asked
        where a host tier exists (`_preempt`)."""
        if not self.config.enable_recompute_pause or victim.num_gpu_blocks > self.pool.host.capacity:
            return False
        missing = victim.num_gpu_blocks - self.pool.host_free_blocks
        group, freed = [], 0
        for candidate in reversed(pass_.suspended):
            if freed >= missing:
                break
            group.append(candidate)
            freed += candidate.num_host_blocks
        if freed < missing or not promotion_saves_kv(sum(c.kv_tokens for c in group), victim.kv_tokens):
            return False
        room_made = self._view(pass_)._replace(host_free_blocks=self.pool.host_free_blocks + freed)
        if not self.lifecycle.can_fire(victim, "suspend", room_made):
            return False
        pass_.promotion_worth = victim.kv_tokens
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
            pass_.pending_free -= plan.num_blocks

    # ------------------------------------------------------------------------------------------- admission
    def _admit(self, pass_: SchedulingPass) -> None:
        """Readmissions and admissions in the policy's class order, each class in arrival order (ADMIT-ORDER);
        new requests are held back in a pass that chose a victim or left a requester waiting (ADMIT-HOLD)."""
        rules = self.policy.admission_rules
        hold_new = "hold_new_after_preemption_or_wait" in rules and (pass_.preempted or pass_.waited)
        for event, queue in self._admission_queues:
            if event == "admit" and hold_new:
                return
            if not queue:
                continue  # nothing to admit from it, and no misfit to stop at
            if not self._admit_class(event, queue, pass_) and "stop_at_first_misfit" in rules:
                return

    def _admit_class(self, event: str, queue: list[Request], pass_: SchedulingPass) -> bool:
        """Admit from `queue` in arrival order; False when a candidate did not fit (admission stops there). The
        queue is read in place, up to where admission stops (no copy of it: under pressure it holds most requests,
        and a pass usually stops at its head): an admitted request leaves it (`_queue_of`), a skipped one stays."""
        no_victims = "no_readmission_of_victims" in self.policy.admission_rules
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
        if request.state == self._offloaded:  # a resume moves KV back and computes once it is back (the guard
            if not self._try_fire(request, event, pass_):  # refuses while its suspend copy is still in flight)
                return False
            out.resumed.append(request)
            pass_.slots_left -= 1
            return True
        if pass_.tokens_left == 0:
            return False
        if not self._try_fire(request, event, pass_):
            return False
        self._add_scheduled(request, first_chunk_tokens(request, self._view(pass_)), pass_)
        return True

    def _reservable(self, request: Request) -> bool:
        """guaranteed_no_evict: the request's worst case fits beside every resident request's worst case."""
        blocks = self.pool.blocks_for_tokens
        reserved = sum(blocks(len(r.prompt) + r.max_new_tokens) - r.num_gpu_blocks for r in self.resident)
        return blocks(len(request.prompt) + request.max_new_tokens) <= self.pool.gpu_free_blocks - reserved

    # --------------------------------------------------------------------------------------- after compute
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
        is still in the state the plan left it in (listed suspended or resumed in `output`, and the undoing event has
        an edge from its state) and still holds the plan's destinations (`copy_in_use`). Otherwise nothing will read
        what the copy writes, and its failure ends its fences as its completion would."""
        request = self.requests.get(plan.request_id)
        event, listed = self._undo_of(plan, output)
        return (
            request is not None
            and request in listed
            and event in self.lifecycle.allowed_events(request.state)
            and self.copy_in_use(plan)
        )

    def _undo_of(self, plan: MigrationPlan, output: SchedulerOutput) -> tuple[str, list[Request]]:
        """The event that undoes a failed `plan`, and the list of `output` its request joined when it was planned."""
        if plan.direction == TO_HOST:
            return "lose_host_copy", output.suspended
        return "recompute_pause", output.resumed

    def copy_in_use(self, plan: MigrationPlan) -> bool:
        """The request of in-flight `plan` still holds the plan's destination blocks, so it will read what the copy
        writes: a failure of the copy must be undone (`fail_migration`). False once it released them (it ended,
        lost its host copy or was preempted since): its copy's failure ends the fences as a completion does."""
        request = self.requests.get(plan.request_id)
        tier = self.pool.host if plan.direction == TO_HOST else self.pool.gpu
        held = set(tier.held(plan.request_id)) if request is not None else set()
        return bool(held) and all(dst in held for _, dst in plan.pairs)

    def _end_copy(self, plan: MigrationPlan) -> None:
        """`plan` completed, failed or was withdrawn: its fences end, and its request has no copy in flight (the
        guards let a request have one at most)."""
        self.pool.complete(plan)
        request = self.requests.get(plan.request_id) or self.finished.get(plan.request_id)
        if request is not None:
            request.copy_in_flight = False

    def complete_step(self, output: SchedulerOutput, sampled: Mapping[Hashable, int]) -> list[Request]:
        """Apply a forward pass: advance computed tokens, append each produced token (`sampled[id]`),
        fire catch_up and finish. Returns the requests that produced a token, in batch order (`output.scheduled`).

        A request of the active state's decode list (the spec's `chunk_lists`) still active is a decode step (the
        steady state): it was active and done with its prefill when planned, and only leaving the active state
        resets that; so it computes one token, never a replay, and fires no event but finish (`_complete_decodes`).
        Everything else goes through `_complete_chunk`."""
        produced: list[Request] = []
        recomputed, progress = 0, False
        undisturbed, self._planned = output is self._planned, None
        self._decode_run = self._next_run(output) if undisturbed else None  # a finish below ends it (`_move`)
        for name in SCHEDULED_LISTS:  # batch order
            requests = getattr(output, name)
            if name == self._decode_list:
                progress |= self._complete_decodes(requests, output, sampled, produced, undisturbed)
                continue
            for request in requests:
                tokens, advanced = self._complete_chunk(request, output, sampled, produced)
                recomputed += tokens
                progress |= advanced
        if self.in_flight:
            for request_id in output.chunk_tokens:
                self.in_flight.pop(request_id, None)
        self._last_figures = output, self._figures_now(recomputed, len(produced), iteration=self.iteration)
        self._last_stats = None  # built from those figures by the next `stats()` call
        if progress:
            self._idle_iterations = 0
        return produced

    def _complete_decodes(
        self,
        requests: list[Request],
        output: SchedulerOutput,
        sampled: Mapping[Hashable, int],
        produced: list[Request],
        undisturbed: bool,
    ) -> bool:
        """Apply the decode list (`complete_step`'s docstring): one token per request still active, finish when it is
        final; the rest through `_complete_chunk`. `undisturbed`: no transition was fired since `output` was planned,
        so every request of the list is still active. True when a request decoded (progress, A4)."""
        if undisturbed:  # every request of the list is still active (`_planned`): each lands, then finishes fire
            produced += requests
            for request in append_tokens(requests, sampled, computed=1):  # a decode step is progress (A4)
                self._fire(request, "finish", self._idle)
            return bool(requests)
        active, decoded = self._active, False
        for request in requests:
            if request.state != active:
                self._complete_chunk(request, output, sampled, produced)  # preempted or ended since it was planned
                continue
            decoded = True
            request.num_computed_tokens += 1  # what `advance(1, False)` does: a decode step is progress (A4)
            produced.append(request)
            if request.append_token(sampled[request.request_id]):
                self._fire(request, "finish", self._idle)
        return decoded

    def _complete_chunk(
        self, request: Request, output: SchedulerOutput, sampled: Mapping[Hashable, int], produced: list[Request]
    ) -> tuple[int, bool]:
        """Apply one prompt or replay chunk of `request` (appending it to `produced` when it samples), or land the
        step of a request preempted or ended since the output was planned; (replayed tokens, progress)."""
        state = request.state
        if state not in self._computing:
            if self.in_flight.pop(request.request_id, None) is not None and self._land_preempted(
                request, state, sampled
            ):
                produced.append(request)
            return 0, False  # preempted (its token landed above), cancelled or aborted since the output was planned
        tokens = output.chunk_tokens[request.request_id]
        replaying = state == self._recomputing
        progress = request.advance(tokens, replaying)
        if replaying:
            request.num_recomputed_tokens += tokens
        if request.num_computed_tokens >= request.num_prefill_tokens:  # the chunk ends its (re)prefill: a token
            final = request.append_token(sampled[request.request_id])
            produced.append(request)
            if replaying:
                self._fire(request, "catch_up", self._idle)
            if final:
                self._fire(request, "finish", self._idle)
        return (tokens if replaying else 0), progress

    # ------------------------------------------------------------------------------- pipeline, host tier
    def _land_preempted(self, request: Request, state: str, sampled: Mapping[Hashable, int]) -> bool:
        """The decode step a request had in flight when a later pass preempted it leaves the last stage; True when
        its token is kept. Awaiting consensus, it is kept (the replay prompt includes it) and a final one takes
        `finish`'s self-loop, so consensus terminates the request instead of replaying it (PP-TERMINATE).
        Suspended (its host copy was taken after the step on every stage), a token is kept unless it is final
        (a stop token): a suspended request cannot finish, so that step is dropped and recomputed after resume,
        which samples the same token. After a recompute-pause reset, a cancel or an abort it is dropped."""
        if state not in (self._pending_reset, self._offloaded):
            return False
        token = sampled[request.request_id]  # a decode step: a request with a chunk in flight is no victim
        if state == self._offloaded and (token in request.stop_token_ids or request.remaining_tokens <= 1):
            return False
        before = self.tally.before(request)
        request.advance(1, False)
        if before is not None:
            self.tally.changed(request, before)
        if request.append_token(token):
            self._fire(request, "finish", self._idle)
        return True

    def reach_consensus(self, request_ids: Collection[Hashable] | None = None) -> list[Request]:
        """Every stage agreed on these pending recompute-pauses (default: all of them): reset them for replay,
        or terminate them if they finished or were cancelled while waiting."""
        pending = [
            r
            for r in self.resident
            if r.state == self._pending_reset and (request_ids is None or r.request_id in request_ids)
        ]
        for request in pending:
            self._fire(request, "consensus", self._idle)
        return pending

    def lose_host_copy(self, request_id: Hashable) -> Request:
        """The host copy of a suspended request is unusable (copy failed, corrupt, tier gone): replay it."""
        request = self.get(request_id)
        self._fire(request, "lose_host_copy", self._idle)
        return request

    def set_host_capacity(self, host_blocks: int) -> list[Request]:
        """Attach, resize or remove (0) the host tier; suspended requests lose their host copies first.

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
        lost = [self.lose_host_copy(r.request_id) for r in list(self.suspended)] if host_blocks == 0 else []
        self.pool.set_host_capacity(host_blocks)
        if host_blocks == 0:
            self.host_tier_fallback = True
        return lost

    def fail_migration(self, output: SchedulerOutput, plan: MigrationPlan) -> FailedMigration:
        """The executor reports that the copies of `plan`, a migration of `output` (this iteration's, or an earlier
        one's whose copies are still in flight), failed (or that the host copy it would read is corrupt): undo the
        move through spec events, atomically.

        * ``to_host`` (a suspend): the host copy is unusable, so the suspended request takes `lose_host_copy` to
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
        event, listed = self._undo_of(plan, output)
        if request is None or not self.needs_undo(output, plan):
            state = "not active (done or unknown)" if request is None else request.state
            raise PoolError(
                f"cannot fail migration plan {plan.plan_id}: request {plan.request_id!r} is {state} and "
                f"{'not ' if request is None or request not in listed else ''}listed as "
                f"{'suspended' if suspend else 'resumed'} in this output (or no longer holds the copy's "
                "destinations); only a suspend or resume of the current iteration can fail, or a later one whose "
                "request still waits for the copy: report a copy nobody waits for complete (Step.failed does)"
            )
        self._end_copy(plan)  # withdraw: sources free at once, destinations stay with the request until released
        self._fire(request, event, self._idle)
        return FailedMigration(plan, request, event)

    # -------------------------------------------------------------------------------------------- progress
    def _watch_progress(self) -> None:
        """A4: count passes since the last progress (a prompt chunk, a decode step, a replay chunk beyond every
        earlier replay of the same replay prompt). Recomputing thrown-away replay work, copies and preemptions are
        not progress; a replay that redoes an earlier attempt's work legitimately takes up to its replay prompt's
        chunks, so the limit is `no_progress_limit` plus the chunks of the longest replay prompt."""
        if not self.requests:
            self._idle_iterations = 0
            return
        if self._idle_iterations >= self.config.no_progress_limit + self._replay_allowance():
            listing = ", ".join(f"{r.request_id!r}:{r.state}" for r in list(self.requests.values())[:20])
            raise SchedulerStalled(
                f"no request made progress for {self._idle_iterations} iterations; requests {listing}; "
                f"pool {self.pool.usage()}; in-flight copies {len(self.pool.in_flight)} (complete them with "
                "complete_migrations), or raise gpu_blocks / enable recompute-pause"
            )
        self._idle_iterations += 1

    def _replay_allowance(self) -> int:
        """Passes the longest pending replay prompt needs to be recomputed once (0 when nothing replays)."""
        if self._idle_iterations < self.config.no_progress_limit:
            return 0  # not needed yet: only computed once the detector would otherwise fire
        replays = [len(r.prefill_tokens) for r in self.requests.values() if r.num_recompute_pauses]
        return ceil_div(max(replays, default=0), self.config.prefill_chunk_size)

    # ---------------------------------------------------------------------------------------- observation
    def stats(self) -> IterationStats:
        """Statistics of the last completed iteration; before the first one completes, the requests and the pool as
        they are (iteration 0, nothing done yet). Every state is in `requests_per_state` from the start."""
        if self._last_figures is None:
            return _stats_of(SchedulerOutput(), self._figures_now(0, 0, iteration=0), self.config.block_bytes)
        if self._last_stats is None:
            self._last_stats = _stats_of(*self._last_figures, self.config.block_bytes)
        return self._last_stats

    def _figures_now(self, recomputed: int, generated: int, *, iteration: int) -> dict[str, Any]:
        """The `IterationStats` fields of an iteration that the scheduler's state gives, read now in O(states):
        `complete_step` takes them on every step, `stats` builds the record only when asked (with what its output
        says: no output is mutated once planned, `SchedulerOutput.amended` makes a new one)."""
        tally, gpu, host = self.tally, self.pool.gpu, self.pool.host
        counts = {**tally.counts, self._ended: len(self.finished)}
        return {
            "iteration": iteration,
            "requests_per_state": counts,
            "num_suspended": counts[self._offloaded],
            "num_recompute_paused": counts[self._dropped] + counts[self._pending_reset],
            "suspended_kv_tokens": tally.kv_tokens[self._offloaded],
            "recompute_paused_kv_tokens": tally.kv_tokens[self._pending_reset],
            "recompute_paused_tokens_to_replay": tally.replay_tokens[self._dropped],
            "recomputed_tokens": recomputed,
            "generated_tokens": generated,
            "gpu_blocks_used": gpu.capacity - gpu.num_free,  # held + fenced (CONS-GPU)
            "gpu_capacity": gpu.capacity,
            "host_blocks_used": host.capacity - host.num_free,
            "host_capacity": host.capacity,
            "host_tier_fallback": self.host_tier_fallback,
        }

    def check_invariants(self, output: SchedulerOutput | None = None) -> None:
        """Raise `InvariantViolation` unless the pool, every request and `output` satisfy the spec's invariants."""
        self.pool.check_invariants()
        for request in self.requests.values():
            if request.state not in self.tally.counts:
                raise InvariantViolation(
                    "STATS-COUNT",
                    f"request {request.request_id!r} is active but in state {request.state!r}, which is not an "
                    f"active state ({', '.join(self.tally.counts)}): a transition was half applied",
                )
            gpu = len(self.pool.gpu_blocks(request.request_id))
            host = len(self.pool.host_blocks(request.request_id))
            residency = self.spec.residency(request.state)
            if (gpu, host) != (request.num_gpu_blocks, request.num_host_blocks):
                raise InvariantViolation(
                    "RES-STATE",
                    f"request {request.request_id!r} records {request.num_gpu_blocks}"
                    f"/{request.num_host_blocks} blocks, the pool says {gpu}/{host}",
                )
            if (residency != "gpu" and gpu) or (residency != "host" and host):
                raise InvariantViolation(
                    "RES-STATE",
                    f"request {request.request_id!r} in {request.state} holds {gpu} GPU and {host} host blocks",
                )
            if residency == "host" and not self.pool.has_host_tier:
                raise InvariantViolation(
                    "NO-HOST-NO-SUSPEND", f"request {request.request_id!r} is suspended without a host tier"
                )
        kept, recount = self.tally.to_dict(), self.tally.recount(self.requests.values()).to_dict()
        if recount != kept:
            raise InvariantViolation("STATS-COUNT", f"a recount of the requests gives {recount}, the tally {kept}")
        for request in self.finished.values():
            if self.pool.gpu_blocks(request.request_id) or self.pool.host_blocks(request.request_id):
                raise InvariantViolation("RES-STATE", f"finished request {request.request_id!r} still holds blocks")
        if output is not None:
            check_output(output, self.spec)

    def forget_finished(self, request_ids: Iterable[Hashable]) -> list[Request]:
        """Drop these finished requests from `finished` and return them (their ids may be used again); the
        caller has taken their outputs. Raises `UnknownRequestId` (nothing changed) for an id not in `finished`."""
        ids = list(request_ids)
        missing = [rid for rid in ids if rid not in self.finished]
        if missing:
            raise UnknownRequestId(
                f"cannot forget requests {shown(missing[:5])}: they are not finished (active, unknown "
                "or already forgotten); forget only ids from `finished`"
            )
        return [self.finished.pop(rid) for rid in ids]


F = TypeVar("F")  # the executor's fence, in a `Step`: whatever it waits on


class Step(Generic[F]):
    """One step of `scheduler` in flight (module docstring, from "One scheduler step"): the output being carried
    out, the fence of each issued plan, the plans waited on, and the amendments taken."""

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


class _Effects:
    """The scheduler's implementation of `kvstate.EffectHooks`, for the effects of one transition fired in `pass_`:
    block accounting, request counters, and the pass's migrations (only a pass with a number takes migrations)."""

    __slots__ = ("pass_", "s")

    def __init__(self, scheduler: Scheduler, pass_: SchedulingPass) -> None:
        self.s = scheduler
        self.pass_ = pass_

    def _migrations(self) -> list:
        pass_ = self.pass_
        if pass_.number is None:
            raise KVStateError("migrations happen only inside schedule(); suspend and resume are scheduler decisions")
        return pass_.output.migrations

    def _admit(self, request: Request, event: str) -> None:
        """Put `request` among the computing requests in admission order; a fresh admission number unless the
        policy says this readmission keeps its own (a replay keeps it: spec policy)."""
        if request.admission < 0 or event not in self.s.policy.readmissions_keeping_admission:
            request.admission = next(self.s._admissions)
        bisect.insort(self.s.admitted, request, key=_by_admission)

    def allocate_first_chunk(self, request: Request, transition: Transition) -> None:
        blocks = first_chunk_blocks(request, self.s._view(self.pass_))
        self.s.pool.allocate(request.request_id, blocks)
        request.num_gpu_blocks = blocks
        self._admit(request, transition.event)

    def migrate_to_host(self, request: Request, transition: Transition) -> None:
        migrations = self._migrations()  # before the pool changes: a refusal changes nothing
        plan = self.s.pool.suspend(request.request_id)
        migrations.append(plan)
        request.copy_in_flight = True
        request.num_gpu_blocks, request.num_host_blocks = 0, plan.num_blocks
        request.num_suspensions += 1
        request.suspended_in_pass = self.pass_.number

    def migrate_to_gpu(self, request: Request, transition: Transition) -> None:
        migrations = self._migrations()  # before the pool changes: a refusal changes nothing
        plan = self.s.pool.resume(request.request_id)
        migrations.append(plan)
        request.copy_in_flight = True
        request.num_gpu_blocks, request.num_host_blocks = plan.num_blocks, 0
        self._admit(request, transition.event)

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
