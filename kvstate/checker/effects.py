"""The abstract semantics of the spec's guards and effects: mutable views of one abstract request and of the
pool counts, which the real guards of `kvstate.semantics` read, and `AbstractEffects`, the spec's effects on them.

A step of the abstract model builds the views from its records, fires the spec's events on them through
`TransitionTable.fire` with `AbstractEffects` as the effect hooks, and turns them back into records (`record`).
Blocks are counts; a copy in flight is the blocks it fences in each tier and the destinations the request still
holds (`kvstate.checker.records`). The abstract model has no scheduling passes, so what the guards read of a pass is
over-approximated (every behaviour a pass allows is kept): every suspension counts as one of an earlier pass than the
pass under way (the promotion gate is open), a promotion may throw away any KV, the resume gate is open, and the
offload limit is the block count the action that fires the offload carries (`Action.blocks`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvstate.checker.bounds import Bound
from kvstate.checker.records import NONE, AbstractRequest, AbstractState, PoolCounts
from kvstate.request import STATE_ATTRIBUTE
from kvstate.semantics import TLA, TlaMeaning, first_chunk_blocks, offload_blocks
from kvstate.spec import Spec, Transition

OFFLOAD_LIMIT = "offload_limit"  # the PoolView field an allocation's offload reads: pass data, an action parameter here


def reads_offload_limit(name: str | None, meanings: Mapping[str, TlaMeaning] = TLA) -> bool:
    """Whether the guard, effect or helper `name` reads the pool's `offload_limit`, directly or through a helper it
    calls, by its TLA+ meaning (recorded beside its Python meaning in `kvstate.semantics`)."""
    seen: set[str] = set()
    todo = [name] if name else []
    while todo:
        current = todo.pop()
        if current in seen or current not in meanings:
            continue
        seen.add(current)
        body = meanings[current].body
        if re.search(rf"\.{OFFLOAD_LIMIT}\b", body):
            return True
        todo += [other for other in meanings if re.search(rf"\b{re.escape(other)}\(", body)]
    return False


def offload_limited_events(spec: Spec, meanings: Mapping[str, TlaMeaning] = TLA) -> frozenset[str]:
    """The spec's events with a transition whose guard or effect reads the pool's `offload_limit` (the offload of
    held blocks): the abstract model fires them with every block count an allocation may ask for."""
    return frozenset(
        e.name
        for e in spec.events
        if any(reads_offload_limit(t.guard, meanings) or reads_offload_limit(t.effect, meanings) for t in e.transitions)
    )


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

    # The abstract model has no scheduling passes: every suspended request counts as suspended in a pass before the
    # one under way (`PoolState.pass_number`), so the promotion gate is open (a request suspended in the pass under
    # way is promoted without a host tier only a pass later: a subset of these behaviours); the scheduler
    # refinement checks the real same-pass and worth clauses (PROMOTE-GATE).
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
    def mid_replay(self) -> bool:
        return self.generated > 0 and self.computed < self.prefill

    @property
    def termination_reason(self) -> str | None:
        return self.deferred

    @property
    def is_prefilling(self) -> bool:
        return self.computed < self.prefill

    @property
    def copy_in_flight(self) -> bool:
        return bool(self.fenced_gpu or self.fenced_host or self.incoming)

    @property
    def step_in_flight(self) -> bool:
        return bool(self.in_flight)


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
        "offload_limit",
        "stages",
    )

    # no passes in the abstract model (see RequestState.suspended_in_pass): the pass under way is pass 1, every
    # suspension is of pass 0, any promotion's worth is allowed and the utilization gate never refuses a resume (a
    # refusal only removes behaviour)
    pass_number = 1
    promotion_worth = float("inf")
    resume_gate_open = True

    def __init__(self, state: AbstractState, bound: Bound) -> None:
        _, self.gpu_free, self.host_free, self.gpu_fenced, self.host_fenced = state
        self.gpu_capacity, self.host_capacity, self.stages = bound.gpu_blocks, bound.host_blocks, bound.pipeline_stages
        self.block_size = bound.block_size
        self.first_chunk_limit = bound.chunk_size  # no token budget per pass in the abstract model: the chunk size
        self.offload_limit = 0  # no allocation under way: an offload fires only with a block count (Action.blocks)

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
    """`EffectHooks` on the abstract state: block counting, fences as counts, the reset for replay.

    Invariants kept: each effect moves blocks between free, held and fenced counts, never creating or losing one, so
    per tier free + held by requests + fenced stays the capacity (CONS-GPU, CONS-HOST); the pool's fenced counts
    stay the sums of the requests' own (`fenced_gpu`, `fenced_host`).
    """

    def __init__(self, pool: PoolState) -> None:
        self.pool = pool

    def allocate_first_chunk(self, request: RequestState, transition: Transition) -> None:
        blocks = first_chunk_blocks(request, self.pool)
        self.pool.gpu_free -= blocks
        request.gpu = blocks

    def hold_blocks(self, request: RequestState, transition: Transition) -> None:
        # Nothing moves: its GPU blocks are held. With several stages the request's last decode step may still be in
        # the pipeline: its token may still land in its held blocks (it is kept, SPEC.md section 9.1, unless final).
        request.in_flight = int(self.pool.stages > 1 and not request.is_prefilling)

    def offload_held_blocks(self, request: RequestState, transition: Transition) -> None:
        moved = offload_blocks(request, self.pool)
        self.pool.gpu_fenced += moved  # sources stay fenced until the copies complete (FENCE)
        self.pool.host_free -= moved
        request.gpu -= moved
        request.host += moved  # the destinations are the request's at once, after its earlier host blocks
        request.fenced_gpu, request.incoming = moved, moved

    def lock_and_onboard(self, request: RequestState, transition: Transition) -> None:
        blocks = request.host  # its held GPU blocks are locked again where they are: only host blocks are copied
        self.pool.host_fenced += blocks
        self.pool.gpu_free -= blocks
        request.gpu, request.host = request.gpu + blocks, 0
        request.fenced_host, request.incoming = blocks, blocks
        request.in_flight = 0  # resumed only once any step it had in the pipeline landed

    def _release(self, request: RequestState) -> None:
        """Release every block it holds in both tiers (SPEC.md section 4.0): the destinations its in-flight copy
        still writes stay fenced by that copy, the others become free. The copy's direction is its own: an offload
        fences GPU sources and writes host blocks, a resume fences host sources and writes GPU blocks (a suspended
        request may hold blocks in both tiers, so the tiers it holds say nothing of the direction)."""
        incoming_host = request.incoming if request.fenced_gpu else 0
        incoming_gpu = request.incoming - incoming_host
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
