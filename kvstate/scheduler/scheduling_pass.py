"""One scheduling pass in progress: what `Scheduler.schedule` has decided so far, and what it may still spend."""

from __future__ import annotations

from collections.abc import Hashable

from kvstate.config import SchedulerConfig
from kvstate.output import SchedulerOutput
from kvstate.policy import PassRecord
from kvstate.pool import TieredBlockPool
from kvstate.request import Request
from kvstate.semantics import PassView

__all__ = ["SchedulingPass"]


class SchedulingPass:
    """One scheduling pass: its output, budgets, victims and reservations, and what its guards read of it.

    The lifecycle's guards get a `PassView` of it for each decision (`view`): the pool figures plus
    `number` (None for the pass used between passes) and the worth a promotion may still throw away.
    Invariants: `tokens_left` and `slots_left` never go negative; `pending_free` is the room on its way that no
    requester of this pass has reserved yet; `record` lists victims, promotions and waits in decision order;
    every victim but `unmoved_victims` of them left its state when it was taken (suspended or paused), so a walk
    over the resident requests that skips those not active needs the victims only while some are unmoved; `head`,
    once known, is the request the pass serves first, as it was when the pass began (nothing computing changes
    state before the first requester asks for room).
    """

    def __init__(self, config: SchedulerConfig, number: int | None) -> None:
        self.number = number
        self.output: SchedulerOutput = SchedulerOutput()
        self.tokens_left = config.max_num_tokens
        self.slots_left = config.max_batch_size
        self.victims: set[int] = set()
        self.unmoved_victims = 0  # victims no event moved (a policy without cannot_be_moved, recompute-pause off)
        self.waiting: set[int] = set()
        self.suspended: list[Request] = []  # suspended in this pass and not promoted, in suspension order
        self.pending_free = 0
        self.preempted = False
        self.waited = False
        self.promotion_worth = 0
        self.requester: Request | None = None  # the request the pass is making room for
        # the first request the pass serves (SPEC.md 7.2), found when a requester first asks for room (`head_known`)
        self.head: Request | None = None
        self.head_known = False
        self.chunk_blocks: dict[Hashable, int] = {}  # blocks allocated for a resident request's chunk of this pass
        self.offload_limit = 0  # held blocks the allocation under way needs from an offload (its guard reads it)
        self.record = PassRecord()

    def view(self, pool: TieredBlockPool, config: SchedulerConfig) -> PassView:
        """What the guards read for one decision in this pass: `pool`'s figures and the pass's own."""
        gpu_free, host_free, has_host_tier, pipeline_stages, resume_gate_open = pool.view_figures(
            config.max_util_for_resume
        )
        return PassView(
            gpu_free,
            host_free,
            has_host_tier,
            pipeline_stages,
            config.block_size,
            min(config.prefill_chunk_size, self.tokens_left),
            self.number,
            self.promotion_worth,
            self.offload_limit,
            resume_gate_open,
        )

    def charge(self, tokens: int, slots: int) -> None:
        """Spend `tokens` of the token budget and `slots` batch slots on requests scheduled in this pass."""
        self.tokens_left -= tokens
        self.slots_left -= slots
