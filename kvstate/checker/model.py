"""The abstract model derived from the spec: counts instead of tokens and block ids.

Abstract state (hashable, immutable): an `AbstractState(requests, gpu_free, host_free, gpu_fenced, host_fenced)`
where `requests` is a sorted tuple of `AbstractRequest(group, state, computed, generated, gpu, host, deferred,
prefill, in_flight)` records (named tuples: they compare, hash and sort as the plain tuples of their fields):
`group` indexes the bound's distinct (prompt_len, max_new_tokens) pairs, `state` is a spec state ("" = not
arrived yet), `deferred` the termination reason recorded while awaiting consensus ("" = none) and `prefill` the
length of the (replay) prompt. The host tier is present iff the bound's host capacity is > 0; the pipeline depth
is the bound's. `in_flight` (0/1) marks a decode step still in the pipeline when a recompute-pause was
decided (pipeline stages > 1 only). Sorting the tuples is the symmetry reduction: requests with equal parameters are
interchangeable, so states that differ only by a permutation of them are one state.

An `Action(kind, slot, name)` names what an edge does; `AbstractModel.apply` returns the `Edge` it takes.

Transitions (`AbstractModel.successors`), each atomic:
* `arrive` (environment): a not-yet-arrived request enters the spec's initial state (at most once each, so
  arrivals stop);
* every spec event on every request whose guard - the real function of `GUARDS`, or an injected one - holds on
  views built from the abstract state, fired through `TransitionTable.fire` with the effect applied by an
  `EffectHooks` implementation on the abstract state (`AbstractEffects`, or an injected class);
* `compute` (a scheduler step of one request): a running or replaying request computes its next prefill chunk
  or decodes one token, allocating the GPU blocks it needs (disabled without room: making room is the job of
  the spec's preemption events). When the step completes the (replay) prompt a token is produced; then
  `catch_up` and `finish` fire through the table where their guards hold, as the scheduler does in
  `complete_step`. Token ids and stop tokens are abstracted away: a request finishes when its budget is spent;
* with several pipeline stages, a request whose recompute-pause was decided while its last decode step was in
  the pipeline (`in_flight`) may still receive that token while awaiting consensus (`compute` lands it; `finish`
  then takes its self-loop and defers the termination);
* `complete gpu` / `complete host` (environment): the executor reports every copy out of that tier done,
  ending their fences.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from kvstate.checker.bounds import Bound
from kvstate.lifecycle import TransitionTable
from kvstate.pool import ceil_div
from kvstate.request import STATE_ATTRIBUTE
from kvstate.roles import ACTIVE, PENDING_RESET, RECOMPUTING
from kvstate.semantics import GUARDS, Guard, first_chunk_blocks
from kvstate.spec import Spec, Transition

ABSENT = ""  # the state of a request that has not arrived yet
NONE = ""  # no deferred termination reason


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
    in_flight: int  # 1: a decode step still in the pipeline when a recompute-pause was decided


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
    ("complete", None, "gpu"); `k` is the request's slot in the state the edge leaves. Plain 3-tuples are accepted
    wherever an action is (counterexample files write them as literals)."""

    kind: str
    slot: int | None
    name: str | None


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
        "prompt_len",
        "max_new_tokens",
        "chunk_size",
        "block_size",
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
        ) = req
        setattr(self, STATE_ATTRIBUTE, state)
        self.deferred = deferred or None
        self.prompt_len, self.max_new_tokens = bound.groups[self.group]
        self.chunk_size = bound.chunk_size
        self.block_size = bound.block_size

    @property
    def state(self) -> str:
        return getattr(self, STATE_ATTRIBUTE)

    def record(self, terminal: frozenset[str]) -> AbstractRequest:
        """The immutable record of this view (a finished request's history no longer matters; its blocks do)."""
        state = self.state
        if state in terminal:
            return AbstractRequest(self.group, state, 0, 0, self.gpu, self.host, NONE, 0, 0)
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
        return self.generated >= self.max_new_tokens

    @property
    def replay_complete(self) -> bool:
        return self.computed >= self.prefill

    @property
    def termination_reason(self) -> str | None:
        return self.deferred

    @property
    def is_prefilling(self) -> bool:
        return self.computed < self.prefill


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

    def migrate_to_gpu(self, request: RequestState, transition: Transition) -> None:
        blocks = request.host
        self.pool.host_fenced += blocks
        self.pool.gpu_free -= blocks
        request.gpu, request.host = blocks, 0

    def _release(self, request: RequestState) -> None:
        self.pool.gpu_free += request.gpu
        self.pool.host_free += request.host
        request.gpu = request.host = 0

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
    states that differ by a permutation of equal requests are distinct (TLC's count without a symmetry set)."""

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
        self.pending_reset = self.spec.role(PENDING_RESET)
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
        return AbstractState(tuple(sorted(requests)) if self.symmetry else requests, *pool)

    def canonical_order(self, requests: tuple[AbstractRequest, ...]) -> list[int]:
        """The permutation `canonical` applies: position i of the result holds requests[order[i]]."""
        order = range(len(requests))
        return sorted(order, key=requests.__getitem__) if self.symmetry else list(order)

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
            if st in self.computing or r.in_flight:
                yield Action("compute", k, None)
            for event in self.events_from[st]:
                yield Action("event", k, event)
        if state.gpu_fenced:
            yield Action("complete", None, "gpu")
        if state.host_fenced:
            yield Action("complete", None, "host")

    def apply(self, state: AbstractState, action: Action) -> Edge | None:
        """The edge `action` takes from `state`, or None when it is not enabled."""
        kind, slot, name = action
        pool = PoolState(state, self.bound)
        if kind == "complete":
            return self._complete(action, state, pool)
        if slot is None:
            raise ValueError(f"action {action!r} names no request slot; only 'complete' actions go without one")
        request = RequestState(state.requests[slot], slot, self.bound)
        if kind == "arrive":
            taken = self._arrive(request)
        elif kind == "event":
            if name is None:
                raise ValueError(f"action {action!r} names no event; write ('event', slot, EVENT)")
            taken = self._event(request, name, pool)
        elif kind == "compute":
            taken = self._compute(request, pool)
        else:
            raise ValueError(f"unknown action kind {kind!r}; use arrive, event, compute or complete")
        if taken is None:
            return None
        reqs = list(state.requests)
        reqs[slot] = request.record(self.terminal)
        return Edge(action, state, tuple(reqs), pool.record(), tuple(taken))

    @staticmethod
    def _complete(action: Action, state: AbstractState, pool: PoolState) -> Edge | None:
        """A copy to the tier `action` names lands: its fenced blocks become free (None when none are fenced)."""
        if action.name == "gpu" and pool.gpu_fenced:
            pool.gpu_free, pool.gpu_fenced = pool.gpu_free + pool.gpu_fenced, 0
        elif action.name == "host" and pool.host_fenced:
            pool.host_free, pool.host_fenced = pool.host_free + pool.host_fenced, 0
        else:
            return None
        return Edge(action, state, state.requests, pool.record(), ())

    def _arrive(self, request: RequestState) -> list[Transition] | None:
        if request.state != ABSENT:
            return None
        self.table.start(request)
        return []

    def _event(self, request: RequestState, event: str, pool: PoolState) -> list[Transition] | None:
        if self.table.resolve(request, event, pool) is None:
            return None
        return [self.table.fire(request, event, pool, self.effects(pool))]

    def _compute(self, request: RequestState, pool: PoolState) -> list[Transition] | None:
        """One forward pass of `request`: a prefill chunk, a decode step, or a landing in-flight decode step."""
        landing = request.state == self.pending_reset and request.in_flight
        if request.state not in self.computing and not landing:
            return None
        if landing:
            tokens = 1
            request.in_flight = 0
        elif request.is_prefilling:
            tokens = request.next_chunk
        elif request.state == self.active:
            tokens = 1
        else:
            return None  # a caught-up replay is running by now
        need = ceil_div(request.computed + tokens, self.bound.block_size) - request.gpu
        if need > pool.gpu_free:
            return None
        if need > 0:
            pool.gpu_free -= need
            request.gpu += need
        request.computed += tokens
        taken: list[Transition] = []
        if not request.is_prefilling:
            request.generated += 1
            hooks, table = self.effects(pool), self.table
            if request.state == self.recomputing and table.resolve(request, "catch_up", pool) is not None:
                taken.append(table.fire(request, "catch_up", pool, hooks))
            if table.resolve(request, "finish", pool) is not None:
                taken.append(table.fire(request, "finish", pool, hooks))
        return taken

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
        if req.state in self.terminal:
            return f"{req.state} (gpu {req.gpu}, host {req.host})"
        text = (
            f"{req.state} computed {req.computed}/{req.prefill} generated {req.generated}/{new} "
            f"gpu {req.gpu} host {req.host}"
        )
        return text + (f" deferred {req.deferred}" if req.deferred else "")

    def describe_pool(self, state: AbstractState) -> str:
        _, gf, hf, gfe, hfe = state
        return (
            f"pool gpu free {gf}/{self.bound.gpu_blocks} fenced {gfe}; host free {hf}/{self.bound.host_blocks}"
            f" fenced {hfe}"
        )

    def describe_action(self, action: Action, name_of: str) -> str:
        kind, _, name = action
        if kind == "complete":
            return f"executor completes every copy out of the {name} tier"
        if kind == "arrive":
            return f"{name_of} arrives"
        if kind == "compute":
            return f"{name_of} computes one step"
        return f"{name_of} takes event {name}"
