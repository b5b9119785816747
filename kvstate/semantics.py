"""The meaning of every guard and effect name the specification uses.

Guards are pure functions `guard(request, pool) -> bool` of a `RequestView` and a `PoolView`: they read,
never write (the scheduler hands them a `PassView`, a snapshot of its pool and pass taken for that one decision).
Effects are named hooks, each called as `getattr(hooks, effect)(request, transition)` after the state change,
and each layer (the scheduler's block pool, the model checker's abstract state, the
executor) supplies an object implementing `EffectHooks`. `GUARDS` and `EFFECTS` are what the spec validator
holds the spec's names against: a name with no semantics, or semantics no transition uses, is refused.

Every guard, effect and helper here also has its **TLA+ meaning**, recorded beside it with `@tla(...)` in `TLA`:
`kvstate export tla` writes each as a TLA+ operator of the same name, and the spec validator refuses a guard or
effect the spec uses without one. A guard's (and a helper's) TLA+ reads the same views as its Python: `request` and
`pool` are records with the fields of `RequestView` and `PoolView` (None is `NoReason` or `NoPass`, `inf` is
`Unbounded`). An effect's TLA+ is its meaning on the abstract state the model checker explores (block counts, as
`kvstate.checker.effects.AbstractEffects` implements it): `request` is the abstract request record (state, computed,
generated, gpu, host, deferred, prefill, in_flight, fenced_gpu, fenced_host, incoming, stopped, prompt_len,
max_new_tokens: `kvstate.tla.abstract`), `pool` the pool counts (gpu_free, host_free, gpu_fenced, host_fenced,
offload_limit) and
`transition` the edge taken (event, source, dest, done_reason); its value is the record `[request |-> ..., pool |->
...]` after the effect. `kvstate check --engine tlc` runs TLC on the exported module beside our checker: a TLA+
meaning that differs from its Python meaning shows as different state counts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from kvstate.pool import ceil_div

if TYPE_CHECKING:  # annotations only: the spec layer imports this module (through kvstate.validate)
    from kvstate.spec import Transition


class RequestView(Protocol):
    """What guards may read of a request."""

    @property
    def request_id(self) -> Hashable:
        """The request's id (read only)."""

    @property
    def prefill_tokens_left(self) -> int:
        """Tokens of its prompt (or replay prompt) not computed yet: its first chunk takes at most these."""

    @property
    def num_gpu_blocks(self) -> int:
        """GPU blocks it holds now."""

    @property
    def num_host_blocks(self) -> int:
        """Host blocks it holds now."""

    @property
    def final_token_produced(self) -> bool:
        """Its last generated token is final: a stop token, or the token budget is spent."""

    @property
    def replay_complete(self) -> bool:
        """Every token of its replay prompt has been computed again."""

    @property
    def mid_replay(self) -> bool:
        """It has produced a token and has not computed its whole prompt again: a replay that has not caught up."""

    @property
    def termination_reason(self) -> str | None:
        """The reason of a finish, cancel or abort deferred while it awaits consensus; None otherwise."""

    @property
    def suspended_in_pass(self) -> int | None:
        """The number of the scheduling pass that last suspended it (None: never suspended)."""

    @property
    def kv_tokens(self) -> int:
        """KV tokens it holds (computed tokens): what throwing its KV away costs to recompute."""

    @property
    def copy_in_flight(self) -> bool:
        """A copy of its KV (an offload's or a resume's) is planned and not yet reported complete or failed."""

    @property
    def step_in_flight(self) -> bool:
        """A step of it is still in the pipeline (several micro-batches in flight): a later stage has yet to read
        and write its blocks."""


class PoolView(Protocol):
    """What guards may read of the block pool."""

    @property
    def gpu_free_blocks(self) -> int: ...

    @property
    def host_free_blocks(self) -> int: ...

    @property
    def has_host_tier(self) -> bool: ...

    @property
    def pipeline_stages(self) -> int: ...

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    def first_chunk_limit(self) -> int:
        """Tokens a first prefill chunk may take at most now: the chunk size, cut to what the pass under way has
        left of its token budget."""

    @property
    def pass_number(self) -> int | None:
        """The scheduling pass under way (None between passes)."""

    @property
    def promotion_worth(self) -> float:
        """KV tokens a promotion under way may still throw away: the victim's KV minus what was promoted for it
        (`inf` where no pass bounds it, as in the abstract model)."""

    @property
    def offload_limit(self) -> int:
        """Held blocks an offload may move now: what the allocation under way still needs from it (pass data; the
        abstract model tries every count)."""

    @property
    def resume_gate_open(self) -> bool:
        """The utilization gate lets a resume through now: the GPU blocks neither free nor evictable are at most
        `max_util_for_resume` of the GPU tier (always open in the abstract model: a refusal only removes behaviour)."""


