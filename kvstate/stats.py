"""Per-iteration statistics, and the tally that keeps them up to date on every transition.

Invariant kept (STATS-COUNT, names as in SPEC.md section 11): suspended and recompute-paused requests are
counted (`num_suspended`; `num_recompute_paused` includes victims awaiting consensus) with the KV tokens they hold
(`suspended_kv_tokens`, held on the GPU or in the host tier, with `suspended_gpu_blocks` still on the GPU;
`recompute_paused_kv_tokens`, still on the GPU while consensus is awaited)
and the tokens their replays must recompute (`recompute_paused_tokens_to_replay`); tokens recomputed by replay are
reported as `recomputed_tokens`, never as cache hits (this model has no prefix cache, so no token is ever a cache
hit). `requests_per_state` is keyed by the spec's state names, every state present from the start.

The scheduler reads these figures from its `kvstate.scheduler.StateTally`, which it updates on each transition, so
that a step costs O(requests scheduled): nothing walks the requests a step leaves alone
(`Scheduler.check_invariants` recounts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class IterationStats:
    """What one iteration did and what the pool looks like after it."""

    iteration: int
    requests_per_state: dict[str, int] = field(default_factory=dict)
    num_suspended: int = 0
    num_recompute_paused: int = 0
    suspended_kv_tokens: int = 0
    recompute_paused_kv_tokens: int = 0
    recompute_paused_tokens_to_replay: int = 0
    suspended_this_iteration: int = 0
    recompute_paused_this_iteration: int = 0
    preemptions: int = 0
    scheduled_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    blocks_migrated: int = 0
    bytes_migrated: int = 0
    blocks_offloaded: int = 0
    blocks_onboarded: int = 0
    suspended_gpu_blocks: int = 0
    gpu_blocks_used: int = 0
    gpu_capacity: int = 0
    host_blocks_used: int = 0
    host_capacity: int = 0
    host_tier_fallback: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        d["requests_per_state"] = dict(self.requests_per_state)
        return d
