"""Per-iteration statistics (DESIGN §1.8).

Invariant kept (STATS-COUNT): suspended and recompute-paused requests are counted with the KV tokens they
hold or must recompute; tokens recomputed by replay are reported as `recomputed_tokens`, never as cache hits
(this model has no prefix cache, so no token is ever a cache hit).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class IterationStats:
    """What one iteration did and what the pool looks like after it."""

    iteration: int
    requests_per_state: dict[str, int] = field(default_factory=dict)
    suspended_kv_tokens: int = 0
    recompute_paused_tokens_to_replay: int = 0
    suspended_this_iteration: int = 0
    recompute_paused_this_iteration: int = 0
    preemptions: int = 0
    scheduled_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    blocks_migrated: int = 0
    bytes_migrated: int = 0
    gpu_blocks_used: int = 0
    gpu_capacity: int = 0
    host_blocks_used: int = 0
    host_capacity: int = 0
    host_tier_fallback: bool = False

    @property
    def num_suspended(self) -> int:
        return self.requests_per_state.get("suspended", 0)

    @property
    def num_recompute_paused(self) -> int:
        return self.requests_per_state.get("recompute_paused", 0) + self.requests_per_state.get("awaiting_consensus", 0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["requests_per_state"] = dict(self.requests_per_state)
        return d