class PassView(NamedTuple):
    """A `PoolView` as a value: the figures of the pool and of the scheduling pass under way at one decision. The
    scheduler builds one per event it fires, so its guards read figures nothing can change while they run."""

    gpu_free_blocks: int
    host_free_blocks: int
    has_host_tier: bool
    pipeline_stages: int
    block_size: int
    first_chunk_limit: int
    pass_number: int | None
    promotion_worth: float
    offload_limit: int = 0
    resume_gate_open: bool = True


Guard = Callable[[RequestView, PoolView], bool]


class TlaMeaning(NamedTuple):
    """The TLA+ meaning of a guard, effect or helper: an operator `name(params) == body`."""

    params: tuple[str, ...]
    body: str


TLA: dict[str, TlaMeaning] = {}
"""name -> TLA+ meaning of every guard, effect and helper of this module, in definition order (a helper is defined
before the guards that use it)."""

EFFECT_TLA_PARAMS = ("request", "pool", "transition")  # an effect's TLA+ takes the counts its hooks' layer owns

F = TypeVar("F", bound=Callable[..., Any])


def tla(body: str, *, params: tuple[str, ...] | None = None) -> Callable[[F], F]:
    """Record `body`, a TLA+ expression, as the TLA+ meaning of the decorated function (its parameters are the
    function's own unless `params` names them) in `TLA`, under the function's name."""

    def record(fn: F) -> F:
        names = params or tuple(p for p in inspect.signature(fn).parameters if p != "self")
        TLA[fn.__name__] = TlaMeaning(names, body)
        return fn

    return record


@tla("Min(request.prefill_tokens_left, pool.first_chunk_limit)")
def first_chunk_tokens(request: RequestView, pool: PoolView) -> int:
    """The tokens of the request's first prefill chunk (admission, or the first chunk of a replay), were it taken now:
    its prefill left, cut to the chunk size and to the pass's token budget (`first_chunk_limit`)."""
    return min(request.prefill_tokens_left, pool.first_chunk_limit)


@tla("ceil_div(first_chunk_tokens(request, pool), pool.block_size)")
def first_chunk_blocks(request: RequestView, pool: PoolView) -> int:
    """The GPU blocks of `first_chunk_tokens`: what the first chunk's guard asks for and its effect allocates."""
    return ceil_div(first_chunk_tokens(request, pool), pool.block_size)


@tla("pool.gpu_free_blocks >= first_chunk_blocks(request, pool)")
def gpu_room_for_first_chunk(request: RequestView, pool: PoolView) -> bool:
    """The GPU tier has free blocks for the request's first prefill chunk."""
    return pool.gpu_free_blocks >= first_chunk_blocks(request, pool)


@tla("~request.copy_in_flight")
def no_copy_in_flight(request: RequestView, pool: PoolView) -> bool:
    """No copy of the request's KV is in flight (a resume's copy up, SPEC.md 4.0): its blocks are all on the GPU and
    final, so they can be held."""
    return not request.copy_in_flight


@tla(
    r"~request.copy_in_flight /\ pool.has_host_tier /\ request.num_gpu_blocks >= 1"
    r" /\ pool.host_free_blocks >= 1 /\ pool.offload_limit >= 1"
)
def host_room_for_held_blocks(request: RequestView, pool: PoolView) -> bool:
    """The request holds blocks on the GPU and no copy of it is in flight, a host tier exists with a free block,
    and the allocation under way needs at least one block from an offload."""
    return (
        not request.copy_in_flight
        and pool.has_host_tier
        and request.num_gpu_blocks >= 1
        and pool.host_free_blocks >= 1
        and pool.offload_limit >= 1
    )


@tla(r"~request.copy_in_flight /\ pool.resume_gate_open /\ pool.gpu_free_blocks >= request.num_host_blocks")
def resume_fits(request: RequestView, pool: PoolView) -> bool:
    """No copy of it is in flight, the utilization gate is open, and the GPU tier has a free block for every block
    the request holds in the host tier (its blocks still on the GPU need none: they are locked again)."""
    return not request.copy_in_flight and pool.resume_gate_open and pool.gpu_free_blocks >= request.num_host_blocks


