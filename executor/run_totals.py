"""The run totals of an engine (`RunTotals`): sums over every step since it was built, what one step's output says
about its resumes (`resume_copies`), and the summary rows of the copies lazy suspension made and saved
(`copy_rows`, shared by the commands that print a run's totals)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from kvstate.output import SchedulerOutput
from kvstate.pool import TO_GPU
from kvstate.stats import IterationStats


def resume_copies(output: SchedulerOutput) -> tuple[int, int]:
    """(requests resumed without a copy, GPU blocks they and the others re-locked without one) of `output`: each
    resumed request's GPU blocks after the resume, less those its copy up (its `to_gpu` plan, if any) fills. Read
    it before the step completes: a resumed request is not scheduled in the pass that resumes it, so its GPU
    blocks are then exactly those the resume gave it."""
    if not output.resumed:
        return 0, 0
    copied: dict[object, int] = {}
    for plan in output.migrations:
        if plan.direction == TO_GPU:
            copied[plan.request_id] = copied.get(plan.request_id, 0) + plan.num_blocks
    without = relocked = 0
    for request in output.resumed:
        onboarded = copied.get(request.request_id, 0)
        without += not onboarded
        relocked += request.num_gpu_blocks - onboarded
    return without, relocked


@dataclass
class RunTotals:
    """The run totals of an engine (`Engine.totals`): sums over every step since it was built, where
    `Engine.stats()` describes the last step only. Updated after each step and each call that fires lifecycle
    events (cancel, a lost host tier), so they are complete between calls.

    * work: `steps`, `generated_tokens`, `scheduled_tokens`, and `recomputed_tokens` (replayed after a
      recompute-pause: never counted as cache hits);
    * preemptions by path (`preemptions`): suspensions (KV held, moved to the host tier only when an allocation
      needs the GPU room) and recompute-pauses (KV dropped, replayed later; a suspended request promoted to
      recompute-pause, or a resume whose copy failed, counts here too); every lifecycle event by name in `events`;
    * copies: `migrations` (offload and resume copy plans carried out to completion), `blocks_migrated`,
      `bytes_migrated`; by direction, `blocks_offloaded` (held GPU blocks copied down) and `blocks_onboarded`
      (host blocks copied up by resumes); and what lazy suspension saved: `resumed_without_copy` (resumes that
      found every block still on the GPU) and `blocks_relocked` (held GPU blocks resumes locked again, no copy);
    * failures (`failures`): copies that failed, host copies found corrupt, host copies lost, host tiers lost;
      injected faults by kind in `faults`.

    The copy totals count the plans the step carried out (a failed plan is withdrawn and not counted)."""

    steps: int = 0
    generated_tokens: int = 0
    recomputed_tokens: int = 0
    scheduled_tokens: int = 0
    migrations: int = 0  # migration plans whose copies completed
    blocks_migrated: int = 0
    bytes_migrated: int = 0
    blocks_offloaded: int = 0  # GPU -> host: held blocks moved for an allocation (or at suspension, eager)
    blocks_onboarded: int = 0  # host -> GPU: a resume's copies
    resumed_without_copy: int = 0  # resumes whose request held every block on the GPU
    blocks_relocked: int = 0  # held GPU blocks locked again by a resume, with no copy
    events: Counter = field(default_factory=Counter)  # lifecycle event name -> transitions fired
    faults: Counter = field(default_factory=Counter)  # fault kind -> faults injected (executor.faults)
    failed_copies: int = 0  # migration plans reported failed with Scheduler.fail_migration
    checksum_mismatches: int = 0  # host copies found corrupt on resume (verify_host_checksums)
    host_tier_losses: int = 0  # times the host tier was dropped mid-run (lose_host_tier)

    def add_step(self, stats: IterationStats, resumes: tuple[int, int] = (0, 0)) -> None:
        """Add one completed step: its statistics, and `resume_copies` of the output it carried out (amended by
        its failures), read before the step completed."""
        self.steps += 1
        self.generated_tokens += stats.generated_tokens
        self.recomputed_tokens += stats.recomputed_tokens
        self.scheduled_tokens += stats.scheduled_tokens
        self.blocks_migrated += stats.blocks_migrated
        self.bytes_migrated += stats.bytes_migrated
        self.blocks_offloaded += stats.blocks_offloaded
        self.blocks_onboarded += stats.blocks_onboarded
        self.resumed_without_copy += resumes[0]
        self.blocks_relocked += resumes[1]

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


def copy_rows(totals: Mapping) -> list[tuple[str, str]]:
    """(metric, value) rows of the copies of a run whose `totals` are `RunTotals.to_dict()` (or a pipeline's, with
    the same names): offloads and the blocks they moved down, the blocks resumes copied up, and the resumes and
    blocks that needed no copy because the blocks were still on the GPU."""
    events = totals.get("events", {})
    return [
        ("offloads", str(events.get("offload", 0))),
        ("blocks offloaded (GPU -> host)", str(totals.get("blocks_offloaded", 0))),
        ("blocks onboarded (host -> GPU)", str(totals.get("blocks_onboarded", 0))),
        ("resumes without a copy", f"{totals.get('resumed_without_copy', 0)} of {events.get('resume', 0)}"),
        ("blocks re-locked without a copy", str(totals.get("blocks_relocked", 0))),
    ]
