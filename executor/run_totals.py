"""The run totals of an engine (`RunTotals`): sums over every step since it was built."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields


@dataclass
class RunTotals:
    """The run totals of an engine (`Engine.totals`): sums over every step since it was built, where
    `Engine.stats()` describes the last step only. Updated after each step and each call that fires lifecycle
    events (cancel, a lost host tier), so they are complete between calls.

    * work: `steps`, `generated_tokens`, `scheduled_tokens`, and `recomputed_tokens` (replayed after a
      recompute-pause: never counted as cache hits);
    * preemptions by path (`preemptions`): suspensions (KV copied to the host tier) and recompute-pauses (KV
      dropped, replayed later; a suspended request promoted to recompute-pause, or a resume whose copy failed,
      counts here too); every lifecycle event by name in `events`;
    * copies: `migrations` (suspend and resume copy plans carried out to completion), `blocks_migrated`,
      `bytes_migrated`;
    * failures (`failures`): copies that failed, host copies found corrupt, host copies lost, host tiers lost;
      injected faults by kind in `faults`.
    """

    steps: int = 0
    generated_tokens: int = 0
    recomputed_tokens: int = 0
    scheduled_tokens: int = 0
    migrations: int = 0  # migration plans whose copies completed
    blocks_migrated: int = 0
    bytes_migrated: int = 0
    events: Counter = field(default_factory=Counter)  # lifecycle event name -> transitions fired
    faults: Counter = field(default_factory=Counter)  # fault kind -> faults injected (executor.faults)
    failed_copies: int = 0  # migration plans reported failed with Scheduler.fail_migration
    checksum_mismatches: int = 0  # host copies found corrupt on resume (verify_host_checksums)
    host_tier_losses: int = 0  # times the host tier was dropped mid-run (lose_host_tier)

    @property
    def suspensions(self) -> int:
        return self.events["suspend"]

    @property
    def recompute_pauses(self) -> int:
        return self.events["recompute_pause"]

    @property
    def preemptions(self) -> dict[str, int]:
        """Preemptions by path: ``{"suspend": n, "recompute_pause": n}``."""
        return {"suspend": self.suspensions, "recompute_pause": self.recompute_pauses}

    @property
    def failures(self) -> dict[str, int]:
        """What failed and was recovered from, by kind (each replays the requests it hit)."""
        return {
            "failed_copies": self.failed_copies,
            "checksum_mismatches": self.checksum_mismatches,
            "lost_host_copies": self.events["lose_host_copy"],
            "host_tier_losses": self.host_tier_losses,
        }

    def to_dict(self) -> dict:
        """JSON-ready: every total, the preemptions and failures by kind, events and faults as plain dicts."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(events=dict(self.events), faults=dict(self.faults), preemptions=self.preemptions)
        d["failures"] = self.failures
        return d