@tla(r"~request.mid_replay /\ resume_fits(request, pool)")
def gpu_room_for_offloaded_blocks(request: RequestView, pool: PoolView) -> bool:
    """The request is no replay suspended mid-way, and the resume fits (`resume_fits`): it resumes running."""
    return not request.mid_replay and resume_fits(request, pool)


@tla(r"request.mid_replay /\ resume_fits(request, pool)")
def gpu_room_for_offloaded_replay(request: RequestView, pool: PoolView) -> bool:
    """The request is a replay suspended mid-way, and the resume fits (`resume_fits`): it resumes replaying."""
    return request.mid_replay and resume_fits(request, pool)


@tla("Min(Min(request.num_gpu_blocks, pool.host_free_blocks), pool.offload_limit)")
def offload_blocks(request: RequestView, pool: PoolView) -> int:
    """The held blocks an offload moves: what the allocation under way needs from it, as far as the request holds
    blocks on the GPU and the host tier has room."""
    return min(request.num_gpu_blocks, pool.host_free_blocks, pool.offload_limit)


@tla("promoted_kv_tokens < victim_kv_tokens")
def promotion_saves_kv(promoted_kv_tokens: float, victim_kv_tokens: float) -> bool:
    """The worth rule of promotion: throwing away the promoted KV costs less than recomputing the victim's."""
    return promoted_kv_tokens < victim_kv_tokens


@tla(
    r"pool.pass_number # NoPass /\ (request.suspended_in_pass # pool.pass_number \/ pool.has_host_tier)"
    r" /\ ~request.step_in_flight /\ promotion_saves_kv(request.kv_tokens, pool.promotion_worth)"
)
def promotion_gate(request: RequestView, pool: PoolView) -> bool:
    """The promotion gate: only in a scheduling pass; a request suspended in the pass under way only while a host
    tier exists (without one it waits a pass); not while a step of it is in the pipeline (its later stages still
    use the blocks the promotion releases at once); and its KV is worth less than what the promotion may still
    throw away (PROMOTE-GATE)."""
    return (
        pool.pass_number is not None
        and (request.suspended_in_pass != pool.pass_number or pool.has_host_tier)
        and not request.step_in_flight
        and promotion_saves_kv(request.kv_tokens, pool.promotion_worth)
    )


@tla("pool.pipeline_stages = 1")
def single_stage(request: RequestView, pool: PoolView) -> bool:
    """One pipeline stage: a recompute-pause resets at once."""
    return pool.pipeline_stages == 1


@tla("pool.pipeline_stages > 1")
def multi_stage(request: RequestView, pool: PoolView) -> bool:
    """Several pipeline stages: a recompute-pause waits for every stage to agree before its reset."""
    return pool.pipeline_stages > 1


@tla("request.replay_complete")
def replay_complete(request: RequestView, pool: PoolView) -> bool:
    """The replay prefill has computed the whole replay prompt."""
    return request.replay_complete


@tla("request.final_token_produced")
def final_token_produced(request: RequestView, pool: PoolView) -> bool:
    """The request's last token ends it (stop token or budget spent)."""
    return request.final_token_produced


@tla("request.termination_reason # NoReason")
def termination_requested(request: RequestView, pool: PoolView) -> bool:
    """A finish, cancel or abort arrived while the request awaited consensus."""
    return request.termination_reason is not None


@tla("request.termination_reason = NoReason")
def replay_still_wanted(request: RequestView, pool: PoolView) -> bool:
    """Nothing ended the request while it awaited consensus, so it is reset for replay."""
    return request.termination_reason is None


GUARDS: Mapping[str, Guard] = {
    fn.__name__: fn
    for fn in (
        gpu_room_for_first_chunk,
        no_copy_in_flight,
        host_room_for_held_blocks,
        gpu_room_for_offloaded_blocks,
        gpu_room_for_offloaded_replay,
        promotion_gate,
        single_stage,
        multi_stage,
        replay_complete,
        final_token_produced,
        termination_requested,
        replay_still_wanted,
    )
}


R_contra = TypeVar("R_contra", bound=RequestView, contravariant=True)  # the request records a layer's hooks take


