"""The engine's host tier (`HostTier`): allocated when the engine is built, the copies of the scheduler's migration
plans to and from it, the checksums of what it holds, and its loss mid-run.

What it keeps true:
* a host tier that cannot be allocated leaves the engine GPU-only, with a `HostTierFallbackWarning`, where
  recompute-pause can evict instead; otherwise it is a `ConfigError`;
* a resume's copies are ordered before the forward pass that reads its blocks (its fence orders the compute
  stream); a suspend's copies are not, since the forward never reads host blocks;
* a migration's source blocks are given back only after its fence has completed (`settle`);
* a plan whose copy failed, or whose host copy no longer has the checksums recorded when it was written, is
  reported failed and counted, and the scheduler replays its request;
* a lost host tier replays every suspended request, forgets every checksum and leaves the engine GPU-only.
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
    """The host tier of one engine's `cache` (module docstring). `checksums` maps a suspended request's id to its
    host blocks and their CRCs, recorded when its copies completed (with `verify_host_checksums`); copies, failures
    and losses are counted in `totals`; copy faults come from `faults`."""

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
        self.checksums: dict[Hashable, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # id -> (host blocks, CRCs)

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
        """Issue `plan`'s copies; None when they failed (or its host copy is corrupt) and it must be failed. A
        resume's fence orders the compute stream after its copies: resumed blocks are in place before attention
        reads them (a suspend's copies are not waited for there: the forward never reads host blocks, and their
        sources are freed only after `wait`)."""
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
            self.after_suspend(plan, iteration)

    def after_suspend(self, plan: MigrationPlan, iteration: int) -> None:
        """A suspend's copies completed: record its checksums, then let a `corrupt_host` fault hit the copy."""
        hosts = tuple(dst for _, dst in plan.pairs)
        if self.verify_host_checksums:
            self.checksums[plan.request_id] = (hosts, self.cache.host_checksums(hosts))
        if self.faults is not None and self.faults.fire("corrupt_host", iteration, plan.request_id):
            self.cache.corrupt_host_block(hosts[0])

    def host_copy_intact(self, plan: MigrationPlan) -> bool:
        """The host blocks a resume reads still have the checksums recorded when they were written."""
        recorded = self.checksums.pop(plan.request_id, None)
        hosts = tuple(src for src, _ in plan.pairs)
        return recorded is not None and recorded[0] == hosts and recorded[1] == self.cache.host_checksums(hosts)

    def lose(self, scheduler: Scheduler, reason: str) -> list[Hashable]:
        """The host tier is gone: every suspended request of `scheduler` takes `lose_host_copy` and will be
        replayed, the host tensor is dropped, and the engine goes on GPU-only. Returns the ids of the requests that
        lost their host copy; raises `HostTierLossRefused` (nothing changed) when the scheduler refuses."""
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
            f"{reason}; {len(lost)} suspended requests will be replayed and the engine runs GPU-only "
            "from now on (every eviction is a recompute-pause)",
            HostTierFallbackWarning,
            stacklevel=3,
        )
        return [r.request_id for r in lost]
