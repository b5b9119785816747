"""The engine's host tier (`HostTier`): allocated when the engine is built, the copies of the scheduler's migration
plans to and from it, the checksums of what it holds, and its loss mid-run.

Suspension is lazy (spec/SPEC.md §4.2): a suspended request's blocks stay in the device cache, held, and only an
offload (a `to_host` plan, planned when an allocation needs the GPU room) copies some of them down; a resume copies
up only its host blocks (a `to_gpu` plan, or none when every block is still on the GPU).

What it keeps true:
* a host tier that cannot be allocated leaves the engine GPU-only, with a `HostTierFallbackWarning`, where
  recompute-pause can evict instead; otherwise it is a `ConfigError`;
* a resume's copies are ordered before the forward pass that reads its blocks (its fence orders the compute
  stream); an offload's are not, since the forward never reads host blocks;
* a migration's source blocks are given back only after its fence has completed (`settle`): an offload's GPU
  sources are reused only once their copy down is complete (FENCE);
* every host block a request holds has the checksum recorded when the offload that wrote it completed (with
  `verify_host_checksums`), kept per block: a request offloaded in several steps has the blocks of each;
* a plan whose copy failed, or a resume whose host blocks no longer have the checksums recorded for them, is
  reported failed and counted, and the scheduler replays its request;
* a lost host tier replays every suspended request holding host blocks (those held wholly on the GPU stay
  suspended), forgets every checksum and leaves the engine GPU-only.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable

import torch

from executor.engine_config import EngineConfig
from executor.engine_errors import HostTierFallbackWarning, HostTierLossRefused
from executor.faults import FaultInjector
from executor.kv_cache import Fence, HostTierAllocationError, MigrationFailed, PagedKVCache
from executor.run_totals import RunTotals
from kvstate.config import ConfigError
from kvstate.errors import PoolError
from kvstate.pool import TO_GPU, TO_HOST, MigrationPlan
from kvstate.scheduler import Scheduler, Step


class HostTier:
    """The host tier of one engine's `cache` (module docstring). `checksums` maps a suspended request's id to the
    CRC of each host block it holds, recorded when the offload that wrote the block completed (with
    `verify_host_checksums`); copies, failures and losses are counted in `totals`; copy faults come from
    `faults`."""

    def __init__(
        self,
        cache: PagedKVCache,
        device: torch.device,
        totals: RunTotals,
        faults: FaultInjector | None,
        verify_host_checksums: bool,
    ) -> None:
        self.cache, self.device, self.totals, self.faults = cache, device, totals, faults
        self.verify_host_checksums = verify_host_checksums
        self.checksums: dict[Hashable, dict[int, int]] = {}  # request id -> {host block: CRC-32}

    def attach(self, config: EngineConfig) -> int:
        """Allocate the host tier `config` asks for; returns its size in blocks, 0 when its allocation failed (the
        engine then falls back to GPU-only, with a `HostTierFallbackWarning`) or none is configured."""
        host_blocks = config.scheduler.host_blocks
        if not host_blocks:
            return 0
        simulate = config.simulate_host_alloc_failure or (self.faults is not None and self.faults.fire("host_alloc", 0))
        try:
            self.cache.attach_host_tier(host_blocks, simulate_failure=simulate)
        except HostTierAllocationError as err:
            if not config.scheduler.enable_recompute_pause:
                raise ConfigError(
                    f"{err}, and enable_recompute_pause=False: without a host tier no victim could be evicted; "
                    "enable recompute-pause so the engine can fall back to GPU-only operation"
                ) from err
            warnings.warn(
                f"{err}; falling back to GPU-only operation (every eviction is a recompute-pause)",
                HostTierFallbackWarning,
                stacklevel=3,
            )
            return 0
        return host_blocks

    def issue_all(self, step: Step[Fence]) -> None:
        """Issue the copies of every plan of `step` not issued yet; a plan whose copies failed is failed."""
        for plan in step.to_issue():
            step.issued(plan, self.issue(plan, step.scheduler.iteration))

    def settle(self, step: Step[Fence]) -> None:
        """Carry every migration of `step` to its end, then complete them: a plan a failure kept from being issued
        is issued now (or failed), and every fence is waited on (fenced source blocks become reusable only after
        their copy completed). Safe to call again: what was done is skipped."""
        self.issue_all(step)
        for plan, fence in step.to_wait():
            self.wait(plan, fence, step.scheduler.iteration)
            step.waited(plan)
        step.complete_migrations()

    def issue(self, plan: MigrationPlan, iteration: int) -> Fence | None:
        """Issue `plan`'s copies; None when they failed (or the host blocks it reads are corrupt) and it must be
        failed. A resume's fence orders the compute stream after its copies: resumed blocks are in place before
        attention reads them (an offload's copies are not waited for there: the forward never reads host blocks,
        and their GPU sources are freed only after `wait`)."""
        if plan.direction == TO_GPU and self.verify_host_checksums and not self.host_copy_intact(plan):
            self.totals.checksum_mismatches += 1
            return None
        kind = "copy_to_host" if plan.direction == TO_HOST else "copy_to_gpu"
        inject = self.faults is not None and self.faults.fire(kind, iteration, plan.request_id)
        try:
            fence = self.cache.migrate(plan, fail_after=len(plan.runs()) // 2 if inject else None)
        except MigrationFailed:
            self.totals.failed_copies += 1
            return None
        if plan.direction == TO_GPU:
            fence.order_before(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
        return fence

    def wait(self, plan: MigrationPlan, fence: Fence, iteration: int) -> None:
        """`plan`'s copies completed (its fenced sources may be reused once the scheduler is told)."""
        fence.wait()
        self.totals.migrations += 1
        if plan.direction == TO_HOST:
            self.after_offload(plan, iteration)

    def after_offload(self, plan: MigrationPlan, iteration: int) -> None:
        """An offload's copies completed: record the checksum of each host block it wrote (beside those of the
        request's earlier offloads), then let a `corrupt_host` fault hit one of them."""
        hosts = tuple(dst for _, dst in plan.pairs)
        if self.verify_host_checksums:
            recorded = self.checksums.setdefault(plan.request_id, {})
            recorded.update(zip(hosts, self.cache.host_checksums(hosts), strict=True))
        if self.faults is not None and self.faults.fire("corrupt_host", iteration, plan.request_id):
            self.cache.corrupt_host_block(hosts[0])

    def host_copy_intact(self, plan: MigrationPlan) -> bool:
        """Every host block a resume reads has the checksum recorded when an offload wrote it, and no other host
        block of its request has one (a resume copies up all of them); the record is consumed."""
        recorded = self.checksums.pop(plan.request_id, {})
        hosts = tuple(src for src, _ in plan.pairs)
        return set(recorded) == set(hosts) and tuple(recorded[h] for h in hosts) == self.cache.host_checksums(hosts)

    def forget(self, request_id: Hashable) -> None:
        """`request_id` holds no host block any more (its host copy was read, lost or released)."""
        self.checksums.pop(request_id, None)

    def lose(self, scheduler: Scheduler, reason: str) -> list[Hashable]:
        """The host tier is gone: every suspended request of `scheduler` holding host blocks takes `lose_host_copy`
        and will be replayed (one held wholly on the GPU stays suspended there), the host tensor is dropped, and
        the engine goes on GPU-only. Returns the ids of the requests that lost their host copy; raises
        `HostTierLossRefused` (nothing changed) when the scheduler refuses."""
        if not scheduler.pool.has_host_tier:
            return []
        try:
            lost = scheduler.set_host_capacity(0)
        except PoolError as err:
            raise HostTierLossRefused(f"{reason}: {err}") from err
        self.cache.detach_host_tier()
        self.checksums.clear()
        self.totals.host_tier_losses += 1
        warnings.warn(
            f"{reason}; {len(lost)} suspended requests with host blocks will be replayed and the engine runs "
            "GPU-only from now on (every eviction is a recompute-pause)",
            HostTierFallbackWarning,
            stacklevel=3,
        )
        return [r.request_id for r in lost]
