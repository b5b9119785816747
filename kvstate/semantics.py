"""The meaning of every guard and effect name the specification uses.

Guards are pure functions `guard(request, pool) -> bool` of a `RequestView` and a `PoolView`: they read,
never write (the scheduler hands them a `PassView`, a snapshot of its pool and pass taken for that one decision).
Effects are named hooks, each called as `getattr(hooks, effect)(request, transition)` after the state change,
and each layer (the scheduler's block pool, the model checker's abstract state, the
executor) supplies an object implementing `EffectHooks`. `GUARDS` and `EFFECTS` are what the spec validator
holds the spec's names against: a name with no semantics, or semantics no transition uses, is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

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
        """A copy of its KV (a suspend's or a resume's) is issued and not yet reported complete or failed."""


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


Guard = Callable[[RequestView, PoolView], bool]


def first_chunk_tokens(request: RequestView, pool: PoolView) -> int:
    """The tokens of the request's first prefill chunk (admission, or the first chunk of a replay), were it taken now:
    its prefill left, cut to the chunk size and to the pass's token budget (`first_chunk_limit`)."""
    return min(request.prefill_tokens_left, pool.first_chunk_limit)


def first_chunk_blocks(request: RequestView, pool: PoolView) -> int:
    """The GPU blocks of `first_chunk_tokens`: what the first chunk's guard asks for and its effect allocates."""
    return ceil_div(first_chunk_tokens(request, pool), pool.block_size)


def gpu_room_for_first_chunk(request: RequestView, pool: PoolView) -> bool:
    """The GPU tier has free blocks for the request's first prefill chunk."""
    return pool.gpu_free_blocks >= first_chunk_blocks(request, pool)


def gpu_room_for_all_blocks(request: RequestView, pool: PoolView) -> bool:
    """Its host copy is complete (no copy of it in flight) and the GPU tier has a free block for every block the
    request holds in the host tier."""
    return not request.copy_in_flight and pool.gpu_free_blocks >= request.num_host_blocks


def host_room_for_all_blocks(request: RequestView, pool: PoolView) -> bool:
    """Its KV is all on the GPU (no copy of it in flight), and a host tier exists and has a free block for every GPU
    block the request holds (suspend is all-or-nothing)."""
    return not request.copy_in_flight and pool.has_host_tier and pool.host_free_blocks >= request.num_gpu_blocks


def promotion_saves_kv(promoted_kv_tokens: float, victim_kv_tokens: float) -> bool:
    """The worth rule of promotion: throwing away the promoted KV costs less than recomputing the victim's."""
    return promoted_kv_tokens < victim_kv_tokens


def same_pass_promotion(request: RequestView, pool: PoolView) -> bool:
    """The promotion gate: a host tier exists, the request was suspended earlier in the pass under way, and its KV
    is worth less than what the promotion may still throw away (PROMOTE-GATE)."""
    return (
        pool.has_host_tier
        and pool.pass_number is not None
        and request.suspended_in_pass == pool.pass_number
        and promotion_saves_kv(request.kv_tokens, pool.promotion_worth)
    )


def single_stage(request: RequestView, pool: PoolView) -> bool:
    """One pipeline stage: a recompute-pause resets at once."""
    return pool.pipeline_stages == 1


def multi_stage(request: RequestView, pool: PoolView) -> bool:
    """Several pipeline stages: a recompute-pause waits for every stage to agree before its reset."""
    return pool.pipeline_stages > 1


def replay_complete(request: RequestView, pool: PoolView) -> bool:
    """The replay prefill has computed the whole replay prompt."""
    return request.replay_complete


def final_token_produced(request: RequestView, pool: PoolView) -> bool:
    """The request's last token ends it (stop token or budget spent)."""
    return request.final_token_produced


def termination_requested(request: RequestView, pool: PoolView) -> bool:
    """A finish, cancel or abort arrived while the request awaited consensus."""
    return request.termination_reason is not None


def replay_still_wanted(request: RequestView, pool: PoolView) -> bool:
    """Nothing ended the request while it awaited consensus, so it is reset for replay."""
    return request.termination_reason is None


GUARDS: Mapping[str, Guard] = {
    fn.__name__: fn
    for fn in (
        gpu_room_for_first_chunk,
        gpu_room_for_all_blocks,
        host_room_for_all_blocks,
        same_pass_promotion,
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

    def allocate_first_chunk(self, request: R_contra, transition: Transition) -> None:
        """Allocate GPU blocks for the first prefill chunk (of the prompt, or of the replay prompt)."""

    def migrate_to_host(self, request: R_contra, transition: Transition) -> None:
        """Plan copies of every GPU block to fresh host blocks; fence the GPU sources until the copies complete."""

    def migrate_to_gpu(self, request: R_contra, transition: Transition) -> None:
        """Plan copies of every host block to fresh GPU blocks; fence the host sources until the copies complete."""

    def release_kv_and_reset(self, request: R_contra, transition: Transition) -> None:
        """Free every block the request holds in either tier and reset it for replay (SPEC.md, reset for replay)."""

    def hold_for_consensus(self, request: R_contra, transition: Transition) -> None:
        """Keep the request's GPU blocks, take it out of every batch and announce the pause to all stages."""

    def release_kv_and_terminate(self, request: R_contra, transition: Transition) -> None:
        """Free every block the request holds and record its done reason."""

    def defer_termination(self, request: R_contra, transition: Transition) -> None:
        """Record the finish, cancel or abort reason; consensus will terminate the request instead of replaying it."""


EFFECTS: frozenset[str] = frozenset(
    name for name, value in vars(EffectHooks).items() if callable(value) and not name.startswith("_")
)
