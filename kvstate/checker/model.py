"""The abstract model derived from the spec: counts instead of tokens and block ids.

The records it works on are in `kvstate.checker.records`; the views and effects that give the spec's guards and
effects their abstract meaning, in `kvstate.checker.effects`.

Transitions (`AbstractModel.successors`), each atomic:
* `arrive` (environment): a not-yet-arrived request enters the spec's initial state (at most once each, so
  arrivals stop);
* every spec event on every request whose guard - the real function of `GUARDS`, or an injected one - holds on
  views built from the abstract state, fired through `TransitionTable.fire` with the effect applied by an
  `EffectHooks` implementation on the abstract state (`AbstractEffects`, or an injected class); a release
  (`release_kv_and_reset`, `release_kv_and_terminate`) leaves the destinations of the request's copy in flight
  fenced by that copy (SPEC.md section 4.0); an event whose guard or effect reads the pool's offload limit (the
  offload of held blocks, which moves what an allocation asks for) is fired once per block count k in 1..(the GPU
  blocks the request holds) (`Action.blocks`): whatever an allocation may ask of them (what the host tier cannot
  take is the guard's and the effect's to refuse or cut);
* `compute` (a scheduler step of one request): a running or replaying request computes its next prefill chunk
  or decodes one token, allocating the GPU blocks it needs (disabled without room: making room is the job of
  the spec's preemption events, and while its resume copy is in flight: its KV is not back). When the step completes
  the (replay) prompt a token is produced; then `catch_up` and `finish` fire through the table where their guards
  hold, as the scheduler does in `complete_step`. Token ids are abstracted away: a request finishes when its budget
  is spent, or, in a bound with stop tokens, at any token a `compute` action named `STOP` produces;
* with several pipeline stages, a request whose recompute-pause or suspend was decided while its last decode step
  was in the pipeline (`in_flight`) may still receive that token (`compute` lands it): awaiting consensus, `finish`
  then takes its self-loop and defers the termination; suspended, the token is kept unless it is final (a suspended
  request cannot finish: it is dropped, and recomputed after resume), and its blocks join the tail of the request's
  table: its held GPU blocks (nothing is copied at suspension), or the host tier when every block it holds was
  offloaded (then, while that offload is in flight, their GPU sources are fenced by it too);
* `complete` (the executor, F2): the request's copy in flight completes, or fails (the fences end alike; the undoing
  events of a failure are spec events of their own), ending its fences.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from kvstate.checker.bounds import Bound
from kvstate.checker.effects import AbstractEffects, PoolState, RequestState, offload_limited_events
from kvstate.checker.records import ABSENT, NONE, STOP, AbstractRequest, AbstractState, Action, Edge, PoolCounts
from kvstate.lifecycle import TransitionTable
from kvstate.pool import ceil_div
from kvstate.roles import ACTIVE, OFFLOADED, PENDING_RESET, RECOMPUTING
from kvstate.semantics import GUARDS, Guard
from kvstate.spec import Spec, Transition


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
        self.limited_events = offload_limited_events(self.spec)  # fired with a block count (Action.blocks)
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
                if event in self.limited_events:  # every count an allocation may ask of its held GPU blocks
                    yield from (Action("event", k, event, None, n) for n in range(1, r.gpu + 1))
                    continue
                yield Action("event", k, event)
                if event in self.first_chunk_events:
                    yield from (Action("event", k, event, n) for n in self.chunk_cuts)

    def apply(self, state: AbstractState, action: Action) -> Edge | None:
        """The edge `action` takes from `state`, or None when it is not enabled."""
        kind, slot, name, tokens, blocks = Action(*action)
        pool = PoolState(state, self.bound)
        if tokens is not None:
            if kind not in ("compute", "event") or not 1 <= tokens <= self.bound.chunk_size:
                raise ValueError(f"action {action!r}: only compute and event actions cut a chunk, to 1..chunk_size")
            pool.first_chunk_limit = tokens
        if blocks is not None:
            if kind != "event" or name not in self.limited_events or blocks < 1:
                raise ValueError(
                    f"action {action!r}: only an event that reads the offload limit "
                    f"({', '.join(sorted(self.limited_events)) or 'none in this spec'}) takes a block count, >= 1"
                )
            pool.offload_limit = blocks
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
        held = request.state == self.offloaded  # suspended after the step: its KV is held, in either tier
        if not self._take_blocks(request, pool, step, held):
            return None
        if request.in_flight:
            request.in_flight = 0  # the decode step that was in the pipeline lands
            if held and (stop or request.generated + 1 >= request.max_new_tokens):
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

    def _take_blocks(self, request: RequestState, pool: PoolState, tokens: int, held: bool) -> bool:
        """Allocate the blocks a step of `tokens` needs at the tail of the request's table; False when that tier has
        too few free. A step landing on a suspended (`held`) request counts the blocks it holds in both tiers; its
        new blocks are GPU blocks (held where the step wrote them), unless every block it holds was offloaded: then
        they went to the host tier with the others, and while that offload is in flight their GPU sources are fenced
        by it too."""
        owned = request.gpu + request.host if held else request.gpu
        need = ceil_div(request.computed + tokens, self.bound.block_size) - owned
        if need <= 0:
            return True
        in_host = held and request.gpu == 0 and request.host > 0
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
        blocks = Action(*action).blocks
        return f"{name_of} takes event {name}" + (f" ({blocks} blocks)" if blocks is not None else "")