class EffectHooks(Protocol[R_contra]):
    """The effects a layer must implement; each is called after the state change with the edge taken."""

    @tla(
        "LET blocks == first_chunk_blocks(RequestView(request), PoolView(pool)) IN"
        " [request |-> [request EXCEPT !.gpu = blocks], pool |-> [pool EXCEPT !.gpu_free = @ - blocks]]",
        params=EFFECT_TLA_PARAMS,
    )
    def allocate_first_chunk(self, request: R_contra, transition: Transition) -> None:
        """Allocate GPU blocks for the first prefill chunk (of the prompt, or of the replay prompt)."""

    @tla(
        "[request |-> [request EXCEPT"
        " !.in_flight = IF PipelineStages > 1 /\\ request.computed >= request.prefill THEN 1 ELSE 0],"
        " pool |-> pool]",
        params=EFFECT_TLA_PARAMS,
    )
    def hold_blocks(self, request: R_contra, transition: Transition) -> None:
        """Its GPU blocks become held: they stay where they are, no longer locked, and join the tail of the offload
        order (least recently held first). Nothing is copied. With several pipeline stages a decode step of the
        request may still be in flight: its token may land."""

    @tla(
        "LET moved == offload_blocks(RequestView(request), PoolView(pool)) IN"
        " [request |-> [request EXCEPT !.gpu = @ - moved, !.host = @ + moved, !.fenced_gpu = moved,"
        " !.incoming = moved],"
        " pool |-> [pool EXCEPT !.gpu_fenced = @ + moved, !.host_free = @ - moved]]",
        params=EFFECT_TLA_PARAMS,
    )
    def offload_held_blocks(self, request: R_contra, transition: Transition) -> None:
        """Move `offload_blocks` of its held GPU blocks, first in table order, to fresh host blocks: plan the copies
        and fence the GPU sources until they complete (FENCE); the host blocks are the request's at once."""

    @tla(
        "[request |-> [request EXCEPT !.gpu = @ + request.host, !.host = 0, !.fenced_host = request.host,"
        " !.incoming = request.host, !.in_flight = 0],"
        " pool |-> [pool EXCEPT !.host_fenced = @ + request.host, !.gpu_free = @ - request.host]]",
        params=EFFECT_TLA_PARAMS,
    )
    def lock_and_onboard(self, request: R_contra, transition: Transition) -> None:
        """Lock its held GPU blocks again (no copy) and copy its host blocks up into fresh GPU blocks placed before
        them in its table, fencing the host sources until the copies complete (RESUME-COPY)."""

    @tla(
        "LET released == ReleaseBlocks(request, pool) IN"
        " [request |-> [released.request EXCEPT !.computed = 0, !.in_flight = 0,"
        " !.prefill = request.prompt_len + request.generated], pool |-> released.pool]",
        params=EFFECT_TLA_PARAMS,
    )
    def release_kv_and_reset(self, request: R_contra, transition: Transition) -> None:
        """Release every block the request holds in either tier and reset it for replay (SPEC.md, reset for replay);
        the destinations of its copy in flight stay fenced by that copy (SPEC.md section 4.0)."""

    @tla(
        "[request |-> [request EXCEPT !.in_flight = IF request.computed < request.prefill THEN 0 ELSE 1],"
        " pool |-> pool]",
        params=EFFECT_TLA_PARAMS,
    )
    def hold_for_consensus(self, request: R_contra, transition: Transition) -> None:
        """Keep the request's GPU blocks, take it out of every batch and announce the pause to all stages."""

    @tla(
        "LET released == ReleaseBlocks(request, pool) IN"
        " [request |-> [released.request EXCEPT !.in_flight = 0], pool |-> released.pool]",
        params=EFFECT_TLA_PARAMS,
    )
    def release_kv_and_terminate(self, request: R_contra, transition: Transition) -> None:
        """Release every block the request holds (its copy's destinations stay fenced) and record its done reason."""

    @tla(
        "[request |-> [request EXCEPT !.deferred = IF @ = NoReason THEN transition.done_reason ELSE @], pool |-> pool]",
        params=EFFECT_TLA_PARAMS,
    )
    def defer_termination(self, request: R_contra, transition: Transition) -> None:
        """Record the finish, cancel or abort reason; consensus will terminate the request instead of replaying it."""


EFFECTS: frozenset[str] = frozenset(
    name for name, value in vars(EffectHooks).items() if callable(value) and not name.startswith("_")
)
