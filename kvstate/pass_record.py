"""What the pass check reads of one scheduling pass: the `PassSnapshot` taken just before it (`snapshot`) and the
`PassRecord` of the decisions its output does not show (victims, promotions, offloads and waits, in order).

Snapshots are values: each field has a default that excludes nothing and counts nothing, so an adapter states only
what its scheduler knows.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import KW_ONLY, dataclass, field

from kvstate.roles import OFFLOADED


@dataclass(frozen=True, slots=True)
class Victim:
    """`requester` needed blocks and `victim` gave them up by `event` (suspend or recompute_pause)."""

    requester: Hashable
    victim: Hashable
    event: str


@dataclass(frozen=True, slots=True)
class Promotion:
    """`promoted`, suspended earlier in the pass, was recompute-paused to make host room for `victim`."""

    victim: Hashable
    promoted: Hashable


@dataclass(frozen=True, slots=True)
class Offload:
    """`blocks` held GPU blocks of suspended `request` moved to the host tier for `requester`'s allocation."""

    requester: Hashable
    request: Hashable
    blocks: int


@dataclass(frozen=True, slots=True)
class Wait:
    """`requester` was not scheduled because `reserved` blocks on their way (fenced, awaiting consensus) will free."""

    requester: Hashable
    reserved: int


@dataclass
class PassRecord:
    """The decisions of one pass that its output does not show, in the order they were taken."""

    decisions: list[Victim | Promotion | Offload | Wait] = field(default_factory=list)


# a pass limit a snapshot does not state: no limit
UNLIMITED = 1 << 62


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """What the policy reads of one active request just before a pass: its id and state, then keyword-only fields,
    each with a default that excludes nothing and counts nothing (docs/fuzzing.md gives each field's meaning)."""

    request_id: Hashable
    state: str
    _: KW_ONLY
    arrival: int = 0  # submission order (the spec's serve order and admission classes read it)
    admission: int = 0  # admission number: the latest admitted has the greatest (victim order latest_admission_first)
    prefilling: bool = False  # its prompt or replay prompt is not computed yet
    about_to_finish: bool = False  # its next decode step produces its final token (VICTIM-NOT-FINAL)
    capped: bool = False  # preempted max_preemptions_per_request times (VICTIM-CAP)
    kv_tokens: int = 0  # KV tokens it holds (PROMOTE-GATE's worth)
    gpu_blocks: int = 0  # GPU blocks it holds
    in_flight: bool = False  # its step of an earlier pass is still in the pipeline: not schedulable in this pass
    copying: bool = False  # its resume copy is still in flight: not schedulable in this pass (its KV is not back)
    # read only by the rules that name them (a third-party engine's declared policy, `kvstate.declared`):
    num_output_tokens: int = 0  # tokens generated so far (victim order fewest_outputs_first)
    prompt_tokens: int = 0  # its original prompt's length (fewest_outputs_first's tie-break)
    last_preemption: int = -1  # when it was last a victim (an increasing count), -1 never (readmit_latest_victim_first)
    # read by the offload and suspension rules (SUSPEND-ROOM, OFFLOAD-DEMAND):
    host_blocks: int = 0  # blocks it holds in the host tier
    held_rank: int = -1  # its place in the offload order of held requests (least recently held 0), -1 not held
    next_step_blocks: int = 0  # GPU blocks its next allocation takes: its next chunk's, a resume's, a first chunk's
    copy_in_flight: bool = False  # a copy of its KV (an offload's or a resume's) is in flight
    suspend_fires: bool = False  # `suspend` fires on it now, whatever the suspend rule says (cannot_be_moved)


@dataclass(frozen=True, slots=True)
class PassSnapshot:
    """Every active request, and what the pass's rules read of the pool, just before a pass: the requests, then
    keyword-only fields with defaults (no copies, no host tier, no batch or token limit, the spec's serve order)."""

    requests: tuple[RequestSnapshot, ...]
    _: KW_ONLY
    gpu_fenced: int = 0  # GPU blocks fenced by copies in flight
    has_host_tier: bool = False
    max_batch_size: int = UNLIMITED
    max_num_tokens: int = UNLIMITED
    # the order in which the pass serves its requesters, where it is not the spec's (SPEC.md 7.2: decode steps,
    # then chunks, each by arrival): a third-party engine's own (`kvstate.declared`); None keeps the spec's
    serve_order: tuple[Hashable, ...] | None = None
    # the order in which the engine searches its victims, which ahead_of_requester and ahead_of_decoding_requester
    # read, where it is not the serve order (TensorRT-LLM serves decode steps before chunks but searches its whole
    # active list); None: the serve order
    scan_order: tuple[Hashable, ...] | None = None
    host_free: int = 0  # free host blocks
    recompute_pause: bool = True  # the scheduler may recompute-pause a victim (cannot_be_moved)


def _next_step_blocks(r, config, offloaded: str, block_size: int) -> int:
    """The GPU blocks `r`'s next allocation takes, from its own fields: a resume's host blocks, a (first or next)
    chunk's new blocks, a decode step's new block."""
    if r.state == offloaded:
        return r.num_host_blocks
    left = r.num_prefill_tokens - r.num_computed_tokens
    tokens = min(config.prefill_chunk_size, left) if left > 0 else 1
    return max(0, -(-(r.num_computed_tokens + tokens) // block_size) - r.num_gpu_blocks)


def snapshot(scheduler) -> PassSnapshot:
    """A `PassSnapshot` of `scheduler` (a `kvstate.Scheduler`) now."""
    cap = scheduler.config.max_preemptions_per_request
    not_ready = scheduler.not_ready()
    held_rank = {owner: rank for rank, owner in enumerate(scheduler.pool.held_owners())}
    offloaded = scheduler.spec.role(OFFLOADED)
    requests = tuple(
        RequestSnapshot(
            r.request_id,
            r.state,
            arrival=r.arrival,
            admission=r.admission,
            prefilling=r.is_prefilling,
            about_to_finish=r.about_to_finish,
            capped=cap is not None and r.num_suspensions + r.num_recompute_pauses >= cap,
            kv_tokens=r.num_computed_tokens,
            gpu_blocks=r.num_gpu_blocks,
            in_flight=r.request_id in scheduler.in_flight,
            copying=r.request_id in not_ready and r.request_id not in scheduler.in_flight,
            host_blocks=r.num_host_blocks,
            held_rank=held_rank.get(r.request_id, -1),
            next_step_blocks=_next_step_blocks(r, scheduler.config, offloaded, scheduler.config.block_size),
            copy_in_flight=r.copy_in_flight,
            suspend_fires=scheduler.suspend_fires(r),
        )
        for r in scheduler.requests.values()
    )
    return PassSnapshot(
        requests,
        gpu_fenced=len(scheduler.pool.gpu.fenced),
        has_host_tier=scheduler.pool.has_host_tier,
        max_batch_size=scheduler.slots_per_pass(),
        max_num_tokens=scheduler.config.max_num_tokens,
        host_free=scheduler.pool.host_free_blocks,
        recompute_pause=scheduler.config.enable_recompute_pause,
    )
