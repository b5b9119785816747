"""The abstract model derived from the spec: counts instead of tokens and block ids.

Abstract state (hashable, immutable): an `AbstractState(requests, gpu_free, host_free, gpu_fenced, host_fenced)`
where `requests` is a sorted tuple of `AbstractRequest(group, state, computed, generated, gpu, host, deferred,
prefill, in_flight, fenced_gpu, fenced_host, incoming)` records (named tuples: they compare, hash and sort as the
plain tuples of their fields): `group` indexes the bound's distinct (prompt_len, max_new_tokens) pairs, `state` is a
spec state ("" = not arrived yet), `deferred` the termination reason recorded while awaiting consensus ("" = none)
and `prefill` the length of the (replay) prompt. The host tier is present iff the bound's host capacity is > 0; the
pipeline depth is the bound's. `in_flight` (0/1) marks a decode step that may still be in the pipeline when a
recompute-pause or a suspend was decided (pipeline stages > 1 only). A request's copy in flight (the guards allow one
at a time: SPEC.md section 4.0) is `fenced_gpu` and `fenced_host`, the blocks it fences in each tier (its sources,
and its destinations once the request released them), and `incoming`, the destinations the request still holds; the
pool's fenced counts are their sums, and a finished request keeps the record of its copy until it completes.
Sorting the tuples is the symmetry reduction: requests with equal parameters are interchangeable, so states that
differ only by a permutation of them are one state.

An `Action(kind, slot, name)` names what an edge does; `AbstractModel.apply` returns the `Edge` it takes.

Transitions (`AbstractModel.successors`), each atomic:
* `arrive` (environment): a not-yet-arrived request enters the spec's initial state (at most once each, so
  arrivals stop);
* every spec event on every request whose guard - the real function of `GUARDS`, or an injected one - holds on
  views built from the abstract state, fired through `TransitionTable.fire` with the effect applied by an
  `EffectHooks` implementation on the abstract state (`AbstractEffects`, or an injected class); a release
  (`release_kv_and_reset`, `release_kv_and_terminate`) leaves the destinations of the request's copy in flight
  fenced by that copy (SPEC.md section 4.0);
* `compute` (a scheduler step of one request): a running or replaying request computes its next prefill chunk
  or decodes one token, allocating the GPU blocks it needs (disabled without room: making room is the job of
  the spec's preemption events, and while its resume copy is in flight: its KV is not back). When the step completes
  the (replay) prompt a token is produced; then `catch_up` and `finish` fire through the table where their guards
  hold, as the scheduler does in `complete_step`. Token ids are abstracted away: a request finishes when its budget
  is spent, or, in a bound with stop tokens, at any token a `compute` action named `STOP` produces;
* with several pipeline stages, a request whose recompute-pause or suspend was decided while its last decode step
  was in the pipeline (`in_flight`) may still receive that token (`compute` lands it): awaiting consensus, `finish`
  then takes its self-loop and defers the termination; suspended, the token is kept in the host tier unless it is
  final (a suspended request cannot finish: it is dropped, and recomputed after resume);
* `complete` (the executor, F2): the request's copy in flight completes, or fails (the fences end alike; the undoing
  events of a failure are spec events of their own), ending its fences.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from kvstate.checker.bounds import Bound
from kvstate.lifecycle import TransitionTable
from kvstate.pool import ceil_div
from kvstate.request import STATE_ATTRIBUTE
from kvstate.roles import ACTIVE, OFFLOADED, PENDING_RESET, RECOMPUTING
from kvstate.semantics import GUARDS, Guard, first_chunk_blocks
from kvstate.spec import Spec, Transition

ABSENT = ""  # the state of a request that has not arrived yet
NONE = ""  # no deferred termination reason
STOP = "stop"  # the name of a compute action whose token is a stop token


class AbstractRequest(NamedTuple):
    """One request of an abstract state; fields in sort order (the symmetry reduction sorts by them)."""

    group: int  # index into the bound's distinct (prompt_len, max_new_tokens) pairs
    state: str  # a spec state, or ABSENT
    computed: int  # KV tokens computed
    generated: int  # tokens produced
    gpu: int  # GPU blocks held
    host: int  # host blocks held
    deferred: str  # the termination reason recorded while awaiting consensus, or NONE
    prefill: int  # length of the (replay) prompt
    in_flight: int  # 1: a decode step still in the pipeline when a recompute-pause or a suspend was decided
    fenced_gpu: int = 0  # GPU blocks its in-flight copy fences: its sources, and its destinations once released
    fenced_host: int = 0  # host blocks its in-flight copy fences, likewise
    incoming: int = 0  # blocks it holds that its in-flight copy still writes (its destinations, until released)


class PoolCounts(NamedTuple):
    """The pool part of an abstract state."""

    gpu_free: int
    host_free: int
    gpu_fenced: int
    host_fenced: int


class AbstractState(NamedTuple):
    """A node of the abstract state graph: the requests (sorted: canonical) and the pool counts."""

    requests: tuple[AbstractRequest, ...]
    gpu_free: int
    host_free: int
    gpu_fenced: int
    host_fenced: int


class Action(NamedTuple):
    """What an edge does: ("arrive", k, None), ("event", k, "suspend"), ("compute", k, None) or
    ("complete", k, None); `k` is the request's slot in the state the edge leaves. `tokens` (bounds with a token
    budget per pass only) cuts a compute step's chunk, or the first chunk an event allocates, to that many tokens,
    as a pass whose budget runs out does. Plain 3-tuples are accepted wherever an action is (counterexample files
    write them as literals)."""

    kind: str
    slot: int | None
    name: str | None
    tokens: int | None = None


def abstract_state(state: tuple) -> AbstractState:
    """`state` as records: a plain tuple of the same layout (as a hand-built test state may be) or a record."""
    requests, *pool = state
    return AbstractState(tuple(AbstractRequest(*r) for r in requests), *pool)


AState = AbstractState  # the name readers outside this package used before the records had names


class RequestState:
    """A mutable view of one abstract request; satisfies `kvstate.RequestView`."""

    __slots__ = (
        "request_id",
        STATE_ATTRIBUTE,
        "group",
        "computed",
        "generated",
        "gpu",
        "host",
        "deferred",
        "prefill",
        "in_flight",
        "fenced_gpu",
        "fenced_host",
        "incoming",
        "prompt_len",
        "max_new_tokens",
        "chunk_size",
        "block_size",
        "stopped",
    )

    # The abstract model has no scheduling passes: every suspended request counts as suspended in the pass under
    # way (`PoolState.pass_number`), an over-approximation of the promotion gate; the scheduler refinement's step
    # simulation checks the real same-pass and worth clauses (PROMOTE-GATE).
    suspended_in_pass = 0

    def __init__(self, req: AbstractRequest, slot: int, bound: Bound) -> None:
        self.request_id = slot
        (
            self.group,
            state,
            self.computed,
            self.generated,
            self.gpu,
            self.host,
            deferred,
            self.prefill,
            self.in_flight,
            self.fenced_gpu,
            self.fenced_host,
            self.incoming,
        ) = req
        setattr(self, STATE_ATTRIBUTE, state)
        self.deferred = deferred or None
        self.prompt_len, self.max_new_tokens = bound.groups[self.group]
        self.chunk_size = bound.chunk_size
        self.block_size = bound.block_size
        self.stopped = False  # the token its compute step just produced is a stop token

    @property
    def state(self) -> str:
        return getattr(self, STATE_ATTRIBUTE)

    def record(self, terminal: frozenset[str]) -> AbstractRequest:
        """The immutable record of this view (a finished request's history no longer matters; its blocks do)."""
        state = self.state
        if state in terminal:  # its released destinations may still be fenced by its copy: that record stays
            return AbstractRequest(
                self.group, state, 0, 0, self.gpu, self.host, NONE, 0, 0, self.fenced_gpu, self.fenced_host, 0
            )
        return AbstractRequest(
            self.group,
            state,
            self.computed,
            self.generated,
            self.gpu,
            self.host,
            self.deferred or NONE,
            self.prefill,
            self.in_flight,
            self.fenced_gpu,
            self.fenced_host,
            self.incoming,
        )

    # ---- RequestView
    @property
    def next_chunk(self) -> int:
        return min(self.chunk_size, self.prefill - self.computed)

    @property
    def prefill_tokens_left(self) -> int:
        return self.prefill - self.computed

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu

    @property
    def kv_tokens(self) -> int:
        return self.computed

    @property
    def num_host_blocks(self) -> int:
        return self.host

    @property
    def final_token_produced(self) -> bool:
        return self.stopped or self.generated >= self.max_new_tokens

    @property
    def replay_complete(self) -> bool:
        return self.computed >= self.prefill

    @property
    def termination_reason(self) -> str | None:
        return self.deferred

    @property
    def is_prefilling(self) -> bool:
        return self.computed < self.prefill

    @property
    def copy_in_flight(self) -> bool:
        return bool(self.fenced_gpu or self.fenced_host or self.incoming)


class PoolState:
    """A mutable view of the abstract pool; satisfies `kvstate.PoolView`."""

    __slots__ = (
        "block_size",
        "first_chunk_limit",
        "gpu_capacity",
        "gpu_fenced",
        "gpu_free",
        "host_capacity",
        "host_fenced",
        "host_free",
        "stages",
    )

    # no passes in the abstract model (see RequestState.suspended_in_pass): any promotion's worth is allowed
    pass_number = 0
    promotion_worth = float("inf")

    def __init__(self, state: AbstractState, bound: Bound) -> None:
        _, self.gpu_free, self.host_free, self.gpu_fenced, self.host_fenced = state
        self.gpu_capacity, self.host_capacity, self.stages = bound.gpu_blocks, bound.host_blocks, bound.pipeline_stages
        self.block_size = bound.block_size
        self.first_chunk_limit = bound.chunk_size  # no token budget per pass in the abstract model: the chunk size

    def record(self) -> PoolCounts:
        return PoolCounts(self.gpu_free, self.host_free, self.gpu_fenced, self.host_fenced)

    @property
    def gpu_free_blocks(self) -> int:
        return self.gpu_free

    @property
    def host_free_blocks(self) -> int:
        return self.host_free

    @property
    def has_host_tier(self) -> bool:
        return self.host_capacity > 0

    @property
    def pipeline_stages(self) -> int:
        return self.stages


class AbstractEffects:
    """`EffectHooks` on the abstract state: block counting, fences as counts, the reset for replay."""

    def __init__(self, pool: PoolState) -> None:
        self.pool = pool

    def allocate_first_chunk(self, request: RequestState, transition: Transition) -> None:
        blocks = first_chunk_blocks(request, self.pool)
        self.pool.gpu_free -= blocks
        request.gpu = blocks

    def migrate_to_host(self, request: RequestState, transition: Transition) -> None:
        blocks = request.gpu
        self.pool.gpu_fenced += blocks  # sources stay fenced until the copies complete (FENCE)
        self.pool.host_free -= blocks
        request.gpu, request.host = 0, blocks
        request.fenced_gpu, request.incoming = blocks, blocks
        # With several stages the request's last decode step may still be in the pipeline: its token may still land
        # (it is kept, SPEC.md section 9.1, unless it is final).
        request.in_flight = int(self.pool.stages > 1 and not request.is_prefilling)

    def migrate_to_gpu(self, request: RequestState, transition: Transition) -> None:
        blocks = request.host
        self.pool.host_fenced += blocks
        self.pool.gpu_free -= blocks
        request.gpu, request.host = blocks, 0
        request.fenced_host, request.incoming = blocks, blocks
        request.in_flight = 0  # resumed only once any step it had in the pipeline landed

    def _release(self, request: RequestState) -> None:
        """Release every block it holds (SPEC.md section 4.0): the destinations its in-flight copy still writes
        stay fenced by that copy, the others become free."""
        incoming_gpu = request.incoming if request.gpu else 0
        incoming_host = request.incoming - incoming_gpu
        self.pool.gpu_free += request.gpu - incoming_gpu
        self.pool.host_free += request.host - incoming_host
        self.pool.gpu_fenced += incoming_gpu
        self.pool.host_fenced += incoming_host
        request.fenced_gpu += incoming_gpu
        request.fenced_host += incoming_host
        request.gpu = request.host = request.incoming = 0

    def complete_copy(self, request: RequestState) -> None:
        """The executor reports the request's in-flight copy complete (or failed): its fences end."""
        self.pool.gpu_free += request.fenced_gpu
        self.pool.host_free += request.fenced_host
        self.pool.gpu_fenced -= request.fenced_gpu
        self.pool.host_fenced -= request.fenced_host
        request.fenced_gpu = request.fenced_host = request.incoming = 0

    def release_kv_and_reset(self, request: RequestState, transition: Transition) -> None:
        self._release(request)
        request.prefill = request.prompt_len + request.generated
        request.computed = 0
        request.in_flight = 0

    def hold_for_consensus(self, request: RequestState, transition: Transition) -> None:
        # With several stages the pause may be decided while the request's last decode step is still in the
        # pipeline: that token may still land (and may be its final one) before consensus.
        request.in_flight = int(not request.is_prefilling)

    def release_kv_and_terminate(self, request: RequestState, transition: Transition) -> None:
        self._release(request)
        request.in_flight = 0

    def defer_termination(self, request: RequestState, transition: Transition) -> None:
        request.deferred = request.deferred or transition.done_reason


@dataclass(frozen=True, slots=True)
class Edge:
    """One edge of the abstract state graph, before canonicalization: `before` and `after_requests` list the
    requests in the same order (`slot` indexes both); `taken` are the spec transitions the edge fired."""

    action: Action
    before: AbstractState
    after_requests: tuple[AbstractRequest, ...]
    after_pool: PoolCounts
    taken: tuple[Transition, ...]

    @property
    def slot(self) -> int | None:
        return self.action[1]


class AbstractModel:
    """The abstract model of one bound; `guards`, `effects` and `spec` can be injected (planted bugs).
    `symmetry=False` turns the symmetry reduction off: requests keep their bound order (slot i is request i), so
    states that differ by a permutation of equal requests are distinct (TLC's count without a symmetry set), and a
    request's actions keep their identity from state to state (what per-request fairness needs)."""

    def __init__(
        self,
        bound: Bound,
        spec: Spec | None = None,
        guards: Mapping[str, Guard] | None = None,
        effects: type = AbstractEffects,
        *,
        symmetry: bool = True,
    ) -> None:
        self.bound = bound
        self.symmetry = symmetry
        self.table = TransitionTable(spec, GUARDS if guards is None else guards)
        self.spec = self.table.spec
        self.effects = effects
        self.terminal = frozenset(self.spec.terminal_states)
        self.computing = self.spec.computing_states
        self.active, self.recomputing = self.spec.role(ACTIVE), self.spec.role(RECOMPUTING)
        self.pending_reset, self.offloaded = self.spec.role(PENDING_RESET), self.spec.role(OFFLOADED)
        self.stop_tokens = bound.stop_tokens
        # a token budget per pass may cut any chunk short: then every shorter chunk is an action too
        self.chunk_cuts = tuple(range(1, bound.chunk_size)) if bound.max_num_tokens is not None else ()
        self.first_chunk_events = frozenset(
            t.event for t in self.spec.transitions if t.effect == "allocate_first_chunk"
        )  # the events a cut applies to
        self.events_from = {s.name: self.table.allowed_events(s.name) for s in self.spec.states}
        if not bound.cancel:  # keep out the environment's events that end requests (cancel, abort)
            ending = {e.name for e in self.spec.events if e.name in self.spec.environment_events and e.done_reason}
            self.events_from = {s: tuple(e for e in evs if e not in ending) for s, evs in self.events_from.items()}

    # ---- states
    def unarrived(self) -> tuple[AbstractRequest, ...]:
        """The bound's requests before any arrives, in bound order (not canonical)."""
        return tuple(
            AbstractRequest(self.bound.group_of(i), ABSENT, 0, 0, 0, 0, NONE, p, 0)
            for i, (p, _) in enumerate(self.bound.requests)
        )

    def initial(self) -> AbstractState:
        return self.canonical(self.unarrived(), PoolCounts(self.bound.gpu_blocks, self.bound.host_blocks, 0, 0))

    def is_final(self, state: AbstractState) -> bool:
        """Every request reached a terminal state."""
        terminal = self.terminal
        return all(r.state in terminal for r in state.requests)

    def canonical(self, requests: tuple[AbstractRequest, ...], pool: PoolCounts) -> AbstractState:
        """The state the model stands for: requests sorted (the symmetry reduction), or in their slots."""
        return AbstractState(tuple(sorted(requests)) if self.symmetry else tuple(requests), *pool)

    def canonical_order(self, requests: tuple[AbstractRequest, ...]) -> list[int]:
        """The permutation `canonical` applies: position i of the result holds requests[order[i]]."""
        if not self.symmetry:
            return list(range(len(requests)))
        return sorted(range(len(requests)), key=requests.__getitem__)

    # ---- actions
    def actions(self, state: AbstractState) -> Iterator[Action]:
        reqs = state.requests
        for k, r in enumerate(reqs):
            if self.symmetry and k and r == reqs[k - 1]:
                continue  # an identical twin: the same successors (symmetry)
            st = r.state
            if st == ABSENT:
                yield Action("arrive", k, None)
                continue
            if r.fenced_gpu or r.fenced_host or r.incoming:
                yield Action("complete", k, None)
            if st in self.terminal:
                continue
            if st in self.computing or r.in_flight:
                yield Action("compute", k, None)
                if self.stop_tokens:
                    yield Action("compute", k, STOP)
                yield from (Action("compute", k, None, n) for n in self.chunk_cuts if n < r.prefill - r.computed)
            for event in self.events_from[st]:
                yield Action("event", k, event)
                if event in self.first_chunk_events:
                    yield from (Action("event", k, event, n) for n in self.chunk_cuts)

    def apply(self, state: AbstractState, action: Action) -> Edge | None:
        """The edge `action` takes from `state`, or None when it is not enabled."""
        kind, slot, name, tokens = Action(*action)
        pool = PoolState(state, self.bound)
        if tokens is not None:
            if kind not in ("compute", "event") or not 1 <= tokens <= self.bound.chunk_size:
                raise ValueError(f"action {action!r}: only compute and event actions cut a chunk, to 1..chunk_size")
            pool.first_chunk_limit = tokens
        if slot is None:
            raise ValueError(f"action {action!r} names no request slot; every action is one request's")
        request = RequestState(state.requests[slot], slot, self.bound)
        if kind == "complete":
            taken = self._complete(request, pool)
        elif kind == "arrive":
            taken = self._arrive(request)
        elif kind == "event":
            if name is None:
                raise ValueError(f"action {action!r} names no event; write ('event', slot, EVENT)")
            taken = self._event(request, name, pool, cut=tokens is not None)
        elif kind == "compute":
            taken = self._compute(request, pool, stop=name == STOP, tokens=tokens)
        else:
            raise ValueError(f"unknown action kind {kind!r}; use arrive, event, compute or complete")
        if taken is None:
            return None
        reqs = list(state.requests)
        reqs[slot] = request.record(self.terminal)
        return Edge(action, state, tuple(reqs), pool.record(), tuple(taken))

    def _complete(self, request: RequestState, pool: PoolState) -> list[Transition] | None:
        """The request's in-flight copy completes (or fails: the fences end the same way, SPEC.md section 4.0)."""
        if not request.copy_in_flight:
            return None
        self.effects(pool).complete_copy(request)
        return []

    def _arrive(self, request: RequestState) -> list[Transition] | None:
        if request.state != ABSENT:
            return None
        self.table.start(request)
        return []

    def _event(self, request: RequestState, event: str, pool: PoolState, cut: bool = False) -> list[Transition] | None:
        """`event` on `request`; with `cut`, only an event that allocates a first chunk, and only when the cut
        (`pool.first_chunk_limit`) makes that chunk shorter (otherwise it is the uncut edge again)."""
        if cut and (
            event not in self.first_chunk_events
            or pool.first_chunk_limit >= min(request.prefill_tokens_left, self.bound.chunk_size)
        ):
            return None
        if self.table.resolve(request, event, pool) is None:
            return None
        return [self.table.fire(request, event, pool, self.effects(pool))]

    def _compute(
        self, request: RequestState, pool: PoolState, *, stop: bool = False, tokens: int | None = None
    ) -> list[Transition] | None:
        """One forward pass of `request`: a prefill chunk (cut to `tokens` when given), a decode step, or a landing
        in-flight decode step; with `stop` its token is a stop token (bounds with stop tokens only; None when the
        step produces no token, or is not enabled)."""
        step = self._step_tokens(request, tokens)
        if step is None:
            return None
        produces = request.computed + step >= request.prefill
        if stop and not produces:
            return None
        in_host = request.state == self.offloaded  # suspended after the step: its block was copied with the others
        if not self._take_blocks(request, pool, step, in_host):
            return None
        if request.in_flight:
            request.in_flight = 0  # the decode step that was in the pipeline lands
            if in_host and (stop or request.generated + 1 >= request.max_new_tokens):
                return []  # a suspended request cannot finish: its final token is dropped, recomputed after resume
        request.computed += step
        taken: list[Transition] = []
        if produces:
            request.generated += 1
            request.stopped = stop
            hooks, table = self.effects(pool), self.table
            if request.state == self.recomputing and table.resolve(request, "catch_up", pool) is not None:
                taken.append(table.fire(request, "catch_up", pool, hooks))
            if table.resolve(request, "finish", pool) is not None:
                taken.append(table.fire(request, "finish", pool, hooks))
        return taken

    def _step_tokens(self, request: RequestState, cut: int | None) -> int | None:
        """The tokens `request`'s next step computes (a chunk cut to `cut`, a decode step's one, a landing's one),
        or None when it cannot compute: not computing nor landing, a caught-up replay, its resume copy still in
        flight (its KV is not back), or a cut that is no shorter than its chunk."""
        landing = bool(request.in_flight) and request.state in (self.pending_reset, self.offloaded)
        if landing:
            return None if cut is not None else 1
        if request.state not in self.computing or request.incoming:
            return None
        if request.is_prefilling:
            if cut is None:
                return request.next_chunk
            return cut if cut < request.next_chunk else None
        return 1 if request.state == self.active and cut is None else None

    def _take_blocks(self, request: RequestState, pool: PoolState, tokens: int, in_host: bool) -> bool:
        """Allocate the blocks a step of `tokens` needs, in the tier the request is in; False when that tier has too
        few free. A step landing on a suspended request was copied with its other blocks: its block is in the host
        tier, and while that copy is in flight its GPU source is fenced by the copy too."""
        held = request.host if in_host else request.gpu
        need = ceil_div(request.computed + tokens, self.bound.block_size) - held
        if need <= 0:
            return True
        copying = in_host and bool(request.incoming)
        if need > (pool.host_free if in_host else pool.gpu_free) or (copying and need > pool.gpu_free):
            return False
        if in_host:
            pool.host_free -= need
            request.host += need
            if copying:
                pool.gpu_free -= need
                pool.gpu_fenced += need
                request.fenced_gpu += need
                request.incoming += need
        else:
            pool.gpu_free -= need
            request.gpu += need
        return True

    def successors(self, state: AbstractState) -> Iterator[Edge]:
        for action in self.actions(state):
            edge = self.apply(state, action)
            if edge is not None:
                yield edge

    # ---- words
    def describe_request(self, req: AbstractRequest) -> str:
        req = AbstractRequest(*req)  # the refinement passes plain tuples
        prompt, new = self.bound.groups[req.group]
        if req.state == ABSENT:
            return f"not arrived [prompt {prompt}, max_new {new}]"
        copy = (
            f" copy in flight (fences gpu {req.fenced_gpu} host {req.fenced_host}, writes {req.incoming} of its blocks)"
            if req.fenced_gpu or req.fenced_host or req.incoming
            else ""
        )
        if req.state in self.terminal:
            return f"{req.state} (gpu {req.gpu}, host {req.host}){copy}"
        text = (
            f"{req.state} computed {req.computed}/{req.prefill} generated {req.generated}/{new} "
            f"gpu {req.gpu} host {req.host}"
        )
        return text + (f" deferred {req.deferred}" if req.deferred else "") + copy

    def describe_pool(self, state: AbstractState) -> str:
        _, gf, hf, gfe, hfe = state
        return (
            f"pool gpu free {gf}/{self.bound.gpu_blocks} fenced {gfe}; host free {hf}/{self.bound.host_blocks}"
            f" fenced {hfe}"
        )

    def describe_action(self, action: Action, name_of: str) -> str:
        kind, _, name = action[:3]
        if kind == "complete":
            return f"the executor completes {name_of}'s copy"
        if kind == "arrive":
            return f"{name_of} arrives"
        if kind == "compute":
            return f"{name_of} computes one step" + (" (its token is a stop token)" if name == STOP else "")
        return f"{name_of} takes event {name}"
