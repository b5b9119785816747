"""Host-tier fallback agreed across ranks (SPEC.md §9.2, PP-FALLBACK).

Every rank tries to allocate its own host tier; an all-reduce(MIN) of the outcomes decides. If any rank failed,
every rank drops its host tier and runs GPU-only (`host_blocks = 0`, every eviction a recompute-pause).

Invariant kept: all ranks return the same `host_blocks` and `fallback` (they come from the same collective), so
ranks never disagree about capacity; the scheduler on rank 0 is built with exactly that `host_blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass

from executor.kv_cache import HostTierAllocationError, PagedKVCache
from executor.pipeline.comm import Comm


@dataclass(frozen=True)
class HostTierDecision:
    """One rank's view of the agreement: what it asked for, how it fared, what every rank runs with."""

    requested_blocks: int
    local_ok: bool
    agreed_ok: bool
    failed_ranks: tuple[int, ...]
    host_blocks: int  # what every rank runs with: requested_blocks, or 0 after a fallback
    local_error: str | None = None

    @property
    def fallback(self) -> bool:
        """A host tier was asked for and some rank could not allocate it."""
        return self.requested_blocks > 0 and not self.agreed_ok

    def to_dict(self) -> dict:
        return {
            "requested_blocks": self.requested_blocks,
            "local_ok": self.local_ok,
            "agreed_ok": self.agreed_ok,
            "failed_ranks": list(self.failed_ranks),
            "host_blocks": self.host_blocks,
            "fallback": self.fallback,
            "local_error": self.local_error,
        }


def agree_host_tier(
    cache: PagedKVCache, host_blocks: int, comm: Comm, *, simulate_failure: bool = False
) -> HostTierDecision:
    """Try to attach `host_blocks` to `cache`, then agree with every rank; detaches it again on a fallback.
    Every rank must call this with the same `host_blocks` (the collectives run even when it is 0)."""
    ok, error = True, None
    if host_blocks:
        try:
            cache.attach_host_tier(host_blocks, simulate_failure=simulate_failure)
        except HostTierAllocationError as err:
            ok, error = False, str(err)
    agreed = comm.all_reduce_min(int(ok)) == 1
    outcomes = comm.all_gather(ok)
    failed = tuple(rank for rank, fine in enumerate(outcomes) if not fine)
    if not agreed:
        cache.host_cache = None  # release this rank's tier too: every rank runs GPU-only
    return HostTierDecision(host_blocks, ok, agreed, failed, host_blocks if agreed else 0, error)
